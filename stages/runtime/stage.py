"""What every stage shares: argument parsing, skip-if-done, logging, markers and the exit path.

`python -m stages.<name> --run-dir R --iteration I [key=value ...]` reads the run's frozen config
(R/config.yaml), applies the overrides, and calls the stage's `main(ctx)`. A failure exits non-zero
with a one-line reason on stderr after the full traceback has gone to the rank's log.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from stages.runtime import markers, pipeline
from stages.runtime.config import ConfigError, RunConfig, config_hash, load_config
from stages.runtime.dist import DistInfo, destroy_process_group, dist_info
from stages.runtime.logs import recent_lines, setup_logging
from stages.runtime.memory import freeze_loaded_objects, memory_report
from stages.runtime.paths import RunPaths

log = logging.getLogger("syncrl.stage")

ATTEMPT_VAR = "SYNCRL_ATTEMPT"


@dataclass
class StageContext:
    stage: str
    iteration: int
    cfg: RunConfig
    paths: RunPaths
    info: DistInfo
    attempt: int
    config_hash: str
    inputs: str
    start: float = field(default_factory=time.time)
    summary: str = ""
    waited_s: float = 0.0  # a process started early: time spent waiting for the previous stage
    late_s: float = 0.0  # a process started early that was still preloading when its turn came: by how much
    # A process started early, until its turn (or until it sets up before it): it has not read the
    # previous stage's outputs, and a failure now is not an attempt's (the coordinator starts the
    # stage afresh).
    waiting: bool = False
    preloaded: object = None  # what preload(ctx) returned, for main (None when not started early)
    set_up: object = None  # what set_up(ctx) built before the turn (run_stage's set_up), for main
    # A process started early: seconds from its creation to preload (interpreter and imports), then
    # the parts preload names; they add up to its import_s unless it waited.
    preload_phases: dict = field(default_factory=dict)
    turn: str | None = None  # a process started early: the file whose existence is its turn

    def turn_came(self) -> bool:
        """Whether a process started early has had its turn come (while it preloads: what only
        saves time may then be skipped); True for a process started at its turn."""
        return self.turn is None or os.path.exists(self.turn)

    def gpus_free(self) -> bool:
        """Whether the coordinator has noted the GPUs free for this attempt (markers.gpus_free_path):
        a process started early may then set up before its turn (a note left for an attempt that was
        stopped is not this one's)."""
        try:
            note = markers.read_json(markers.gpus_free_path(self.paths, self.iteration, self.stage))
        except (OSError, ValueError):
            return False
        return note.get("attempt") == self.attempt

    def summarize(self, fmt: str, *args) -> None:
        """The stage's one-line result: logged here, and by the coordinator from the marker."""
        self.summary = fmt % args
        log.info("%s", self.summary)

    @property
    def rank(self) -> int:
        return self.info.rank

    @property
    def world_size(self) -> int:
        return self.info.world_size

    @property
    def out_dir(self) -> Path:
        return self.paths.stage_dir(self.iteration, self.stage)

    def policy_path(self) -> Path:
        """The model this iteration starts from: the previous iteration's export, or the base model."""
        if self.iteration > 0:
            return self.paths.model(self.iteration - 1)
        return self.base_model_path()

    def base_model_path(self) -> Path:
        """The run's base model: model.path, or the built-in preset created in the run dir."""
        return Path(self.cfg.model.path) if self.cfg.model.path else self.paths.base_model

    def fingerprint_inputs(self) -> str:
        """Hash of what this stage reads: its upstream stages' marker outputs."""
        return markers.input_fingerprint(self.paths, self.iteration, self.stage, base_model_id(self.cfg))

    def tokenizer_path(self) -> Path:
        if self.iteration == 0 and self.cfg.model.tokenizer:
            return Path(self.cfg.model.tokenizer)
        return self.policy_path()

    def rank_done(self) -> bool:
        m = markers.read_marker(self.paths, self.iteration, self.stage, self.rank)
        return markers.marker_problem(self.paths, m, self.config_hash, self.inputs) is None

    def write_marker(self, outputs: list[Path], extra: dict | None = None) -> dict:
        """Per-rank marker: call after every output listed has been published. Records peak memory."""
        memory = memory_report()
        log.info("peak memory: %s", ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                                              for k, v in memory.items()))
        return markers.write_marker(
            self.paths, self.iteration, self.stage, self.rank, attempt=self.attempt, start=self.start,
            config_hash=self.config_hash, inputs=self.inputs,
            outputs=markers.outputs_record(outputs, self.paths.root),
            extra={**(extra or {}), "memory": memory, "summary": self.summary, "import_s": _import_seconds(self),
                   **({"started_early_waited_s": self.waited_s, "started_early_late_s": self.late_s}
                      if self.waited_s or self.late_s else {}),
                   **({"preload_phases": self.preload_phases} if self.preload_phases else {})})


def _import_seconds(ctx: StageContext) -> float:
    """From process creation to the stage's start: interpreter start-up and imports (for a process
    started early, the time it spent waiting for its turn is not counted)."""
    return max(0.0, ctx.start - _process_created() - ctx.waited_s)


def _process_created() -> float:
    import psutil

    return psutil.Process().create_time()


def wait_for_turn(ctx: StageContext, after: str, timeout_s: float, preload, set_up=None) -> float | None:
    """Run preload(ctx) (its result kept in ctx.preloaded); with set_up, once the coordinator notes
    the GPUs free for this attempt (markers.gpus_free_path) and the turn has not come, run set_up(ctx)
    (kept in ctx.set_up); then wait for `after`. Returns the seconds waited, or None on giving up."""
    t0 = time.time()
    ctx.preload_phases["imports"] = round(max(0.0, t0 - _process_created()), 3)
    ctx.turn = after
    if preload is not None:
        ctx.preloaded = preload(ctx)
    log.info("%s iteration %d started early: preloaded in %.1fs, waiting for %s", ctx.stage, ctx.iteration,
             time.time() - t0, after)
    if set_up is not None:
        t_free = time.time()
        while not ctx.turn_came() and not ctx.gpus_free() and time.time() < t_free + timeout_s:
            time.sleep(0.05)
        if not ctx.turn_came() and ctx.gpus_free():
            ctx.preload_phases["waited_for_gpus"] = round(time.time() - t_free, 3)
            log.info("the GPUs are free: setting up before the turn (process %d)", os.getpid())
            # What fails from here on fails this attempt: the failure is recorded as its own.
            ctx.waiting = False
            ctx.set_up = set_up(ctx)
    t1 = time.time()
    if os.path.exists(after):  # the turn came while preloading: the stage's start-up is that late
        ctx.late_s = max(0.0, t1 - os.path.getmtime(after))
    deadline = t1 + timeout_s
    while not os.path.exists(after):
        if time.time() > deadline:
            log.warning("gave up waiting for %s after %.0fs; the coordinator starts this stage afresh",
                        after, timeout_s)
            return None
        time.sleep(0.05)
    return time.time() - t1


def then_frozen(preload):
    """`preload` (or nothing), then freeze_loaded_objects (stages/runtime/memory.py), whose seconds go
    in the preload's phases: what a process started early runs before it waits for its turn."""
    def run(ctx: StageContext):
        out = preload(ctx) if preload is not None else None
        t0 = time.time()
        freeze_loaded_objects()
        ctx.preload_phases["freeze_objects"] = round(time.time() - t0, 3)
        return out
    return run


def base_model_id(cfg: RunConfig) -> str:
    return cfg.model.path or f"preset:{cfg.model.preset}"


def make_context(stage: str, run_dir: str, iteration: int, overrides=(), waiting: bool = False) -> StageContext:
    """The stage's context; `waiting`: started early, so the inputs (upstream markers) are read later."""
    paths = RunPaths(run_dir)
    if not paths.config.is_file():
        raise ConfigError(f"{paths.config} not found: start the run with `syncrl run CONFIG run_dir={run_dir}`")
    cfg = load_config(paths.config, overrides)
    ctx = StageContext(stage=stage, iteration=iteration, cfg=cfg, paths=paths, info=dist_info(),
                       attempt=int(os.environ.get(ATTEMPT_VAR, "1")), config_hash=config_hash(cfg), inputs="",
                       waiting=waiting)
    if not waiting:
        ctx.inputs = ctx.fingerprint_inputs()
    return ctx


class MissingInput(FileNotFoundError):
    """An upstream output this stage needs is missing or not whole."""


def ranks_of(ctx: StageContext, stage: str, it: int) -> int:
    """The processes `stage` of iteration `it` ran with: its stage marker says, else the configuration."""
    recorded = markers.read_marker(ctx.paths, it, stage)
    if recorded and "world_size" in recorded:
        return int(recorded["world_size"])
    if not pipeline.stage(stage).every_rank:
        return 1
    return ctx.cfg.ranks // pipeline.group_size(stage, ctx.cfg.generate.gpus_per_process)


def require_needs(ctx: StageContext) -> None:
    """The outputs this stage needs (the stage table's `needs`) are there whole, else say which stage
    of which iteration to rerun."""
    for need in pipeline.stage(ctx.stage).needs:
        dep_it = ctx.iteration + need.offset
        if dep_it < 0:
            continue
        world = ranks_of(ctx, need.stage, dep_it) if need.scope == "ranks" else ctx.world_size
        problem = markers.need_problem(ctx.paths, ctx.iteration, need, ctx.rank, world)
        if problem:
            raise MissingInput(f"iteration {ctx.iteration} {ctx.stage} needs the outputs of {need.stage} "
                               f"(iteration {dep_it}): {problem}. Rerun: syncrl rerun {ctx.paths.root} "
                               f"--iteration {dep_it} --stage {need.stage}")


def write_failure_record(ctx: StageContext, exc: BaseException) -> None:
    """What the coordinator's failure summary quotes: who failed, where, with what, and the last lines."""
    if ctx.waiting:  # before its turn: the attempt that counts is started afresh and writes its own
        return
    try:
        markers.write_failure_record(
            ctx.paths, ctx.iteration, ctx.stage, ctx.rank,
            {"stage": ctx.stage, "iteration": ctx.iteration, "rank": ctx.rank, "host": ctx.info.host,
             "attempt": ctx.attempt, "time": time.time(), "exception": f"{type(exc).__name__}: {exc}",
             "traceback": traceback.format_exception(exc)[-6:], "last_lines": recent_lines()})
    except OSError as e:  # a full or unreachable filesystem must not hide the original error
        log.error("could not write the failure record: %s", e)


# Exit status of a stage process started early that gave up waiting for its turn: not a failure,
# the coordinator starts the stage afresh.
EXIT_GAVE_UP_WAITING = 75


def run_stage(stage: str, main, per_rank_skip: bool = True, argv=None, preload=None, set_up=None) -> None:
    """Parse, skip if done, set up logging, run `main(ctx)`, exit. Never returns.

    With --after FILE the process was started early: it runs `preload(ctx)` (the imports and model
    code the stage will need; what it returns, main finds in ctx.preloaded), then, given `set_up` and
    once the coordinator notes the GPUs free, `set_up(ctx)` (what main finds in ctx.set_up), then
    waits for FILE (the previous stage's marker) before it reads anything that stage writes.
    """
    parser = argparse.ArgumentParser(prog=f"python -m stages.{stage}", description=main.__doc__)
    parser.add_argument("--run-dir", required=True, help="the run directory (holds config.yaml)")
    parser.add_argument("--iteration", type=int, required=True, help="RL iteration number, from 0")
    parser.add_argument("--after", default=None, help="start early: wait for this file before working")
    parser.add_argument("--after-timeout", type=float, default=3600.0, help="seconds to wait for --after")
    parser.add_argument("overrides", nargs="*", help="config overrides key.sub=value")
    args = parser.parse_args(argv)
    code, ctx = 1, None
    try:
        if args.after:
            setup_logging(dist_info().tag)
            ctx = make_context(stage, args.run_dir, args.iteration, args.overrides, waiting=True)
            # Who it is, before the preload's and the early set-up's lines (what to attach a debugger to
            # if it hangs there); the `pid=` line below comes at the turn.
            log.info("%s iteration %d attempt %d started early on host %s as process %d (rank %d/%d, local_rank %d, "
                     "node %d): preloading, then waiting for %s", stage, ctx.iteration, ctx.attempt, ctx.info.host,
                     os.getpid(), ctx.rank, ctx.world_size, ctx.info.local_rank, ctx.info.node_id, args.after)
            waited = wait_for_turn(ctx, args.after, args.after_timeout, then_frozen(preload), set_up)
            if waited is None:
                sys.exit(EXIT_GAVE_UP_WAITING)
            ctx.inputs = ctx.fingerprint_inputs()
            ctx.start, ctx.waited_s, ctx.waiting = time.time(), waited, False
        else:
            ctx = make_context(stage, args.run_dir, args.iteration, args.overrides)
            setup_logging(ctx.info.tag)
        log.info("%s iteration %d attempt %d: host=%s pid=%d rank=%d/%d local_rank=%d node=%d",
                 stage, ctx.iteration, ctx.attempt, ctx.info.host, os.getpid(), ctx.rank,
                 ctx.world_size, ctx.info.local_rank, ctx.info.node_id)
        if per_rank_skip and ctx.rank_done():
            log.info("already done (marker matches config and inputs): skipping")
        else:
            require_needs(ctx)
            main(ctx)
            log.info("%s done in %.1fs", stage, time.time() - ctx.start)
        code = 0
    except ConfigError as e:
        print(f"{stage}: {e}", file=sys.stderr)
        code = 2
    except Exception as e:
        log.exception("%s failed", stage)
        rank = ctx.rank if ctx else dist_info().rank
        if ctx is not None:
            write_failure_record(ctx, e)
        print(f"{stage}: rank {rank} failed: {type(e).__name__}: {e}", file=sys.stderr)
    finally:
        destroy_process_group()
    exit_now(code)


def exit_now(code: int) -> None:
    """Flush every stream, then end the process without the interpreter's teardown.

    Outputs and marker are on disk by now: unloading torch, DeepSpeed and transformers module by
    module takes seconds per process, and the next stage on the GPU would wait for it.
    (The coordinator counts the stage done once every rank's marker is in, without waiting for the
    exit; the next stage on the GPUs waits for it, at most tuning.exit_grace_s.)
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    try:
        import ctypes

        ctypes.CDLL(None).fflush(None)  # C-level output (NCCL's, compiled ops') is buffered when redirected
    except (OSError, AttributeError):
        pass
    os._exit(code)
