"""`syncrl status RUN_DIR`: the iterations x stages table, read from markers only (torch-free)."""

from __future__ import annotations

import fcntl
import os

from stages.runtime import markers
from stages.runtime.config import config_hash, load_config
from stages.runtime.paths import STAGES, RunPaths
from stages.runtime.stage import base_model_id


def stage_states(run_dir: str) -> list[dict]:
    """One dict per (iteration, stage): state, duration_s, attempts, hosts, failed_ranks.

    Iterations up to the first that has not started are listed one by one; the rest, all pending,
    as one row (iteration "A-B"), so that the table's size follows the run's progress, not its length.
    """
    paths = RunPaths(run_dir)
    if not paths.config.is_file():
        raise FileNotFoundError(f"{paths.config} not found: {paths.root} is not a syncrl run directory")
    cfg = load_config(paths.config)
    chash = config_hash(cfg)
    running = coordinator_running(paths)
    rows = []
    last = max(cfg.iterations, max(paths.iterations_present(), default=-1) + 1)
    shown = min(last, max(paths.iterations_present(), default=-1) + 2)
    for it in range(shown):
        for stage in STAGES:
            rows.append(_state(paths, it, stage, chash, base_model_id(cfg), running))
    if shown < last:
        rows.append({"iteration": f"{shown}-{last - 1}" if last - 1 > shown else str(shown), "stage": "all",
                     "state": "pending", "duration_s": None, "attempts": 0, "hosts": [], "failed_ranks": [],
                     "stages": (last - shown) * len(STAGES)})
    return rows


def _state(paths: RunPaths, it: int, stage: str, chash: str, base: str, running: bool) -> dict:
    row = {"iteration": it, "stage": stage, "state": "pending", "duration_s": None,
           "attempts": paths.attempts_so_far(it, stage), "hosts": [], "failed_ranks": []}
    m = markers.read_marker(paths, it, stage)
    if m is None and markers.marker_path(paths, it, stage).is_file():
        row["state"] = "corrupt"  # the marker is not valid JSON (cut short?): the next run redoes the stage
        return row
    if m is not None:
        problem = markers.marker_problem(paths, m, chash, markers.input_fingerprint(paths, it, stage, base))
        row.update(state="done" if problem is None else "stale", duration_s=m.get("duration_s"),
                   hosts=m.get("hosts", []))
        return row
    st = markers.read_stage_state(paths, it, stage)
    if st is None:
        return row
    state = st["state"]
    if state == "running" and not running:
        state = "interrupted"  # the coordinator that launched it is gone
    row.update(state=state, hosts=st.get("hosts", []), failed_ranks=st.get("failed_ranks", []))
    return row


def coordinator_running(paths: RunPaths) -> bool:
    """Whether a coordinator holds the run's lock (the lock dies with its process, even on kill -9).

    Asked with a shared lock on a read-only descriptor, which conflicts with the coordinator's
    exclusive one: status needs no write access to the run dir.
    """
    try:
        fd = os.open(paths.lock, os.O_RDONLY)
    except FileNotFoundError:
        return False  # no coordinator ever ran here
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing releases a lock taken here
    return False


def format_table(rows: list[dict]) -> str:
    header = f"{'iter':>5}  {'stage':<9}{'state':<12}{'duration':>9}  {'attempts':>8}  {'hosts':<12}failed ranks"
    lines = [header, "-" * len(header)]
    for r in rows:
        dur = f"{r['duration_s']:.1f}s" if r["duration_s"] is not None else "-"
        lines.append(f"{r['iteration']:>5}  {r['stage']:<9}{r['state']:<12}{dur:>9}  {r['attempts']:>8}  "
                     f"{','.join(r['hosts']) or '-':<12}{','.join(map(str, r['failed_ranks'])) or '-'}")
    if any(r["state"] == "corrupt" for r in rows):
        lines.append("corrupt: the stage's marker is not valid JSON (cut short?); the next run redoes the stage")
    done = sum(r["state"] == "done" for r in rows)
    lines.append(f"{done}/{sum(r.get('stages', 1) for r in rows)} stages done")
    return "\n".join(lines)
