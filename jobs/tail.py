"""`syncrl tail RUN_DIR`: one stage attempt's per-rank logs merged in time order, `[node:rank]` prefixed.

Lines that carry syncrl's log prefix are ordered by their wall-clock time; other lines (library
output, tracebacks) keep their place after the line before them. With `follow`, files are polled
and lines printed as they arrive, including ranks whose file appears late, until the stage stops
running. Torch-free.
"""

from __future__ import annotations

import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from jobs.status import coordinator_running
from stages.runtime import markers
from stages.runtime.config import ConfigError
from stages.runtime.paths import STAGES, RunPaths, numbered

PREFIX = re.compile(r"^\[(n\d+:r\d+)\] (\d\d):(\d\d):(\d\d)\.(\d{3}) ")
FIRST_LINE = re.compile(r"host=(\S+) .*node=(\d+)")
RANK_LOG = re.compile(r"rank_\d+\.log")
POLL_S = 0.25


@dataclass
class RankLog:
    path: Path
    rank: int
    tag: str = ""
    host: str = ""
    node: int | None = None
    offset: int = 0
    last_t: float = 0.0
    day: float = 0.0
    partial: str = ""

    def read_new(self) -> list[tuple[float, int, str]]:
        """Whole lines appended since the last call, as (time, rank, prefixed text)."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        text = self.partial + data.decode(errors="replace")
        lines = text.split("\n")
        self.partial = lines.pop()  # an unfinished last line waits for its newline
        out = []
        for line in lines:
            line = line.replace("\r", "")
            m = PREFIX.match(line)
            if m:
                t = int(m[2]) * 3600 + int(m[3]) * 60 + int(m[4]) + int(m[5]) / 1000 + self.day
                if t < self.last_t - 12 * 3600:  # past midnight
                    self.day += 86400
                    t += 86400
                self.last_t = t
                self.tag = self.tag or m[1]
                if self.node is None and (f := FIRST_LINE.search(line)):
                    self.host, self.node = f[1], int(f[2])
                text = line  # already prefixed by the stage's logger
            else:
                text = f"[{self.tag or f'r{self.rank}'}] {line}"
            out.append((self.last_t, self.rank, text))
        return out


def latest_stage(paths: RunPaths) -> tuple[int, str]:
    """The iteration and stage whose logs were written most recently."""
    best = None
    for it in numbered(paths.root / "logs", "iter_"):
        it_dir = paths.root / "logs" / f"iter_{it:05d}"
        for stage_dir in it_dir.iterdir():
            if stage_dir.name in STAGES and stage_dir.is_dir():
                mtime = max((p.stat().st_mtime for p in stage_dir.rglob("*")), default=stage_dir.stat().st_mtime)
                key = (mtime, it, STAGES.index(stage_dir.name))
                best = max(best or key, key)
    if best is None:
        raise FileNotFoundError(f"no logs under {paths.root / 'logs'}: has the run started?")
    return best[1], STAGES[best[2]]


def select(paths: RunPaths, iteration: int | None, stage: str | None, attempt: int | None) -> tuple[int, str, int]:
    if iteration is None or stage is None:
        it, st = latest_stage(paths)
        iteration = it if iteration is None else iteration
        stage = st if stage is None else stage
    attempts = paths.attempts(iteration, stage)
    if not attempts:
        raise FileNotFoundError(f"no logs for iteration {iteration} stage {stage} in {paths.root / 'logs'}")
    if attempt is not None and attempt not in attempts:
        raise ConfigError(f"--attempt {attempt}: iteration {iteration} stage {stage} has attempt(s) "
                          f"{', '.join(map(str, attempts))}")
    return iteration, stage, attempt or attempts[-1]


def tail(run_dir: str, iteration=None, stage=None, attempt=None, rank=None, node=None, follow=False,
         lines=None, out=sys.stdout, max_follow_s: float = 7 * 86400) -> None:
    paths = RunPaths(run_dir)
    iteration, stage, attempt = select(paths, iteration, stage, attempt)
    log_dir = paths.logs(iteration, stage, attempt)
    logs: dict[int, RankLog] = {}

    def poll() -> list[tuple[float, int, str]]:
        for p in sorted(log_dir.glob("rank_*.log")):
            if not RANK_LOG.fullmatch(p.name):
                continue
            r = int(p.stem[5:])
            if r not in logs and (rank is None or r == rank):
                logs[r] = RankLog(p, r)
        new = []
        for lg in logs.values():
            got = lg.read_new()
            if node is None or lg.node is None or str(node) in (str(lg.node), lg.host):
                new += got
        return sorted(new, key=lambda x: (x[0], x[1]))

    batch = poll()
    check_selection(log_dir, logs, rank, node, follow and _running(paths, iteration, stage, attempt))
    print(f"== {log_dir} (iteration {iteration}, stage {stage}, attempt {attempt})", file=out, flush=True)
    if lines:
        batch = batch[-lines:]
    _emit(batch, out)
    if not follow:
        return
    deadline = time.monotonic() + max_follow_s
    while time.monotonic() < deadline:
        time.sleep(POLL_S)
        _emit(poll(), out)
        if not _running(paths, iteration, stage, attempt):
            _emit(poll(), out)  # lines written just before the end
            print(f"== stage {stage} of iteration {iteration} is no longer running", file=out, flush=True)
            return


def check_selection(log_dir: Path, logs: dict, rank, node, may_appear: bool) -> None:
    """--rank / --node must name one that logged (a stage still running may yet start a rank's file)."""
    ranks = sorted(int(p.stem[5:]) for p in log_dir.glob("rank_*.log") if RANK_LOG.fullmatch(p.name))
    if rank is not None and rank not in ranks and not may_appear:
        raise ConfigError(f"--rank {rank}: {log_dir} has logs of rank(s) {', '.join(map(str, ranks)) or 'none'}")
    if node is not None and logs and not may_appear:
        known = sorted({str(lg.node) for lg in logs.values() if lg.node is not None} |
                       {lg.host for lg in logs.values() if lg.host})
        if str(node) not in known:
            raise ConfigError(f"--node {node}: the ranks in {log_dir} ran on node(s) {', '.join(known) or 'unknown'}")


def _emit(batch, out) -> None:
    for _, _, text in batch:
        print(text, file=out)
    out.flush()


def _running(paths: RunPaths, iteration: int, stage: str, attempt: int) -> bool:
    if markers.read_marker(paths, iteration, stage) is not None:
        return False
    if paths.attempts_so_far(iteration, stage) > attempt:
        return False  # a retry started: this attempt is over
    st = markers.read_stage_state(paths, iteration, stage)
    if st is None:
        return True  # the coordinator has not written its state yet
    return st.get("state") == "running" and st.get("attempt") == attempt and coordinator_running(paths)
