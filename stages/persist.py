"""persist: one task per node. Copy this iteration's node-local checkpoint to checkpoints/iter_I.

Runs only when train.local_checkpoint_dir is set (otherwise train wrote checkpoints/iter_I itself
and this stage only records that), and copies only every train.durable_every-th iteration's
checkpoint and the run's last (the others stay on the nodes). The coordinator starts it once save is done and lets it run
beside the next iteration's generate, score and gather; the next train waits for it. Each node
copies its ranks' shards (the first node also the files every node holds) into a staging folder
on the shared filesystem; the first node publishes the folder by rename once every node's files
are in. Never imports torch.

By hand, one task per node (under srun: `srun --ntasks-per-node 1`):

    python -m stages.persist --run-dir RUN_DIR --iteration I
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from pathlib import Path

from stages.runtime import local_checkpoints as local, markers
from stages.runtime.config import ConfigError
from stages.runtime.dist import node_name
from stages.runtime.retry import until_empty
from stages.runtime.stage import MissingInput, StageContext, run_stage

log = logging.getLogger("syncrl.persist")


def main(ctx: StageContext) -> None:
    """Copy this node's share of the node-local checkpoint to the run dir's checkpoints/."""
    paths, it = ctx.paths, ctx.iteration
    tag = paths.checkpoint_tag(it)
    recorded = local.recorded(paths, it)
    if not recorded:
        ctx.summarize("%s", local.nothing_to_persist(paths, it))
        ctx.write_marker([])
        return
    every = ctx.cfg.train.durable_every
    if not local.durable(it, every, ctx.cfg.iterations):
        ctx.summarize("iteration %d's checkpoint stays on the nodes only (train.durable_every=%d: the next durable "
                      "copy is iteration %d's)", it, every, it + every - (it + 1) % every)
        ctx.write_marker([], extra={"durable": False})
        return
    node = node_name()
    store = local.this_node(ctx.cfg.train.local_checkpoint_dir, paths)
    if store is None:
        raise ConfigError(f"iteration {it}: train wrote node-local checkpoints, but train.local_checkpoint_dir "
                          f"is off for this process: give it the run's setting (see {paths.config})")
    folder = store / tag
    problem = local.problem(folder, recorded["id"])
    if problem and local.deferred(paths, it):
        problem = wait_for_train_write(ctx, folder, store / paths.checkpoint_staging_tag(it), recorded["id"])
    if problem:
        raise MissingInput(
            f"node {node}: the node-local checkpoint of iteration {it} is not there whole: {problem}. The node's "
            f"storage was cleared (or the node replaced) after train wrote it, so it cannot be copied: redo train: "
            f"syncrl rerun {paths.root} --iteration {it} --stage train")
    t0 = time.time()
    staging = paths.persist_staging(it, recorded["id"])
    copied = copy_share(ctx, folder, staging)
    copy_s = time.time() - t0
    size = sum(copied.values())
    target = paths.checkpoints / tag
    wait_s = ctx.cfg.train.timeout_s
    if ctx.rank == 0:
        train_ranks = int(markers.read_marker(paths, it, "train")["world_size"])
        publish(ctx, staging, target, recorded["id"], train_ranks, wait_s)
    else:
        wait_for(lambda: (local.read_record(target) or {}).get("id") != recorded["id"], wait_s,
                 f"the first node to publish {target}")
    pruned = []
    if ctx.rank == 0:
        # Save pruned before this copy existed: keep save.keep_checkpoints counting it.
        pruned = markers.prune_iterations(paths, paths.checkpoints, ctx.cfg.save.keep_checkpoints, it)
    if it == ctx.cfg.iterations - 1:
        # The run's last checkpoint: a longer run resumes from the durable copy, so the node's
        # fast storage (RAM, for /dev/shm) is not held after the job.
        shutil.rmtree(folder.parent, ignore_errors=True)
        with contextlib.suppress(OSError):
            folder.parent.parent.rmdir()  # the run's folder, once no node's is left in it
    ctx.summarize("node %s: copied %d files (%.1f MB) to %s in %.1fs (%.2f GB/s)%s", node, len(copied), size / 1e6,
                  target.relative_to(paths.root), copy_s, size / 1e9 / max(copy_s, 1e-9),
                  f"; pruned {', '.join(pruned)}" if pruned else "")
    outputs = [target] if ctx.rank == 0 else []
    ctx.write_marker(outputs, extra={"bytes": size, "copy_s": copy_s, "pruned": pruned,
                                     "prunable": [f"checkpoints/{tag}/"]})


def wait_for_train_write(ctx: StageContext, folder: Path, staging: Path, checkpoint_id: str) -> str | None:
    """Wait for train to publish this node's copy, which it writes after its marker beside save and
    this stage, as long as its staging folder keeps growing within train.timeout_s (train's own
    no-progress watchdog); returns why the copy is not there whole then (None once it is). A writer
    that dies is the coordinator's to see: it stops this stage and redoes train."""
    log.info("waiting for train to write iteration %d's checkpoint on this node (%s)", ctx.iteration, folder)
    seen, since = None, time.time()
    while problem := local.problem(folder, checkpoint_id):
        sizes = file_sizes(staging)
        if sizes != seen:
            seen, since = sizes, time.time()
        elif time.time() - since > ctx.cfg.train.timeout_s:
            return f"{problem}, and train's write made no progress in {ctx.cfg.train.timeout_s}s (train.timeout_s)"
        time.sleep(0.5)
    return None


def file_sizes(folder: Path) -> dict[str, int]:
    """Name -> size of the files in `folder` now (none once it is renamed away)."""
    sizes = {}
    with contextlib.suppress(OSError):
        for entry in os.scandir(folder):
            with contextlib.suppress(OSError):
                sizes[entry.name] = entry.stat().st_size
    return sizes


def copy_share(ctx: StageContext, folder: Path, staging: Path) -> dict[str, int]:
    """Copy the files this node carries (local.carried_by) into `staging`, then leave a note of them
    there; on a failure (a full disk) the files it copied are removed again."""
    record = local.read_record(folder)
    copied: dict[str, int] = {}
    staging.mkdir(parents=True, exist_ok=True)
    try:
        for name, size in record["files"].items():
            if local.carried_by(ctx.rank, name):
                copied[name] = size
                local.copy_durably(folder / name, staging / name)
        markers.write_json_atomic(staging / note_name(ctx.rank), {"node": node_name(), "files": copied})
    except BaseException:
        for name in copied:
            (staging / name).unlink(missing_ok=True)
        raise
    return copied


def note_name(rank: int) -> str:
    return f".node_{rank:05d}.json"


def publish(ctx: StageContext, staging: Path, target: Path, checkpoint_id: str, train_ranks: int,
            wait_s: float) -> None:
    """On the first node: once every node's note is in, check that every train rank's shard is
    there, write the record, and rename the staging folder to `target`."""
    notes = [staging / note_name(r) for r in range(ctx.world_size)]
    wait_for(lambda: [n for n in notes if not n.exists()], wait_s, "the other nodes' copies")
    names = [n for note in notes for n in markers.read_json(note)["files"]]
    missing = local.missing_shards(names, train_ranks)
    if missing:
        raise RuntimeError(f"the copies in {staging} lack the shards of train rank(s) {missing}: no node held them")
    for note in notes:
        note.unlink()
    for stray in set(p.name for p in staging.iterdir()) - set(names):
        (staging / stray).unlink()  # a half-written note of an attempt that was killed mid-write
    local.write_record(staging, checkpoint_id, ctx.iteration, f"{ctx.world_size} node(s)", ctx.paths.root)
    log.info("publishing %s: %d files from %d node(s)", target, len(names), ctx.world_size)
    markers.publish_dir(staging, target)
    for leftover in ctx.paths.checkpoints.glob(f".{target.name}.persist-*.tmp"):
        shutil.rmtree(leftover, ignore_errors=True)  # of an earlier train attempt's checkpoint


def wait_for(pending, timeout_s: float, what: str) -> None:
    """Poll `pending()` until it is empty or false; past `timeout_s`, fail naming `what`."""
    left = until_empty(timeout_s)(pending)
    if left:
        raise TimeoutError(f"gave up after {timeout_s:.0f}s waiting for {what}: {left}")


if __name__ == "__main__":
    run_stage("persist", main)
