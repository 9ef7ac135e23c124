"""The coordinator: walk iterations x stages, skip what is done, launch the rest, retry, stop with a summary.

It runs inside an allocation (or locally) for the whole job and stays light: it never imports torch
except to create the built-in base model once. Everything it knows comes from the run directory,
so a killed or requeued coordinator resumes where the markers say.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path

import filelock

from jobs.base_model import create_base_model
from jobs.check import check, check_warnings, first_int, frozen_config_problem, resolve_paths
from jobs.engines import Engines
from jobs.metrics import MetricsLog
from stages.runtime import local_checkpoints, markers, pipeline
from stages.runtime import retry as policies
from stages.runtime.config import ConfigError, RunConfig, config_hash, dump_config, load_config
from stages.runtime.dist import allocation
from stages.runtime.paths import STAGES, RunPaths
from stages.runtime.stage import EXIT_GAVE_UP_WAITING, base_model_id

log = logging.getLogger("syncrl.coordinator")

LOG_TAIL_LINES = 15
# start_early=auto starts stages early with at least this many CPU cores per rank on a node.
EARLY_CORES_PER_RANK = 4

def describe_os_error(e: OSError) -> str:
    """One line for an OSError, saying plainly when the disk (or a quota) is full."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"the disk is full (no space left writing {e.filename or 'a file'}): free space, then run the same " \
               f"command again; completed stages are kept"
    return f"{e.strerror or e} ({e.filename})" if e.filename else str(e)


class StageFailed(RuntimeError):
    """A stage attempt failed; the message is the user-facing summary."""


class CheckpointLost(RuntimeError):
    """Train of `iteration` marked done, then failed to write its checkpoint (tuning.deferred_checkpoint)."""

    def __init__(self, iteration: int, attempt: int, message: str):
        super().__init__(message)
        self.iteration, self.attempt = iteration, attempt


class GoBack(RuntimeError):
    """Train of `iteration` found its starting checkpoint on no node and without a durable copy
    (train.durable_every): the run goes back to `to`, the iteration after the last durable copy."""

    def __init__(self, iteration: int, to: int, message: str):
        super().__init__(message)
        self.iteration, self.to = iteration, to


def prepare_run(cfg: RunConfig) -> RunPaths:
    """Freeze the config into the run dir (refusing a semantic change on resume) and create the base
    model. Called holding the run's lock (run_lock), which resolved the paths and made the run dir."""
    paths = RunPaths(cfg.run_dir)
    problem = frozen_config_problem(cfg)  # checked again here, under the lock: another run may have begun
    if problem:
        raise ConfigError(problem)
    markers.write_text_atomic(paths.config, dump_config(cfg))
    if not cfg.model.path and not paths.base_model.is_dir():
        log.info("creating the built-in %s base model in %s", cfg.model.preset, paths.base_model)
        create_base_model(paths.base_model, cfg.model.preset, cfg.seed, cfg.model.dtype)
    return paths


def run_lock(cfg: RunConfig) -> filelock.FileLock:
    """The run dir's coordinator lock, taken: before anything in the run dir is written (the config,
    the base model), so that a second coordinator on the same run changes nothing. The run dir
    itself is created for it. The lock dies with its process, even on kill -9."""
    resolve_paths(cfg)
    paths = RunPaths(cfg.run_dir)
    if paths.root.exists() and not paths.root.is_dir():
        raise ConfigError(f"run_dir {paths.root} exists and is not a directory: choose another run_dir")
    paths.root.mkdir(parents=True, exist_ok=True)
    lock = filelock.FileLock(paths.lock)
    try:
        lock.acquire(timeout=0)
    except filelock.Timeout:
        raise ConfigError(f"another coordinator is running on {paths.root} (lock {paths.lock} is held); "
                          f"nothing was changed: wait for it or stop it first") from None
    return lock


class Coordinator:
    def __init__(self, cfg: RunConfig, launcher, lock: filelock.FileLock | None = None):
        self.cfg = cfg
        self._lock = lock
        self.launcher = launcher
        self.paths = RunPaths(cfg.run_dir)
        self.chash = config_hash(cfg)
        self.metrics = MetricsLog(cfg)
        # (it, stage) -> (started step, attempt, the marker it waits for)
        self.early: dict[tuple[int, str], tuple[object, int, Path]] = {}
        # (it, stage) -> (started step, attempt, start time) of a background stage not yet joined
        self.background: dict[tuple[int, str], tuple[object, int, float]] = {}
        # (it, stage) -> the step of a stage done by its markers whose processes had not all exited
        self.exiting: dict[tuple[int, str], object] = {}
        # iteration -> the result of its train's processes that failed writing the checkpoint after the marker
        self.lost_writers: dict[int, object] = {}
        # iteration -> how many of its trains this coordinator redid for a lost checkpoint (bounded by retry.attempts)
        self.redone: dict[int, int] = {}
        # iteration -> how many times this coordinator went back to it for checkpoints lost since a durable copy
        self.went_back: dict[int, int] = {}
        self.start_early = False
        # (it, stage) of early-started stages told the GPUs are free for them (markers.gpus_free_path)
        self.gpus_noted_free: set[tuple[int, str]] = set()
        self.engines = Engines(cfg, launcher, self.paths)

    def run(self) -> None:
        with self._locked():
            t0 = time.time()
            self.start_early = self._starts_early()
            it = 0
            while True:
                try:
                    while it < self.cfg.iterations:
                        self.run_iteration(it)
                        it += 1
                    for key in sorted(self.background):
                        self.run_stage(*key)
                    self._join_exiting()
                    if self.cfg.iterations:
                        self._deferred_checkpoint_of(self.cfg.iterations - 1)
                    break
                except CheckpointLost as lost:
                    # From that train on: it, its save and the next iteration are redone.
                    self._forget_train(lost)
                    it = lost.iteration
                except GoBack as back:
                    self._go_back(back)
                    it = back.to
            log.info("run complete: %d iterations in %.1fs (%s)", self.cfg.iterations, time.time() - t0,
                     self.paths.root)

    @contextlib.contextmanager
    def _locked(self):
        """One coordinator per run dir; SIGTERM (scancel, time limit) unwinds so launches are stopped."""
        if self._lock is not None:
            # Taken before the run dir was prepared; reentrant: acquiring it again only counts.
            lock = self._lock
            lock.acquire(timeout=0)
        else:
            lock = run_lock(self.cfg)
        previous = signal.signal(signal.SIGTERM, _terminate)
        try:
            yield
        finally:
            self._stop_started()
            self.engines.stop()
            signal.signal(signal.SIGTERM, previous)
            signal.setitimer(signal.ITIMER_REAL, 0)  # a deferred SIGTERM (_terminate) is moot now
            self.metrics.close()
            lock.release()

    def _stop_started(self) -> None:
        """Stop the steps started ahead of their turn, in the background, or still exiting."""
        for step in [*(s for s, _, _ in [*self.early.values(), *self.background.values()]),
                     *self.exiting.values()]:
            step.cancel()
        self.early.clear()
        self.background.clear()
        self.exiting.clear()

    def rerun(self, it: int, stage: str) -> None:
        """Clear one stage's markers and run it alone. Later stages whose inputs change as a result
        become stale (their markers no longer match) and are redone by the next `syncrl run`."""
        with self._locked():
            markers.clear_stage(self.paths, it, stage)
            log.info("iteration %d %s: markers cleared, rerunning", it, stage)
            try:
                self.run_stage(it, stage)
                self._join_exiting()
                if stage == "train":
                    self._deferred_checkpoint_of(it)
            except CheckpointLost as lost:
                raise StageFailed(f"{lost}\nRedo it: syncrl rerun {self.paths.root} --iteration {lost.iteration} "
                                  f"--stage train") from None
            except GoBack as back:
                raise StageFailed(f"{back}\nRun the run's own command again (syncrl run, or sbatch): it goes back to "
                                  f"iteration {back.to} and redoes the iterations since") from None
            stale = [f"{later}@{i}" for i in range(it, self.cfg.iterations) for later in STAGES
                     if (i, STAGES.index(later)) > (it, STAGES.index(stage)) and self._is_stale(i, later)]
            if stale:
                log.info("stale now (redone by the next run): %s", ", ".join(stale))

    def _is_stale(self, it: int, stage: str) -> bool:
        m = markers.read_marker(self.paths, it, stage)
        inputs = markers.input_fingerprint(self.paths, it, stage, base_model_id(self.cfg))
        return m is not None and markers.marker_problem(self.paths, m, self.chash, inputs) is not None

    def run_iteration(self, it: int) -> None:
        t0 = time.time()
        stage_s = 0.0
        for stage in STAGES:
            if pipeline.stage(stage).done_before:
                self._start_background(it, stage)
            else:
                stage_s += self.run_stage(it, stage)
        total = time.time() - t0
        stats = markers.read_marker(self.paths, it, "gather") or {}
        s = stats.get("stats", {})
        log.info("iteration %d done in %.1fs (coordinator overhead %.2fs): reward %.3f accuracy %.3f",
                 it, total, total - stage_s, s.get("reward_mean", float("nan")), s.get("accuracy", float("nan")))

    def _needs_doing(self, it: int, stage: str) -> str | None:
        """The stage's input fingerprint when it must run (its stale markers cleared), else None."""
        inputs = markers.input_fingerprint(self.paths, it, stage, base_model_id(self.cfg))
        marker = markers.read_marker(self.paths, it, stage)
        problem = markers.marker_problem(self.paths, marker, self.chash, inputs)
        if problem is None:
            log.info("iteration %d %-8s already done, skipping", it, stage)
            return None
        if marker is not None:
            log.info("iteration %d %-8s redoing: %s", it, stage, problem)
            markers.clear_stage(self.paths, it, stage)
        return inputs

    def _start_background(self, it: int, stage: str) -> None:
        """Start a background stage (the table's done_before) and return; run_stage joins it later."""
        if (it, stage) in self.background:
            return
        inputs = self._needs_doing(it, stage)
        if inputs is None:
            return
        attempt = self.paths.attempts_so_far(it, stage) + 1
        if stage == "persist" and not local_checkpoints.recorded(self.paths, it):
            self._nothing_to_persist(it, inputs, attempt)
            return
        self._write_state(it, stage, "running", attempt)
        self.background[(it, stage)] = (self._start(it, stage, attempt), attempt, time.time())
        log.info("iteration %d %-8s started in the background (attempt %d on %d task(s))", it, stage, attempt,
                 self.launcher.ntasks(stage))

    def _nothing_to_persist(self, it: int, inputs: str, attempt: int) -> None:
        """Persist of an iteration whose train wrote its checkpoint to the run dir itself: marked done
        here, as its tasks would mark it, without starting a process per node beside the next stages."""
        start = time.time()
        summary = local_checkpoints.nothing_to_persist(self.paths, it)
        for rank in range(self.launcher.ntasks("persist")):
            markers.write_marker(self.paths, it, "persist", rank, attempt=attempt, start=start, config_hash=self.chash,
                                 inputs=inputs, outputs={}, extra={"summary": summary})
        self._write_stage_marker(it, "persist", inputs, start, attempt)

    def _join_background_before(self, it: int, stage: str) -> None:
        """Finish the background stages that must be done before `stage` of iteration `it` starts."""
        for bg in pipeline.PIPELINE:
            if bg.done_before and bg.done_before[0] == stage and (it - bg.done_before[1], bg.name) in self.background:
                self.run_stage(it - bg.done_before[1], bg.name)

    def run_stage(self, it: int, stage: str) -> float:
        """Run one stage to completion (or raise StageFailed); returns the seconds spent in launches.
        A stage started in the background is joined: waited for, checked, retried if it failed."""
        self._join_background_before(it, stage)
        inputs = self._needs_doing(it, stage)
        if inputs is None:
            return 0.0
        if stage == "train" and it > 0:
            self._deferred_checkpoint_of(it - 1)  # what this train resumes from
        if stage == "persist":
            # What it copies, where train writes its node-local checkpoint after its marker: a writer
            # that failed redoes that train, and the persist waiting on it is stopped.
            self._deferred_checkpoint_of(it)
        if pipeline.stage(stage).gpu:
            self._join_exiting(before=stage)
        self._start_successors_early(it, stage)
        light = not pipeline.stage(stage).gpu
        if light:
            self._note_gpus_free(it)
        launched = 0.0
        background = (it, stage) in self.background
        first_start = self.background[(it, stage)][2] if background else time.time()
        retry = self.cfg.retry
        retrying = policies.stage_attempts(
            retry.attempts, retry.backoff_s, retry.max_backoff_s, StageFailed,
            lambda n, e: f"iteration {it} {stage} failed (attempt {n} of {retry.attempts}), retrying: {e}")
        for tries, attempt_state in enumerate(retrying):
            with attempt_state:
                if stage == "generate":
                    # After a failed attempt its engines are not trusted (one may hang): new ones serve the next.
                    self.engines.ensure(it, fresh=tries > 0)
                step, attempt = self._take_early(it, stage)
                if step is None:
                    attempt = self.paths.attempts_so_far(it, stage) + 1
                self._write_state(it, stage, "running", attempt)
                how = "launching" if step is None else "joining the background" if background else "started early:"
                log.info("iteration %d %-8s %s attempt %d on %d task(s)", it, stage, how, attempt,
                         self.launcher.ntasks(stage))
                if step is None:
                    step = self._start(it, stage, attempt)
                n = self.launcher.ntasks(stage)

                def done() -> bool:
                    if light:  # the GPU stages before it may be gone by now: tell those waiting for the GPUs
                        self._note_gpus_free(it)
                    return self._all_marked(it, stage, n, inputs, attempt)

                result = step.wait(retry.stage_timeout_s, done=done)
                launched += result.elapsed_s
                if light:
                    self._note_gpus_free(it)
                try:
                    self._check_attempt(it, stage, attempt, inputs, result)
                except StageFailed as failed:
                    if stage == "train":
                        self._go_back_if_checkpoint_gone(it, attempt, failed)
                    raise
        if result.lingering:
            # Every rank's marker is in: the stage is done, and its processes finish exiting (closing
            # NCCL groups and CUDA contexts takes seconds) beside what comes next.
            self.exiting[(it, stage)] = step
        # The marker below lets early-started stages waiting on it begin: they are running from then on,
        # so the background stages they must follow are finished first.
        go = markers.marker_path(self.paths, it, stage)
        released = [(key, early_attempt) for key, (_, early_attempt, after) in self.early.items() if after == go]
        t_handoff = time.time()
        for (it2, nxt), _ in released:
            self._join_background_before(it2, nxt)
            if nxt == "train" and it2 > 0:
                self._deferred_checkpoint_of(it2 - 1)
            if pipeline.stage(nxt).gpu:
                self._join_exiting(before=nxt)
            if nxt == "generate":
                self.engines.ensure(it2)
        for (it2, nxt), early_attempt in released:
            self._write_state(it2, nxt, "running", early_attempt)
        # What the stages this marker lets go waited for (a checkpoint written after train's marker,
        # processes still exiting) lies between this stage's rank markers and its own.
        handoff = {"handoff_s": round(time.time() - t_handoff, 3)} if released else {}
        self._write_stage_marker(it, stage, inputs, first_start, attempt, handoff)
        return launched

    def _all_marked(self, it: int, stage: str, n: int, inputs: str, attempt: int) -> bool:
        """Every rank has written a marker that counts in this attempt (a listing first: cheap). A
        marker of an earlier attempt does not: its rank may have failed after writing it (train
        writing its checkpoint after its marker), and a rank that skips its done work writes none,
        so such a stage is done when its processes have exited."""
        if len(markers.rank_markers_present(self.paths, it, stage) & set(range(n))) != n:
            return False
        found = [markers.read_marker(self.paths, it, stage, r) for r in range(n)]
        return all(m is not None and m.get("attempt") == attempt for m in found) and \
            not self._ranks_without_marker(it, stage, n, inputs, wait=False)

    def _join_exiting(self, before: str | None = None) -> None:
        """Wait for the processes of finished stages still exiting; kill those past tuning.exit_grace_s
        (a teardown that hangs holds nothing up). Before `stage` (None: all): a train still writing
        its checkpoint after its marker is joined only before the next train (_deferred_checkpoint_of)."""
        writing = self._writing()
        for (it, stage), step in sorted(self.exiting.items()):
            if (it, stage) in writing:
                if before in (None, "train"):
                    self._join_writer(it)
                continue
            del self.exiting[(it, stage)]
            self._join_exit(it, stage, step)

    def _join_exit(self, it: int, stage: str, step) -> None:
        """Wait at most tuning.exit_grace_s for a done stage's processes to exit, then kill them."""
        grace = self.cfg.tuning.exit_grace_s
        result = step.wait(grace)
        if result.timed_out:
            log.warning("iteration %d %s: rank(s) still running %.0fs after the stage was done were killed",
                        it, stage, grace)
        elif not result.ok:
            log.warning("iteration %d %s: a rank exited with %s after writing its marker (its outputs are "
                        "whole and stand)", it, stage, sorted(set(result.returncodes.values()) - {0}))

    def _writing(self) -> set[tuple[int, str]]:
        """The train steps still running that write their checkpoint after their marker."""
        return {(it, stage) for it, stage in self.exiting if stage == "train" and
                local_checkpoints.deferred(self.paths, it)}

    def _join_writer(self, it: int) -> None:
        """Wait for train of iteration `it` to publish the checkpoint it writes after its marker (as
        long as an attempt may run: retry.stage_timeout_s, and train's own no-progress watchdog),
        then for its processes to exit (tuning.exit_grace_s). A writer that ended without publishing
        is remembered for _deferred_checkpoint_of."""
        step = self.exiting.pop((it, "train"))
        t0 = time.time()
        written = lambda: local_checkpoints.deferred_problem(self.paths, it) is None  # noqa: E731
        result = step.wait(self.cfg.retry.stage_timeout_s, done=written)
        if not written():
            self.lost_writers[it] = result
            return
        log.info("iteration %d train  checkpoint written (waited %.1fs for it)", it, time.time() - t0)
        if result.lingering:
            self._join_exit(it, "train", step)

    def _deferred_checkpoint_of(self, it: int) -> None:
        """Before the next train (and at the run's end): the checkpoint train of iteration `it` wrote
        after its marker is whole, or CheckpointLost."""
        if (it, "train") in self.exiting:
            self._join_writer(it)
        problem = local_checkpoints.deferred_problem(self.paths, it)
        if problem is None:
            self.lost_writers.pop(it, None)
            return
        marker = markers.read_marker(self.paths, it, "train") or {}
        attempt = marker.get("attempt", self.paths.attempts_so_far(it, "train"))
        result = self.lost_writers.pop(it, None)
        n = self.launcher.ntasks("train")
        ranks = sorted(result.failed_ranks if result is not None else []) or \
            [r for r in range(n) if markers.read_failure_record(self.paths, it, "train", r, attempt)]
        if result is None:
            why = "did not finish it (no writer ran in this coordinator)"
        elif ranks:
            why = f"failed on rank(s) {','.join(map(str, ranks))}"
        else:
            why = "timed out" if result.timed_out else f"failed (exit codes {sorted(set(result.returncodes.values()))})"
        tails = self._log_tails(it, "train", attempt, ranks or list(range(n)), result) if result is not None else ""
        raise CheckpointLost(it, attempt, f"iteration {it} train attempt {attempt} wrote its marker, then {why} "
                                          f"writing its checkpoint: {problem}" + (f"\n{tails}" if tails else ""))

    def _forget_train(self, lost: CheckpointLost) -> None:
        """Clear the train whose checkpoint is lost so that it is redone, or stop once it has had
        retry.attempts attempts. What was started ahead of it is stopped: it read or waited on that train."""
        log.warning("%s", lost)
        self.redone[lost.iteration] = self.redone.get(lost.iteration, 0) + 1
        self._stop_started()
        # Its save exported the weights of the lost attempt, and the next iteration sampled from them: a
        # fingerprint would not always show it (an export above markers.HASH_LIMIT_BYTES is recorded by size).
        later = [(lost.iteration, "train"), (lost.iteration, "save")] + \
            [(lost.iteration + 1, s) for s in STAGES if lost.iteration + 1 < self.cfg.iterations]
        for it, stage in later:
            markers.clear_stage(self.paths, it, stage)
        self._write_state(lost.iteration, "train", "failed", lost.attempt)
        if self.redone[lost.iteration] >= self.cfg.retry.attempts:
            raise StageFailed(f"{lost}\n{self.redone[lost.iteration]} attempts of iteration {lost.iteration} train "
                              f"lost their checkpoint (retry.attempts: {self.cfg.retry.attempts})")
        log.warning("iteration %d train: redoing it, its save and iteration %d's stages", lost.iteration,
                    lost.iteration + 1)

    def _go_back_if_checkpoint_gone(self, it: int, attempt: int, failed: StageFailed) -> None:
        """GoBack when a rank of this train attempt found its checkpoint gone (a retry would too)."""
        gone = local_checkpoints.CheckpointGone.__name__ + ":"
        records = [markers.read_failure_record(self.paths, it, "train", r, attempt)
                   for r in range(self.launcher.ntasks("train"))]
        if any(str((rec or {}).get("exception", "")).startswith(gone) for rec in records):
            to = local_checkpoints.last_durable(self.paths, it - 1) + 1
            raise GoBack(it, to, f"{failed}\niteration {it - 1}'s checkpoint is lost with no durable copy: going back "
                                 f"to iteration {to}, after the last durable copy")

    def _go_back(self, back: GoBack) -> None:
        """Clear what depends on the checkpoints lost since the last durable copy: the trains from
        `back.to` on, their saves and persists, and every later iteration's stages. The samples of
        iteration `back.to` stand (its policy is the durable copy's). Bounded like a lost checkpoint:
        retry.attempts goings back to the same iteration, then the run stops."""
        log.warning("%s", back)
        self.went_back[back.to] = self.went_back.get(back.to, 0) + 1
        if self.went_back[back.to] > self.cfg.retry.attempts:
            raise StageFailed(f"{back}\nthe run went back to iteration {back.to} {self.went_back[back.to] - 1} times "
                              f"(retry.attempts: {self.cfg.retry.attempts})")
        self._stop_started()
        cleared = [(back.to, s) for s in ("train", "save", "persist")] + \
            [(i, s) for i in range(back.to + 1, min(back.iteration + 1, self.cfg.iterations)) for s in STAGES]
        for i, stage in cleared:
            markers.clear_stage(self.paths, i, stage)
        log.warning("redoing iterations %d-%d from iteration %d's train on", back.to, back.iteration, back.to)

    def _starts_early(self) -> bool:
        mode = self.cfg.start_early
        if mode == "auto":
            per_node = self.launcher.ntasks("train") // max(1, len(self.launcher.nodes()))
            cores = first_int(allocation("cpus_on_node")) or len(os.sched_getaffinity(0))
            # While generate runs, each of its ranks has three processes preloading beside it (this
            # iteration's save, the next train, the next generate), each CPU-bound for seconds.
            mode = "always" if cores >= EARLY_CORES_PER_RANK * per_node else "never"
            log.info("start_early=auto: %s (%d CPU cores per node, %d ranks per node)",
                     "starting stages early" if mode == "always" else "not starting stages early", cores, per_node)
        return mode == "always"

    def _start_successors_early(self, it: int, stage: str) -> None:
        """Start the stages that can load while this one runs (the stage table's starts_early); each
        waits for its turn.

        Only where neither the stage nor the marker it waits for exists yet: a leftover marker of an
        earlier run could otherwise start it before its inputs are redone.
        """
        if not self.start_early:
            return
        for early in pipeline.stage(stage).starts_early:
            it2, nxt = it + early.ahead, early.stage
            if it2 >= self.cfg.iterations or (it2, nxt) in self.early:
                continue
            go = markers.marker_path(self.paths, it + early.after_ahead, early.after)
            if go.exists() or markers.stage_started(self.paths, it2, nxt):
                continue
            attempt = self.paths.attempts_so_far(it2, nxt) + 1
            markers.gpus_free_path(self.paths, it2, nxt).unlink(missing_ok=True)
            self.gpus_noted_free.discard((it2, nxt))
            step = self._start(it2, nxt, attempt, after=(go, self.cfg.tuning.start_early_wait_s))
            self.early[(it2, nxt)] = (step, attempt, go)
            log.info("iteration %d %-8s started early (attempt %d): loading while %s runs", it2, nxt, attempt, stage)

    def _start(self, it: int, stage: str, attempt: int, after=None):
        """Start one attempt's processes (see launchers.stage_command for `after`), once the temporaries
        that killed ranks of an earlier attempt left in the ledger are gone."""
        markers.remove_partial_writes(self.paths, it, stage)
        return self.launcher.start(self.paths, it, stage, attempt, after=after)

    def _note_gpus_free(self, it: int) -> None:
        """Tell the stages of iteration `it` started early that set up before their turn (the stage
        table's sets_up_early: train) that they may now: no GPU stage's processes are left and the
        checkpoint they resume is published. Called while light stages run; never waits."""
        if not self.cfg.tuning.set_up_early:
            return
        waiting = [(stage, attempt) for (it2, stage), (_, attempt, _) in self.early.items()
                   if it2 == it and pipeline.stage(stage).sets_up_early and (it2, stage) not in self.gpus_noted_free]
        if not waiting or any(pipeline.stage(s).gpu and step.running() for (_, s), step in self.exiting.items()):
            return
        if it > 0 and local_checkpoints.deferred_problem(self.paths, it - 1) is not None:
            return
        for stage, attempt in waiting:
            markers.write_json_atomic(markers.gpus_free_path(self.paths, it, stage),
                                      {"attempt": attempt, "time": time.time()})
            self.gpus_noted_free.add((it, stage))
            log.info("iteration %d %-8s the GPUs are free: it sets up before its turn", it, stage)

    def _take_early(self, it: int, stage: str):
        """This stage's step started in the background (running or ended, its first attempt), or
        started early, if that is alive or already succeeded; else (None, None)."""
        if (it, stage) in self.background:
            step, attempt, _ = self.background.pop((it, stage))
            return step, attempt
        step, attempt, _ = self.early.pop((it, stage), (None, None, None))
        if step is not None and not step.running():
            result = step.wait(1)
            # Only an exit for giving up on the wait says the turn never came: start the stage afresh,
            # without counting that as an attempt. Any other failure may have come after the turn (a
            # rank killed as it began working), so it counts: _check_attempt names its ranks.
            gave_up = set(result.returncodes.values()) <= {0, EXIT_GAVE_UP_WAITING}
            if not result.ok and not result.timed_out and gave_up:
                log.warning("iteration %d %-8s the early-started attempt %d gave up waiting for its turn; "
                            "starting anew", it, stage, attempt)
                return None, None
        return step, attempt

    def _check_attempt(self, it: int, stage: str, attempt: int, inputs: str, result) -> None:
        n = self.launcher.ntasks(stage)
        # Markers of a successful step may lag on a shared filesystem: wait for them only then.
        missing = self._ranks_without_marker(it, stage, n, inputs, wait=result.ok)
        if result.ok and not missing:
            return
        bad = sorted(set(result.failed_ranks) or missing)
        self._write_state(it, stage, "failed", attempt, bad, result.hosts)
        if result.timed_out:
            why = f"timed out after {self.cfg.retry.stage_timeout_s}s"
        elif bad:
            why = f"failed on rank(s) {','.join(map(str, bad))}"
        else:
            why = f"failed (exit codes {sorted(set(result.returncodes.values()))})"
        raise StageFailed(f"iteration {it} {stage} attempt {attempt} {why}\n" +
                          self._log_tails(it, stage, attempt, bad or list(range(n)), result))

    def _ranks_without_marker(self, it: int, stage: str, n: int, inputs: str, wait: bool) -> set[int]:
        """Ranks that exited 0 but left no valid marker; a missing one is awaited briefly (filesystem lag)."""
        def missing():
            return {r for r in range(n) if markers.marker_problem(
                self.paths, markers.read_marker(self.paths, it, stage, r), self.chash, inputs) is not None}

        return policies.until_empty(self.cfg.tuning.marker_wait_s)(missing) if wait else missing()

    def _write_stage_marker(self, it: int, stage: str, inputs: str, start: float, attempt: int,
                            extra: dict | None = None) -> None:
        marker = markers.record_stage_done(self.paths, it, stage, self.launcher.ntasks(stage), attempt=attempt,
                                           start=start, config_hash=self.chash, inputs=inputs, extra=extra)
        log.info("iteration %d %-8s done in %.1fs: %s", it, stage, marker["duration_s"], marker.get("summary", ""))
        self.metrics.stage_done(it, stage, marker)

    def _write_state(self, it: int, stage: str, state: str, attempt: int, failed_ranks=(), hosts=None) -> None:
        """The stage's state file, for `syncrl status`; a failure to write it is logged, never raised."""
        record = {"state": state, "attempt": attempt, "time": time.time(), "failed_ranks": list(failed_ranks),
                  "hosts": sorted(set((hosts or {}).values())), "coordinator": f"{socket.gethostname()}:{os.getpid()}"}
        try:
            markers.write_stage_state(self.paths, it, stage, record)
        except OSError as e:
            log.error("could not record iteration %d %s as %s in %s: %s", it, stage, state,
                      self.paths.stage_state(it, stage), describe_os_error(e))

    def _log_tails(self, it: int, stage: str, attempt: int, ranks: list[int], result) -> str:
        """Per failed rank: its failure record when it wrote one (it raised), else its log's last lines."""
        parts = []
        for r in ranks[:4]:
            p = self.paths.rank_log(it, stage, attempt, r)
            code = result.returncodes.get(r)
            record = markers.read_failure_record(self.paths, it, stage, r, attempt)
            if record:
                lines = record["last_lines"][-LOG_TAIL_LINES:] + record["traceback"][-2:]
                head = f"--- rank {r} on {record['host']} raised {record['exception']} (log {p})"
            else:
                try:
                    lines = p.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
                except FileNotFoundError:
                    lines = ["(no log file)"]
                head = f"--- rank {r} (exit {code}) {p}"
            parts.append(head + "\n" + "\n".join(line.rstrip("\n") for line in lines))
        return "\n".join(parts)


def checked_config(config, overrides, launcher: str) -> RunConfig:
    """The config, or ConfigError listing every problem `syncrl check` finds."""
    cfg = load_config(config, overrides)
    problems = check(cfg, launcher)
    if problems:
        raise ConfigError("\n".join(problems) if len(problems) == 1 else
                          f"{len(problems)} problems:\n  " + "\n  ".join(problems))
    for warning in check_warnings(cfg, launcher):
        log.warning("%s", warning)
    return cfg


def run(config, overrides, launcher: str) -> int:
    """`syncrl run`: check the config, take the run's lock, freeze the config and run (or resume)."""
    cfg = checked_config(config, overrides, launcher)
    lock = run_lock(cfg)
    try:
        prepare_run(cfg)
        return coordinate(cfg, launcher, lambda c: c.run(), lock)
    finally:
        lock.release(force=True)


def coordinate(cfg, launcher_kind: str, action, lock=None) -> int:
    """Run `action(coordinator)`; a stage failure or an interrupt becomes an exit status and a hint."""
    from jobs.launchers import make_launcher

    launcher = make_launcher(launcher_kind, cfg)
    log.info("launcher %s: %d task(s) per multi-rank stage on %s", launcher.name, launcher.ntasks("train"),
             ",".join(launcher.nodes()))
    try:
        action(Coordinator(cfg, launcher, lock))
    except StageFailed as e:
        log.error("stopped: %s\nFix the cause, then run the same command again: completed stages are kept.", e)
        return 1
    except KeyboardInterrupt:
        log.error("interrupted; run the same command again to resume (completed stages are kept)")
        return 130
    return 0


# Code that must not be unwound mid-way: an exception raised inside logging can leave its lock held
# (then every thread that logs hangs, the W&B client's at exit among them), and one raised in a
# weakref callback (logging's handler cleanup) is swallowed, so the coordinator would go on.
_UNSAFE_TO_UNWIND = (f"{os.sep}logging{os.sep}", f"{os.sep}weakref.py")
_RETRY_S = 0.05


def _terminate(signum, frame):
    """SIGTERM (scancel, a time limit, the sbatch script's USR2 trap) unwinds like Ctrl-C so launchers
    kill their children; arriving inside logging or a weakref callback, it is raised again moments
    later, once that code has run (SIGALRM, until a safe frame is reached)."""
    if _unsafe(frame):
        signal.signal(signal.SIGALRM, lambda _s, f: _terminate(signum, f))
        signal.setitimer(signal.ITIMER_REAL, _RETRY_S)
        return
    raise KeyboardInterrupt(f"signal {signum}")


def _unsafe(frame) -> bool:
    while frame is not None:
        if any(part in frame.f_code.co_filename for part in _UNSAFE_TO_UNWIND):
            return True
        frame = frame.f_back
    return False


def setup_coordinator_logging() -> None:
    logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                        format="%(asctime)s coordinator %(levelname)s %(message)s", datefmt="%H:%M:%S")
