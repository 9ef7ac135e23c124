"""One logging setup for every stage: `[n<node>:r<rank>] HH:MM:SS.mmm <elapsed>s LEVEL message`.

The wall-clock time lets `syncrl tail` merge the ranks' files in time order; the elapsed seconds
since the process started make slow startups visible at a glance.

The launcher (srun --output, or the LocalLauncher) sends each rank's stdout and stderr to its own
file under logs/iter_I/<stage>/attempt_A/, so writing to stderr here puts everything in that file.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import sys
import time

_START = time.monotonic()
# The last lines this process logged, quoted in its failure record.
_RECENT: collections.deque[str] = collections.deque(maxlen=20)


class _Formatter(logging.Formatter):
    def __init__(self, tag: str):
        super().__init__()
        self.tag = tag

    def format(self, record: logging.LogRecord) -> str:
        elapsed = time.monotonic() - _START
        clock = time.strftime("%H:%M:%S", time.localtime(record.created)) + f".{int(record.msecs):03d}"
        line = f"[{self.tag}] {clock} {elapsed:7.1f}s {record.levelname:<7} {record.getMessage()}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def setup_logging(tag: str, level: int = logging.INFO) -> None:
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    formatter = _Formatter(tag)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    root.addHandler(handler)
    recent = _RecentHandler()
    recent.setFormatter(formatter)
    root.addHandler(recent)
    root.setLevel(level)
    # Libraries that log at INFO on every call would drown the rank logs.
    for noisy in ("DeepSpeed", "deepspeed", "torch.distributed", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def recent_lines() -> list[str]:
    return list(_RECENT)


class _RecentHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        record_exc, record.exc_info = record.exc_info, None  # tracebacks are recorded separately
        _RECENT.append(self.format(record))
        record.exc_info = record_exc


class Progress:
    """Rank 0's progress: a tqdm bar on a terminal; in a log file, a plain line every `every_s` seconds
    (carriage-return bars make rank logs unreadable and `syncrl tail` noisy)."""

    def __init__(self, total: int, desc: str, rank: int, every_s: float = 30.0):
        self.total, self.desc, self.every_s = total, desc, every_s
        self.enabled = rank == 0
        self.done = 0
        self.t0 = self.last = time.monotonic()
        self.bar = None
        if self.enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc)

    def update(self, n: int = 1) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
            return
        now = time.monotonic()
        if self.enabled and (now - self.last >= self.every_s or self.done == self.total):
            self.last = now
            rate = self.done / max(now - self.t0, 1e-9)
            logging.getLogger("syncrl.progress").info("%s: %d/%d (%.0f%%), %.2f/s", self.desc, self.done,
                                                      self.total, 100 * self.done / max(self.total, 1), rate)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class Phases:
    """Durations of a stage's consecutive start-up phases, for its marker: where start-up time goes.

        phases = Phases(ctx.start)
        with phases("load_models"):
            ...

    Each phase counts from the end of the one before (the first from `start`), so the phases add up
    to the whole start-up."""

    def __init__(self, start: float):
        self.last = start
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        yield
        now = time.time()
        self.seconds[name] = round(now - self.last, 3)
        self.last = now
