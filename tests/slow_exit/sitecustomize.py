"""Fault injection for tests only (tests/test_stage_exit.py): on PYTHONPATH, it makes the stage
processes named by SYNCRL_TEST_SLOW_EXIT ("train:1" = train's rank 1) hang in their exit, after
their marker is written, as a teardown that never returns would.

Stages end through stages.runtime.stage.exit_now, which shuts logging down first: a logging handler
whose close() sleeps holds the process there.
"""

import logging
import os
import sys
import time

_target = os.environ.get("SYNCRL_TEST_SLOW_EXIT", "")


class _HangOnClose(logging.Handler):
    def emit(self, record):
        pass

    def close(self):
        time.sleep(3600)


if _target and len(sys.argv) > 0:
    stage, _, rank = _target.partition(":")
    argv = " ".join(sys.orig_argv) if hasattr(sys, "orig_argv") else ""
    if f"stages.{stage} " in argv + " " and os.environ.get("RANK", os.environ.get("SLURM_PROCID")) == rank:
        logging.getLogger("syncrl.test.slow_exit").addHandler(_HangOnClose())
