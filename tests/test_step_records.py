"""Train's per-step records (stages/rl/step_records.py) and what train does with them."""

from types import SimpleNamespace

import pytest
import torch

from stages.rl.step_records import record
from stages.runtime.config import load_config
from stages.train import check_gradient, deepspeed_config
from tests.devices import DEVICES


def metrics(loss: float, clip: float, device) -> dict:
    return {"loss": torch.tensor(loss, device=device), "clip_frac": torch.tensor(clip, device=device)}


@pytest.mark.parametrize("device", DEVICES)
def test_a_record_is_the_means_of_its_micro_batches(device):
    got = record([metrics(1.0, 0.5, device), metrics(3.0, 0.0, device)], {"step": 1, "tokens": 7})
    assert got == {"loss": 2.0, "clip_frac": 0.25, "step": 1, "tokens": 7}
    got = record([metrics(2.0, 0.25, device)], {"step": 2, "tokens": 3}, torch.tensor(0.5, device=device))
    assert got == {"loss": 2.0, "clip_frac": 0.25, "grad_norm": 0.5, "step": 2, "tokens": 3}


def ctx_of(overrides: list[str], world: int = 1) -> SimpleNamespace:
    return SimpleNamespace(cfg=load_config("configs/local_tiny.yaml", overrides), world_size=world, rank=0,
                           iteration=4)


def test_a_non_finite_norm_stops_train_unless_deepspeed_skipped_the_step():
    ctx = ctx_of([])
    check_gradient(ctx, {"grad_norm": 1.5, "step": 3, "skipped": False})
    check_gradient(ctx, {"grad_norm": float("inf"), "step": 3, "skipped": True})  # DeepSpeed's check skipped it
    with pytest.raises(FloatingPointError, match="optimizer step 3 of iteration 4 has a non-finite gradient norm"):
        check_gradient(ctx, {"grad_norm": float("nan"), "step": 3, "skipped": False})


@pytest.mark.parametrize("world, zero, overlap", [(1, "configs/ds_zero2_gpu.json", False),
                                                  (2, "configs/ds_zero2_gpu.json", True),
                                                  (1, "configs/ds_zero3_multinode.json", True)])
def test_a_single_rank_does_not_overlap_a_gradient_exchange_it_does_not_have(world, zero, overlap):
    ds = deepspeed_config(ctx_of([f"train.deepspeed_config={zero}"], world), warn=False)
    assert ds["zero_optimization"].get("overlap_comm") is overlap
