"""train.max_tokens_per_micro_batch: rows grouped by length into micro-batches within a token budget.

The gradient of an optimizer step must not depend on how its rows are grouped: with the budget on,
on 1 or 2 ranks and for any budget, it equals the gradient of today's fixed micro-batches when
those hold the whole step in one micro-batch (the step's token mean). Real DeepSpeed (ZeRO-2 and
ZeRO-3, gloo on CPU), real train code (tests/workers/step_gradients.py).
"""

import itertools
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stages.rl.tiny_model import create_base_model
from stages.train import MICRO_BATCH_POSITIONS, token_budget_groups
from tests.workers.step_gradients import train_rows

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def step_gradients(tmp_path, model_dir, world: int, overrides: list[str], name: str) -> dict:
    return run_workers("tests.workers.step_gradients", tmp_path, model_dir, world, overrides, name)


def run_workers(module: str, tmp_path, model_dir, world: int, overrides: list[str], name: str) -> dict:
    """`python -m module MODEL_DIR OUT key=value ...` on `world` ranks (gloo on CPU); what rank 0 saved."""
    out = tmp_path / f"{name}.pt"
    port = free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT)}
        procs.append(subprocess.Popen([sys.executable, "-m", module, str(model_dir), str(out), *overrides], cwd=ROOT,
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for p in procs:
        output, _ = p.communicate(timeout=300)
        assert p.returncode == 0, output[-3000:]
    return torch.load(out, weights_only=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return create_base_model(tmp_path_factory.mktemp("m") / "base", "tiny-llama", seed=0)


@pytest.mark.slow
@pytest.mark.parametrize("zero", ["configs/ds_zero2_cpu.json", "configs/ds_zero3_cpu.json"])
def test_step_gradient_does_not_depend_on_grouping(tmp_path, model_dir, zero):
    ds = [f"train.deepspeed_config={zero}", "train.remove_padding=false"]  # padded rows: tests/test_packing.py packs
    # Today's fixed micro-batches, the whole 12-row step in one: the step's token mean.
    whole = step_gradients(tmp_path, model_dir, 1, ds + ["train.micro_batch_size=12"], "whole")
    assert whole["micro_batches"] == [12]
    # The same rows, 2 ranks x 6, regrouped within budgets of 60 and 25 positions.
    split = step_gradients(tmp_path, model_dir, 2, ds + ["train.micro_batch_size=6",
                                                        "train.max_tokens_per_micro_batch=60"], "split")
    finer = step_gradients(tmp_path, model_dir, 2, ds + ["train.micro_batch_size=3", "train.gradient_accumulation_steps=2",
                                                        "train.max_tokens_per_micro_batch=25"], "finer")
    assert len(split["micro_batches"]) >= 2 and len(finer["micro_batches"]) > len(split["micro_batches"])
    for other in (split, finer):
        for name, g in whole["grads"].items():
            assert torch.allclose(other["grads"][name], g, rtol=1e-4, atol=1e-7), name
    # Fixed micro-batches of 6 rows per rank are a different loss (a mean of two token means).
    fixed = step_gradients(tmp_path, model_dir, 2, ds + ["train.micro_batch_size=6"], "fixed")
    assert any(not torch.allclose(fixed["grads"][n], g, rtol=1e-4, atol=1e-7) for n, g in whole["grads"].items())


def test_groups_fill_the_budget_longest_first():
    rows = train_rows(40, seed=3)
    length = lambda r: len(r["prompt_ids"]) + len(r["completion_ids"])  # noqa: E731
    groups = token_budget_groups(rows, 64)
    assert sorted(id(r) for g in groups for r in g) == sorted(id(r) for r in rows)
    for g in groups:
        assert len(g) * max(map(length, g)) <= 64 or len(g) == 1
    assert [length(g[0]) for g in groups] == sorted((length(g[0]) for g in groups), reverse=True)
    # A row longer than the budget runs alone.
    assert token_budget_groups(rows[:3], 1) == [[r] for r in sorted(rows[:3], key=length, reverse=True)]


def grouping_cost(groups) -> int:
    width = lambda r: len(r["prompt_ids"]) + len(r["completion_ids"])  # noqa: E731
    return sum(MICRO_BATCH_POSITIONS + len(g) * max(map(width, g)) for g in groups)


@pytest.mark.parametrize("seed", range(6))
def test_groups_are_the_cheapest_runs_of_the_length_order(seed):
    """Against every way of cutting the longest-first order into runs that respect the budget."""
    rng = random.Random(seed)
    rows = [{"prompt_ids": [1] * 64, "completion_ids": [2] * rng.choice([rng.randint(1, 200), 512])}
            for _ in range(10)]
    budget = rng.choice([1200, 3000, 8192])
    order = sorted(rows, key=lambda r: len(r["completion_ids"]), reverse=True)
    best = None
    for cuts in itertools.product((False, True), repeat=len(order) - 1):
        groups, start = [], 0
        for i, cut in enumerate(cuts, 1):
            if cut:
                groups.append(order[start:i])
                start = i
        groups.append(order[start:])
        if all(len(g) == 1 or len(g) * (64 + len(g[0]["completion_ids"])) <= budget for g in groups):
            best = min(best or grouping_cost(groups), grouping_cost(groups))
    groups = token_budget_groups(rows, budget)
    assert grouping_cost(groups) == best
    # Mostly short rows and a few long ones: the long ones go alone rather than pad the rest.
    mixed = [{"prompt_ids": [1] * 64, "completion_ids": [2] * n} for n in [512] * 3 + [120] * 29]
    assert [len(g) for g in token_budget_groups(mixed, 16384)] == [3, 29]
