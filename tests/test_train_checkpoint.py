"""train's checkpointer (stages/rl/train_checkpoint.py): which of the three modes a run gets, where
each writes, and what a train process started early hands it. The modes' writes and resumes run for
real in the end-to-end tests (test_deferred_checkpoint, test_local_checkpoints, test_e2e_local)."""

from pathlib import Path

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
