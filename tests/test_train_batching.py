"""tuning.max_tokens_per_micro_batch: rows grouped by length into micro-batches within a token budget.

The gradient of an optimizer step must not depend on how its rows are grouped: with the budget on,
on 1 or 2 ranks and for any budget, it equals the gradient of today's fixed micro-batches when
those hold the whole step in one micro-batch (the step's token mean). Real DeepSpeed (ZeRO-2 and
ZeRO-3, gloo on CPU), real train code (tests/workers/step_gradients.py).
"""

import itertools
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from jobs.launchers import free_port
from stages.rl.tiny_model import create_base_model
from stages.rl.packing import row_width
from stages.rl.steps import MICRO_BATCH_POSITIONS, token_budget_groups
from tests.workers.step_gradients import train_rows

ROOT = Path(__file__).resolve().parents[1]


def step_gradients(tmp_path, model_dir, world: int, overrides: list[str], name: str) -> dict:
    return run_workers("tests.workers.step_gradients", tmp_path, model_dir, world, overrides, name)


def run_workers(module: str, tmp_path, model_dir, world: int, overrides: list[str], name: str) -> dict:
    """`python -m module MODEL_DIR OUT key=value ...` on `world` ranks (gloo on CPU); what rank 0 saved."""
    return run_workers_in_turn(module, tmp_path, model_dir, world, {name: overrides})[name]


def run_workers_in_turn(module: str, tmp_path, model_dir, world: int, runs: dict[str, list[str]],
                        cpu: bool = True) -> dict:
    """`python -m module MODEL_DIR OUT key=value ... -- OUT key=value ...` on `world` ranks (DeepSpeed on
    the CPU, or with `cpu` False on the GPUs): the runs one after the other in the same processes, which
    start once. What rank 0 saved, by run name, loaded onto the host."""
    args = [arg for name, overrides in runs.items() for arg in ("--", str(tmp_path / f"{name}.pt"), *overrides)][1:]
    port = free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               # The project first, then wherever this environment's own path finds its packages.
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               **({"DS_ACCELERATOR": "cpu"} if cpu else {})}
        procs.append(subprocess.Popen([sys.executable, "-m", module, str(model_dir), *args], cwd=ROOT,
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for p in procs:
        output, _ = p.communicate(timeout=300)
        assert p.returncode == 0, output[-3000:]
    return {name: torch.load(tmp_path / f"{name}.pt", map_location="cpu", weights_only=True) for name in runs}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return create_base_model(tmp_path_factory.mktemp("m") / "base", "tiny-llama", seed=0)


@pytest.mark.slow
@pytest.mark.parametrize("zero", ["configs/ds_zero2_cpu.json", "configs/ds_zero3_cpu.json"])
def test_step_gradient_does_not_depend_on_grouping(tmp_path, model_dir, zero):
    ds = [f"train.deepspeed_config={zero}", "tuning.remove_padding=false"]  # padded rows: tests/test_packing.py packs
    # Today's fixed micro-batches, the whole 12-row step in one: the step's token mean.
    whole = step_gradients(tmp_path, model_dir, 1, ds + ["train.micro_batch_size=12"], "whole")
    assert whole["micro_batches"] == [12]
    # The same rows, 2 ranks x 6, regrouped within budgets of 60 and 25 positions; and in fixed
    # micro-batches of 6 rows per rank, a different loss (a mean of two token means). Each its own
    # engine, in the same two processes; the fixed one first, so that it cannot read what an earlier
    # engine left behind, and the two that must equal the whole step after it.
    two_ranks = run_workers_in_turn("tests.workers.step_gradients", tmp_path, model_dir, 2, {
        "fixed": ds + ["train.micro_batch_size=6"],
        "split": ds + ["train.micro_batch_size=6", "tuning.max_tokens_per_micro_batch=60"],
        "finer": ds + ["train.micro_batch_size=3", "train.gradient_accumulation_steps=2",
                       "tuning.max_tokens_per_micro_batch=25"]})
    split, finer, fixed = two_ranks["split"], two_ranks["finer"], two_ranks["fixed"]
    assert len(split["micro_batches"]) >= 2 and len(finer["micro_batches"]) > len(split["micro_batches"])
    for other in (split, finer):
        for name, g in whole["grads"].items():
            assert torch.allclose(other["grads"][name], g, rtol=1e-4, atol=1e-7), name
    assert any(not torch.allclose(fixed["grads"][n], g, rtol=1e-4, atol=1e-7) for n, g in whole["grads"].items())


def test_groups_fill_the_budget_longest_first():
    rows = train_rows(40, seed=3)
    groups = token_budget_groups(rows, 64)
    assert sorted(id(r) for g in groups for r in g) == sorted(id(r) for r in rows)
    for g in groups:
        assert len(g) * max(map(row_width, g)) <= 64 or len(g) == 1
    assert [row_width(g[0]) for g in groups] == sorted((row_width(g[0]) for g in groups), reverse=True)
    # A row longer than the budget runs alone.
    assert token_budget_groups(rows[:3], 1) == [[r] for r in sorted(rows[:3], key=row_width, reverse=True)]


def grouping_cost(groups) -> int:
    return sum(MICRO_BATCH_POSITIONS + len(g) * max(map(row_width, g)) for g in groups)


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


def train_context(world: int, rank: int = 0, **train):
    """What optimizer_steps reads of a StageContext: the run's seed, the iteration, the rank, the
    world size, the train section and the tuning section (real configs, their checks included);
    `train` holds keys of either section."""
    from types import SimpleNamespace

    from stages.runtime.config import TrainConfig, TuningConfig
    tuning_keys = {"balance_tokens", "max_tokens_per_micro_batch", "remove_padding"}
    return SimpleNamespace(cfg=SimpleNamespace(seed=0, train=TrainConfig(**{k: v for k, v in train.items()
                                                                            if k not in tuning_keys}),
                                               tuning=TuningConfig(**{k: v for k, v in train.items()
                                                                      if k in tuning_keys})),
                           iteration=3, rank=rank, world_size=world)


def realistic_rows(n: int, seed: int) -> list[dict]:
    # Prompt and completion lengths shaped like the reference workload's: mostly short completions,
    # a tail clipped at 512 new tokens.
    rng = random.Random(seed)
    return [{"prompt_ids": [1] * rng.randint(40, 120), "completion_ids": [2] * min(512, 1 + int(rng.expovariate(1 / 130))),
             "id": i} for i in range(n)]


def test_balanced_groups_deal_every_row_once_into_equal_counts_of_near_equal_tokens():
    from stages.rl.steps import balanced_groups

    widths = [row_width(r) for r in realistic_rows(2048, seed=1)]
    groups = balanced_groups(widths, 64, 32)
    assert sorted(i for g in groups for i in g) == list(range(2048))
    assert {len(g) for g in groups} == {32}
    sums = [sum(widths[i] for i in g) for g in groups]
    dealt = [sum(widths[i:i + 32]) for i in range(0, 2048, 32)]  # in the given (shuffled) order
    assert max(sums) - min(sums) <= max(widths) // 8 < (max(dealt) - min(dealt)) // 10
    # Equal widths keep the given order: the caller's shuffle decides which row goes where.
    assert balanced_groups([5, 5, 5, 5], 2, 2) == [[0, 2], [1, 3]]
    with pytest.raises(ValueError, match="do not fill 3 groups of 2"):
        balanced_groups([1, 2, 3], 3, 2)


@pytest.mark.parametrize("world,accumulation", [(1, 1), (2, 1), (2, 3)])
def test_balanced_micro_batches_hold_every_row_once_with_the_ranks_tokens_near_equal(world, accumulation):
    from stages.rl.steps import micro_batches_by_rank, optimizer_steps

    rows = realistic_rows(1000, seed=world + accumulation)  # not whole global batches: None rows pad
    for balance in (True, False):
        settings = dict(micro_batch_size=16, gradient_accumulation_steps=accumulation, balance_tokens=balance, epochs=2)
        ctx = train_context(world, **settings)
        per_rank = micro_batches_by_rank(rows, ctx, 16 * accumulation * world)
        assert len({len(m) for m in per_rank}) == 1  # the same count on every rank
        seen = [r["id"] for m in per_rank for micro in m for r in micro if r is not None]
        assert sorted(seen) == sorted(list(range(1000)) * 2)  # two epochs, each row once in each
        assert all(len(micro) == 16 for m in per_rank for micro in m)
        tokens = [sum(row_width(r) for r in micro if r) for m in per_rank for micro in m]
        spread = max(tokens) - min(tokens)
        if balance:
            assert spread <= 512, spread
            assert micro_batches_by_rank(rows, ctx, 16 * accumulation * world) == per_rank  # the same on every rank
            steps = [optimizer_steps(rows, train_context(world, rank, **settings)) for rank in range(world)]
            assert len({len(s) for s in steps}) == 1
            assert all(len(step.micro_batches) == accumulation for s in steps for step in s)
        else:
            assert spread > 2048, spread


@pytest.mark.parametrize("overrides, advice", [
    ([], "Set tuning.max_tokens_per_micro_batch=2100 (a token budget) or train.micro_batch_size lower than 2; "
         "or model.gradient_checkpointing=true;"),
    (["tuning.max_tokens_per_micro_batch=3000"], "Set tuning.max_tokens_per_micro_batch (now 3000) lower; or "
                                                 "model.gradient_checkpointing=true;"),
    (["model.gradient_checkpointing=true"], "train.micro_batch_size lower than 2; or more GPUs with ZeRO-3"),
])
def test_a_micro_batch_out_of_gpu_memory_names_its_size_and_the_settings(tmp_path, overrides, advice):
    # The message train raises in place of torch's out-of-memory error (stages/train.py run_updates).
    # A CUDA allocation cannot fail on this CPU machine: the error is torch's own, built here.
    from stages.runtime.config import dump_config, load_config
    from stages.runtime.stage import make_context
    from stages.train import out_of_memory_advice

    run = tmp_path / "run"
    run.mkdir()
    cfg = load_config(ROOT / "configs" / "local_tiny.yaml", [f"run_dir={run}", "train.micro_batch_size=2", *overrides])
    (run / "config.yaml").write_text(dump_config(cfg))
    ctx = make_context("train", str(run), 3, waiting=True)
    error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 72.00 MiB.")
    text = out_of_memory_advice(ctx, [1500, 2700], 5, 2, 4, error)
    assert text.startswith("iteration 3, rank 0: out of GPU memory in optimizer step 5, micro-batch 2 of 4 "
                           "(2 rows, 4200 positions, the longest 2700)"), text
    assert advice in text and "ZeRO-3" in text
    assert text.endswith("(CUDA out of memory. Tried to allocate 72.00 MiB.)")
