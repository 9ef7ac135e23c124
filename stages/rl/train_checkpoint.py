"""How train reads and writes its DeepSpeed checkpoint: one object per run, in one of three modes.

- Plain: every rank writes its files into the run dir's checkpoints/iter_I before the marker.
- NodeLocal (train.local_checkpoint_dir): the same into each node's own storage, with a record
  naming the attempt; the persist stage makes the durable copy in the run dir later.
- Deferred (tuning.deferred_checkpoint, the default where it applies): the checkpoint is copied to
  host memory before the marker and written after it, beside the next stages: to checkpoints/iter_I,
  or with train.local_checkpoint_dir to each node's storage, as NodeLocal writes it before.

train calls resume() once the engine is built, save() after the last optimizer step, and
after_marker() once its marker is in; everything that differs between the modes is here.
A checkpoint becomes visible only whole: each mode writes a staging folder that its writer renames
into place once every rank's files are in (docs/design.md has the protocol).
"""

from __future__ import annotations

import logging
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from stages.rl import deferred_checkpoint, policy_file
from stages.rl.serialization import checkpoint_io, staged_loads, threaded_writes
from stages.runtime import dist, footprint, local_checkpoints, markers
from stages.runtime.config import optimizer_offloaded, zero_stage
from stages.runtime.stage import MissingInput, StageContext

log = logging.getLogger("syncrl.train")


@dataclass
class Saved:
    """What the marker records of a checkpoint: its outputs (rank 0's), the marker's extra fields,
    and whether the files are still to be written after the marker (the GPU is freed first)."""
    outputs: list = field(default_factory=list)
    extra: dict = field(default_factory=dict)
    written_after_marker: bool = False


def for_run(ctx: StageContext, ds_config: dict, pool: deferred_checkpoint.HostPool | None = None) -> Checkpointer:
    """This run's checkpointer; `pool`: host memory a train process started early prepared for a
    deferred checkpoint's snapshot."""
    folder = local_checkpoints.this_node(ctx.cfg.train.local_checkpoint_dir, ctx.paths)
    why = footprint.why_not_deferred(ctx.cfg)
    if why is None:
        return Deferred(ctx, ds_config, pool, folder)
    log.info("checkpoint written before the marker: %s", why)
    return Plain(ctx, ds_config) if folder is None else NodeLocal(ctx, ds_config, folder)


class Checkpointer:
    """What the modes share: resume, the staging folder, and the policy's weights for save."""

    def __init__(self, ctx: StageContext, ds_config: dict, folder: Path | None = None):
        self.ctx = ctx
        self.zero3 = zero_stage(ds_config) == 3
        self.offloaded = optimizer_offloaded(ds_config)
        self.folder = folder or ctx.paths.checkpoints  # where this rank writes
        # Who renames the staging folder into place: rank 0, or each node's first rank for its node.
        self.writer = ctx.rank == 0 if folder is None else ctx.info.local_rank == 0
        self.tag = ctx.paths.checkpoint_tag(ctx.iteration)
        self.staging = ctx.paths.checkpoint_staging_tag(ctx.iteration)

    def resume(self, engine) -> None:
        """The previous iteration's weights and optimizer state into `engine`; then clear what an
        attempt that died mid-write left (nobody writes it before train's engine-ready barrier)."""
        # ZeRO-3 loads through its own partitioning path, which has not run with the staged copies.
        resume(self.ctx, engine, staged=not (self.offloaded or self.zero3))
        if self.writer:
            shutil.rmtree(self.folder / self.staging, ignore_errors=True)

    def save(self, engine, watchdog) -> Saved:
        """This iteration's checkpoint, whole (or held whole in host memory) on every rank; each
        piece of it beats `watchdog` (train's no-progress watchdog)."""
        raise NotImplementedError

    def after_marker(self, watchdog) -> None:
        """What is left once the marker is in (the deferred mode's writes)."""

    def write(self, engine) -> None:
        """Every rank's files into the staging folder (a deferred checkpoint's: those it cannot hold in
        host memory), each through tuning.checkpoint_write_threads threads."""
        tuning = self.ctx.cfg.tuning
        held = engine.checkpoint_engine
        owner, attr = ((held, "inner") if isinstance(held, deferred_checkpoint.DeferredWrites)
                       else (engine, "checkpoint_engine"))
        with checkpoint_io(tuning.checkpoint_mmap), threaded_writes(owner, attr, tuning.checkpoint_write_threads):
            # save_latest=False: syncrl names the tag it resumes from; a "latest" file would name the staging one.
            engine.save_checkpoint(str(self.folder), tag=self.staging, save_latest=False,
                                   client_state={"iteration": self.ctx.iteration})

    def publish(self, record_id: str | None = None) -> None:
        """Once every rank's files are in (a barrier that names any rank that is not), the writer
        renames the staging folder into place, with a record naming the attempt where one is given.
        A full disk or a killed rank leaves at most the staging folder, which the next attempt clears."""
        ctx = self.ctx
        dist.barrier(f"iteration {ctx.iteration} checkpoint shards written", ctx.cfg.train.timeout_s)
        if not self.writer:
            return
        if record_id is not None:
            local_checkpoints.write_record(self.folder / self.staging, record_id, ctx.iteration, dist.node_name(),
                                           ctx.paths.root)
        markers.publish_dir(self.folder / self.staging, self.folder / self.tag)

    def policy_for_save(self, engine, watchdog, writes=None) -> Path | None:
        """The policy's weights in one file under the train folder, for save where it could read no
        whole checkpoint in time (stages/rl/policy_file.py); its path on rank 0, which writes it.
        ZeRO-3: gathered from every rank's shard (every rank calls). ZeRO 0-2: the model states the
        deferred checkpoint holds in host memory."""
        watchdog.beat("write the policy's weights")
        path = self.ctx.paths.train_policy(self.ctx.iteration)
        if self.zero3:
            return policy_file.write_gathered(engine, path, self.ctx.rank == 0)
        return deferred_checkpoint.write_policy(self.ctx, writes) if self.ctx.rank == 0 else None

    def record_local(self, checkpoint_id: str, saved: Saved) -> Path:
        """The marker's record of the node-local checkpoint (`saved.extra`), and its file (rank 0
        writes it): resume, save and persist read the nodes' copies by it."""
        local = {"id": checkpoint_id, "dir": str(self.folder.parent)}
        if self.zero3:
            local["policy"] = True  # no node's copy holds the weights whole: save needs the policy file
        saved.extra["local_checkpoint"] = local
        record = self.ctx.paths.local_checkpoint_record(self.ctx.iteration)
        if self.ctx.rank == 0:
            markers.write_json_atomic(record, local)
        return record

    def policy_prunable(self) -> list[str]:
        """The policy file, for the next save to remove."""
        return [str(self.ctx.paths.train_policy(self.ctx.iteration).relative_to(self.ctx.paths.root))]


class Plain(Checkpointer):
    """Every rank's files into the run dir's checkpoints/iter_I before the marker."""

    def save(self, engine, watchdog) -> Saved:
        self.write(engine)
        self.publish()
        watchdog.beat("finish")
        outputs = [self.ctx.paths.checkpoints / self.tag] if self.ctx.rank == 0 else []
        return Saved(outputs, {"prunable": [f"checkpoints/{self.tag}/"]})


class NodeLocal(Checkpointer):
    """Each node's storage (train.local_checkpoint_dir), the node's first rank publishing its copy
    with a record naming this attempt (the marker carries it); the node's older local checkpoints
    are then removed (the persist stage has copied them: train waits for it). Under ZeRO-3 no node
    holds the weights whole, so train also gathers them into the policy file for save."""

    def save(self, engine, watchdog) -> Saved:
        ctx = self.ctx
        checkpoint_id = dist.agree(uuid.uuid4().hex)
        self.write(engine)
        self.publish(checkpoint_id)
        if self.writer:
            local_checkpoints.prune(self.folder, keep=ctx.iteration)
        watchdog.beat("finish")
        saved, policy = Saved(), None
        if self.zero3:
            policy = self.policy_for_save(engine, watchdog)
            saved.extra["prunable"] = self.policy_prunable()
        record = self.record_local(checkpoint_id, saved)
        if ctx.rank == 0:
            saved.outputs = [record] + ([policy] if policy else [])
        return saved


class Deferred(Checkpointer):
    """The checkpoint held in host memory at the marker (deferred_checkpoint.DeferredWrites stands in
    for DeepSpeed's checkpoint engine), written after it to checkpoints/iter_I, or to each node's
    storage (train.local_checkpoint_dir) as NodeLocal writes it, each node then leaving a note in the
    run dir. The marker lists the policy's weights for save instead, and a record with this attempt's
    id (the policy file is too large to hash: a redone train must still read as new input to save)."""

    def __init__(self, ctx: StageContext, ds_config: dict, pool: deferred_checkpoint.HostPool | None,
                 folder: Path | None = None):
        super().__init__(ctx, ds_config, folder)
        self.local = folder is not None
        self.pool = pool or deferred_checkpoint.HostPool()
        self.writes: deferred_checkpoint.DeferredWrites | None = None
        self.checkpoint_id = ""

    def save(self, engine, watchdog) -> Saved:
        ctx = self.ctx
        budget = deferred_checkpoint.snapshot_budget(ctx, self.folder, held=self.pool.untaken_bytes())
        self.writes = deferred_checkpoint.DeferredWrites(engine.checkpoint_engine, budget, self.pool)
        engine.checkpoint_engine = self.writes
        t0 = time.time()
        self.write(engine)
        # The snapshot is this checkpointer's alone: nothing that frees the engine's tensors reaches it.
        engine.checkpoint_engine = self.writes.inner
        engine_save_s = time.time() - t0
        self.pool.release()
        deferred_checkpoint.write_layout(ctx, self.writes)
        watchdog.beat("finish")
        t0 = time.time()
        policy = self.policy_for_save(engine, watchdog, self.writes)
        policy_s = time.time() - t0
        self.checkpoint_id = dist.agree(uuid.uuid4().hex)
        # engine_save_s holds snapshot_s and DeepSpeed's own work around it (its tag check, barriers).
        deferred = {"id": self.checkpoint_id, "snapshot_s": self.writes.snapshot_s, "engine_save_s": engine_save_s,
                    "policy_s": policy_s,
                    "snapshot_gb": self.writes.held / 1e9, "prepared_gb": self.pool.prepared_bytes / 1e9,
                    "prepared_taken_gb": self.pool.taken_bytes / 1e9,
                    "written_now_gb": self.writes.written_now / 1e9, "written_now_s": self.writes.written_now_s,
                    "budget_gb": budget / 1e9, "folder_in_memory": deferred_checkpoint.memory_backed(self.folder)}
        saved = Saved(written_after_marker=True, extra={"deferred_checkpoint": deferred,
                                                        "prunable": self.policy_prunable()})
        if self.local:
            deferred["nodes"] = ctx.info.num_nodes  # each node's note says its copy is written
            record = self.record_local(self.checkpoint_id, saved)
        else:
            record = ctx.paths.deferred_checkpoint_record(ctx.iteration)
            if ctx.rank == 0:
                markers.write_json_atomic(record, {"id": self.checkpoint_id})
        if ctx.rank == 0:
            saved.outputs = [policy, record]
        return saved

    def after_marker(self, watchdog) -> None:
        """Write the held checkpoint into the staging folder and publish it with a record naming
        this attempt (the next train resumes only from that), then retention: the run dir's
        (save.keep_checkpoints) or, node-local, the node's older copies (the persist stage has copied
        them: train waits for it), and the node's note."""
        ctx, t0 = self.ctx, time.time()
        with checkpoint_io(ctx.cfg.tuning.checkpoint_mmap):
            write_s = self.writes.flush(beat=lambda: watchdog.beat("write checkpoint"))
        self.writes.pool.close()  # the snapshot is written: its page-locked memory is no longer needed
        self.publish(self.checkpoint_id)
        if self.local and self.writer:
            local_checkpoints.prune(self.folder, keep=ctx.iteration)
            local_checkpoints.note_written(ctx.paths, ctx.iteration, self.checkpoint_id)
        elif self.writer:
            # Retention counts this checkpoint only now that it is there.
            pruned = markers.prune_iterations(ctx.paths, ctx.paths.checkpoints, ctx.cfg.save.keep_checkpoints,
                                              ctx.iteration)
            if pruned:
                log.info("pruned %s", ", ".join(pruned))
        log.info("checkpoint written after the marker%s: %.1fs of writes, %.1fs in all",
                 f" to {self.folder}" if self.local else "", write_s, time.time() - t0)


def resume(ctx: StageContext, engine, staged: bool = False) -> None:
    """Load the previous iteration's checkpoint (weights and optimizer state) into `engine`; with
    `staged` and tuning.resume_to_gpu, each file's large tensors moved to the GPU first."""
    if ctx.iteration == 0:
        return
    source, tag = previous_checkpoint(ctx)
    if not (source / tag).is_dir():
        log.warning("checkpoint %s not found: optimizer state starts fresh (weights come from %s)",
                    source / tag, ctx.policy_path())
        return
    # The state moves to the GPU before DeepSpeed copies it into the engine; not where the optimizer
    # lives on the host (offload), where DeepSpeed copies it there.
    threads = ctx.cfg.tuning.checkpoint_write_threads if staged and ctx.cfg.tuning.resume_to_gpu else 0
    with checkpoint_io(ctx.cfg.tuning.checkpoint_mmap), staged_loads(engine, engine.device, threads):
        path, _ = engine.load_checkpoint(str(source), tag=tag, load_optimizer_states=True,
                                         load_lr_scheduler_states=True)
    if path is None:
        raise RuntimeError(f"DeepSpeed could not load checkpoint {source / tag}")
    log.info("resumed weights and optimizer state from %s", path)


def previous_checkpoint(ctx: StageContext) -> tuple[Path, str]:
    """(folder, tag) of the previous iteration's checkpoint, which resume loads where that folder
    holds the tag. Raises MissingInput where it was to be written after the previous train's marker
    and is not whole, CheckpointGone where it is on neither the node nor the run dir."""
    tag = ctx.paths.checkpoint_tag(ctx.iteration - 1)
    problem = local_checkpoints.deferred_problem(ctx.paths, ctx.iteration - 1)
    if problem:
        # Written after the previous train's marker, and not (or not whole): its optimizer state is
        # lost, and the weights save exported came with it.
        raise MissingInput(f"iteration {ctx.iteration - 1}'s checkpoint was to be written after its train marker, "
                           f"and is not there whole ({problem}): redo train: syncrl rerun {ctx.paths.root} "
                           f"--iteration {ctx.iteration - 1} --stage train")
    return resume_source(ctx, tag), tag


def resumes_weights(ctx: StageContext) -> bool:
    """Whether resume() will load a checkpoint: that sets every one of the policy's weights (the
    module's states, then the fp32 master copy over them), so set-up builds the policy without reading
    its weights first. False where resume() will raise instead: its error comes as before."""
    if ctx.iteration == 0:
        return False
    try:
        source, tag = previous_checkpoint(ctx)
    except (MissingInput, local_checkpoints.CheckpointGone):
        return False
    return (source / tag).is_dir()


def resume_source(ctx: StageContext, tag: str) -> Path:
    """The folder holding checkpoint `tag` to resume from: this node's local copy when its record
    names the attempt the previous train's marker recorded, else the run dir's (durable) copy."""
    recorded = local_checkpoints.recorded(ctx.paths, ctx.iteration - 1)
    folder = local_checkpoints.this_node(ctx.cfg.train.local_checkpoint_dir, ctx.paths)
    if recorded and folder is not None:
        problem = local_checkpoints.problem(folder / tag, recorded["id"])
        if problem is None:
            return folder
        durable = local_checkpoints.problem(ctx.paths.checkpoints / tag, recorded["id"])
        if durable is not None:
            last = local_checkpoints.last_durable(ctx.paths, ctx.iteration - 1)
            raise local_checkpoints.CheckpointGone(
                f"rank {ctx.rank} on node {dist.node_name()}: iteration {ctx.iteration - 1}'s checkpoint is not on "
                f"this node ({problem}) and has no durable copy ({durable}; train.durable_every="
                f"{ctx.cfg.train.durable_every}): the run goes back to iteration {last + 1}, after the last durable "
                f"copy")
        log.info("resuming from the durable copy in %s: %s", ctx.paths.checkpoints, problem)
    return ctx.paths.checkpoints
