"""tuning.grad_norm: flat (stages/rl/grad_norm.py) against DeepSpeed's own norm and clipping, in
train's real DeepSpeed engine (ZeRO 1 and 2, gloo on CPU, 1 and 2 ranks): the same gradient norms,
and, with clipping that bites, the same weights after every step."""

from pathlib import Path

import pytest
import torch

from jobs.check import check
from stages.runtime.config import ConfigError, load_config
from tests.test_train_batching import model_dir, run_workers  # noqa: F401 (model_dir is a fixture)

ROOT = Path(__file__).resolve().parents[1]


def clipped_steps(tmp_path, model_dir, world: int, overrides: list[str], name: str) -> dict:
    return run_workers("tests.workers.clipped_steps", tmp_path, model_dir, world, overrides, name)


@pytest.mark.slow
@pytest.mark.parametrize("world,zero", [(2, "configs/ds_zero2_cpu.json"), (1, "zero1")])
def test_the_flat_norm_clips_as_deepspeed_does(tmp_path, model_dir, world, zero):  # noqa: F811
    if zero == "zero1":
        ds = tmp_path / "ds_zero1.json"
        ds.write_text((ROOT / "configs" / "ds_zero2_cpu.json").read_text().replace('"stage": 2', '"stage": 1'))
        zero = str(ds)
    # The bound small: every step is clipped, each by its own factor, which Adam's update shows from
    # the second step on (the control below: the same steps unclipped end elsewhere).
    common = [f"train.deepspeed_config={zero}", "train.micro_batch_size=4", "train.lr=1e-2",
              "train.max_grad_norm=0.05"]
    want = clipped_steps(tmp_path, model_dir, world, common + ["tuning.grad_norm=deepspeed"], "deepspeed")
    got = clipped_steps(tmp_path, model_dir, world, common + ["tuning.grad_norm=flat"], "flat")
    assert len(got["records"]) == len(want["records"]) >= 3
    for mine, theirs in zip(got["records"], want["records"]):
        assert theirs["grad_norm"] > 0.05  # clipped
        # One norm of the flat partition against a sum of per-parameter norms: float32's rounding.
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-4)
    for name, w in want["weights"].items():
        assert torch.allclose(got["weights"][name], w, rtol=0, atol=1e-5), name
    if world == 2:
        unclipped = clipped_steps(tmp_path, model_dir, world, common[:-1] + ["train.max_grad_norm=0",
                                                                             "tuning.grad_norm=flat"], "unclipped")
        assert max((unclipped["weights"][n] - w).abs().max().item() for n, w in want["weights"].items()) > 1e-3


def test_the_flat_norm_is_refused_where_it_cannot_run():
    with pytest.raises(ConfigError, match="tuning.grad_norm must be one of"):
        load_config("configs/local_tiny.yaml", ["tuning.grad_norm=fast"])
    for ds, says in (("configs/ds_zero3_cpu.json", "has stage 3"),
                     ("configs/ds_zero2_cpuadam.json", "has stage 2 with offload_optimizer")):
        cfg = load_config("configs/local_tiny.yaml", ["tuning.grad_norm=flat", f"train.deepspeed_config={ds}"])
        problems = "\n".join(check(cfg, "local"))
        assert says in problems and "set tuning.grad_norm=deepspeed" in problems, problems
    assert check(load_config("configs/local_tiny.yaml", ["tuning.grad_norm=flat"]), "local") == []


def test_the_flat_norm_runs_only_on_the_deepspeed_releases_it_was_checked_against(monkeypatch):
    # FlatGradNorm reaches into the ZeRO optimizer's attributes: the installed DeepSpeed must be one it
    # was checked against (a DeepSpeed upgrade fails here until the flat norm is checked again), and
    # another release is refused with the fix.
    import deepspeed

    from stages.rl import grad_norm

    assert grad_norm.checked_release(deepspeed.__version__), deepspeed.__version__
    assert grad_norm.checked_release("0.19.8") and not grad_norm.checked_release("0.20.0rc1")
    assert not grad_norm.checked_release("0.14.4")
    monkeypatch.setattr(deepspeed, "__version__", "0.21.0")
    with pytest.raises(ValueError, match="DeepSpeed 0.21.0: set tuning.grad_norm=deepspeed"):
        grad_norm.FlatGradNorm(object(), 1.0)


@pytest.mark.parametrize("zero,grad_norm", [(2, "flat"), (2, "deepspeed"), (3, "deepspeed")])
def test_the_engine_given_back_before_the_marker_frees_its_optimizer_state(
        tmp_path, model_dir, zero, grad_norm):  # noqa: F811 (model_dir is a fixture)
    # Train frees the GPU before a deferred checkpoint's marker (the next stages use it while the
    # checkpoint is written): nothing of train's may keep the engine, and so its fp32 state, alive.
    # A ZeRO-3 engine outlives its destroy(): what it holds is freed by storage instead.
    got = run_workers("tests.workers.released_engine", tmp_path, model_dir, 1,
                      [f"train.deepspeed_config=configs/ds_zero{zero}_cpu.json", "train.micro_batch_size=4",
                       f"tuning.grad_norm={grad_norm}"], grad_norm)
    assert got["fp32 bytes held"] == 0
    if zero == 2:
        assert got["alive"] == []
