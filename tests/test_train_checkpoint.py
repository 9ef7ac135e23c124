"""train's checkpointer (stages/rl/train_checkpoint.py): which of the three modes a run gets, where
each writes, and what a train process started early hands it. The modes' writes and resumes run for
real in the end-to-end tests (test_deferred_checkpoint, test_local_checkpoints, test_e2e_local)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stages.rl import deferred_checkpoint, train_checkpoint
from stages.runtime.config import dump_config, load_config
from stages.runtime.stage import make_context

ROOT = Path(__file__).resolve().parents[1]


def context(tmp_path, *overrides, iteration=1):
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    cfg = load_config(ROOT / "configs" / "local_tiny.yaml", [f"run_dir={run}", *overrides])
    (run / "config.yaml").write_text(dump_config(cfg))
    return make_context("train", str(run), iteration, waiting=True)


def test_each_setting_gets_its_mode_and_folder(tmp_path, monkeypatch):
    ds = {"zero_optimization": {"stage": 2}}
    deferred = train_checkpoint.for_run(context(tmp_path), ds)
    assert type(deferred) is train_checkpoint.Deferred and deferred.folder == deferred.ctx.paths.checkpoints
    plain = train_checkpoint.for_run(context(tmp_path, "tuning.deferred_checkpoint=false"), ds)
    assert type(plain) is train_checkpoint.Plain and plain.writer and not plain.zero3
    # Another export dtype than the training one needs the fp32 master weights: written before the marker.
    fp32 = train_checkpoint.for_run(context(tmp_path, "save.export_dtype=float16"), ds)
    assert type(fp32) is train_checkpoint.Plain
    store = tmp_path / "local"
    local = train_checkpoint.for_run(context(tmp_path, f"train.local_checkpoint_dir={store}",
                                             "tuning.deferred_checkpoint=false"), {"zero_optimization": {"stage": 3}})
    assert type(local) is train_checkpoint.NodeLocal and local.zero3
    assert local.folder.is_relative_to(store) and local.folder != local.ctx.paths.checkpoints
    # Node-local checkpoints are written after the marker too, where the deferred mode applies.
    later = train_checkpoint.for_run(context(tmp_path, f"train.local_checkpoint_dir={store}"), ds)
    assert type(later) is train_checkpoint.Deferred and later.local and later.folder == local.folder
    # Each node's first rank publishes its node's copy.
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert train_checkpoint.for_run(context(tmp_path, f"train.local_checkpoint_dir={store}"), ds).writer
    assert not train_checkpoint.for_run(context(tmp_path, "tuning.deferred_checkpoint=false"), ds).writer


def test_the_deferred_mode_takes_the_pool_a_process_started_early_prepared(tmp_path):
    ctx = context(tmp_path)
    pool = deferred_checkpoint.HostPool()
    assert train_checkpoint.for_run(ctx, {}, pool).pool is pool
    # Not started early (or no layout to prepare by): an empty pool of its own, nothing shared.
    a, b = train_checkpoint.for_run(ctx, {}), train_checkpoint.for_run(ctx, {})
    assert a.pool is not b.pool and a.pool.untaken_bytes() == 0
    # Iteration 0 has no previous layout: nothing is prepared, and preload hands over no pool.
    assert deferred_checkpoint.prepare_pool(context(tmp_path, iteration=0)) is None


def test_resume_at_iteration_0_reads_nothing(tmp_path):
    class Engine:  # iteration 0 starts from the base model: no checkpoint is loaded
        def load_checkpoint(self, *a, **k):
            raise AssertionError("iteration 0 loaded a checkpoint")

    checkpointer = train_checkpoint.for_run(context(tmp_path, "tuning.deferred_checkpoint=false", iteration=0), {})
    staging = checkpointer.folder / checkpointer.staging
    staging.mkdir(parents=True)
    checkpointer.resume(Engine())
    assert not staging.exists()  # what a killed attempt left is cleared


@pytest.mark.slow
@pytest.mark.parametrize("zero", ["configs/ds_zero2_cpu.json", "configs/ds_zero3_cpu.json"])
def test_a_resumed_policy_takes_every_weight_from_the_checkpoint(tmp_path, zero):
    """Where train resumes a checkpoint it builds the policy without reading its weights: every one
    comes from the checkpoint. A real 2-rank run of 2 iterations; then iteration 1's set-up again,
    its policy filled with NaN as it is built, holds after the resume exactly the weights iteration
    0 exported."""
    from tests.test_train_batching import run_workers_in_turn

    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "jobs.cli", "run", "configs/local_tiny.yaml", f"run_dir={run}",
                           "iterations=2", "ranks=2", "data.prompts_per_iteration=8", "generate.attempts=4",
                           "save.keep_checkpoints=2", f"train.deepspeed_config={zero}", "wandb.enabled=false",
                           "--launcher", "local"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = run_workers_in_turn("tests.workers.resumed_weights", tmp_path, run, 2, {"resumed": []})["resumed"]
    assert got["built"]  # set-up took the path under test
    assert_resumed_state_is_iteration_0s(got, run, optimizer="zero2" in zero)


def assert_resumed_state_is_iteration_0s(got: dict, run: Path, optimizer: bool, **load) -> None:
    """What tests/workers/resumed_weights.py saved after resuming iteration 0's checkpoint in `run`:
    exactly the weights iteration 0 exported (read with `load`'s from_pretrained arguments) and, with
    `optimizer` (ZeRO 1-2), its checkpoint's fp32 master partitions and Adam moments."""
    from transformers import AutoModelForCausalLM

    want = dict(AutoModelForCausalLM.from_pretrained(run / "models" / "iter_00000", **load).named_parameters())
    assert set(got["weights"]) == set(want)
    for name, w in got["weights"].items():
        assert torch.equal(w, want[name].detach()), name
    if optimizer:
        assert_optimizer_state_is_the_checkpoints(got["optimizer"], run / "checkpoints" / "iter_00000")


def assert_optimizer_state_is_the_checkpoints(got: dict, folder: Path, rank: int = 0) -> None:
    """ZeRO 1-2: the fp32 master partitions and Adam moments rank `rank` holds after the resume are the
    ones its checkpoint file holds (the file's partitions without the last rank's alignment padding)."""
    [path] = folder.glob(f"*zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    # DeepSpeed's own file, with its objects (not stage data): read as DeepSpeed reads it.
    saved = torch.load(path, map_location="cpu", weights_only=False)["optimizer_state_dict"]
    assert got["copies_in_place"] is True  # ZeRO-2's flags read as the staged loads read them
    for mine, theirs in zip(got["fp32"], saved["single_partition_of_fp32_groups"], strict=True):
        assert torch.equal(mine[:theirs.numel()], theirs)
    states = saved["base_optimizer_state"]["state"]
    for i, moments in enumerate(got["moments"]):
        assert set(moments) == {"exp_avg", "exp_avg_sq"}
        for key, value in moments.items():
            assert torch.equal(value, states[i][key]), (i, key)
