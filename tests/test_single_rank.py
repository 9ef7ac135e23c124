"""stages/rl/single_rank.py: one data-parallel rank's ZeRO 1-2 without its gradient reduction.

Real DeepSpeed (ZeRO-2, gloo on CPU, contiguous_gradients off as in configs/ds_zero2_gpu.json, buckets
small enough that several flush in each backward), real train code (tests/workers/single_rank.py):
two optimizer steps of two accumulated micro-batches each give bit-identical weights with the
reduction and without it, and on two ranks the reduction is kept.
"""

import json
from pathlib import Path

import pytest
import torch

from stages.rl.tiny_model import create_base_model
from tests.test_train_batching import run_workers

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("single_rank")
    ds = json.loads((ROOT / "configs" / "ds_zero2_cpu.json").read_text())
    ds["zero_optimization"].update(contiguous_gradients=False, reduce_bucket_size=20000)
    (tmp / "ds.json").write_text(json.dumps(ds))
    overrides = [f"train.deepspeed_config={tmp / 'ds.json'}", "train.remove_padding=true",
                 "train.micro_batch_size=3", "train.gradient_accumulation_steps=2"]
    return create_base_model(tmp / "base", "tiny-llama", seed=0), overrides


@pytest.mark.slow
def test_one_rank_skips_the_reduction_and_gets_the_same_weights(tmp_path, setup):
    model_dir, overrides = setup
    kept = run_workers("tests.workers.single_rank", tmp_path, model_dir, 1, ["mode=keep", *overrides], "kept")
    skipped = run_workers("tests.workers.single_rank", tmp_path, model_dir, 1, ["mode=skip", *overrides], "skipped")
    assert not kept["applied"] and kept["reductions"] >= 8  # several buckets a backward, 4 backwards
    assert skipped["applied"] and skipped["reductions"] == 0
    for name, p in kept["params"].items():
        assert torch.equal(skipped["params"][name], p), name
    # The steps did train: the weights are not the base model's.
    from stages.rl.modeling import load_policy
    base = dict(load_policy(model_dir, "float32").named_parameters())
    moved = sum(not torch.equal(base[n].detach(), p) for n, p in kept["params"].items())
    assert moved == len(kept["params"])


@pytest.mark.slow
def test_two_ranks_keep_the_reduction(tmp_path, setup):
    model_dir, overrides = setup
    got = run_workers("tests.workers.single_rank", tmp_path, model_dir, 2, ["mode=skip", *overrides], "two")
    assert not got["applied"] and got["reductions"] > 0
