"""Fault injection for tests only (tests/test_deferred_checkpoint.py): on PYTHONPATH, it makes the
train process named by SYNCRL_TEST_SLOW_WRITE ("0:1:30" = iteration 0, rank 1, 30 s) wait that long
before it writes the checkpoint it holds after its marker (tuning.deferred_checkpoint), in its first
attempt only: long enough for the test to kill it mid-write.

The wait is put into stages.rl.deferred_checkpoint.DeferredWrites.flush when that module is imported.
"""

import importlib.abc
import importlib.util
import os
import sys
import time

_target = os.environ.get("SYNCRL_TEST_SLOW_WRITE", "")


class _SlowFlush(importlib.abc.MetaPathFinder):
    def __init__(self, seconds: float):
        self.seconds = seconds

    def find_spec(self, name, path, target=None):
        if name != "stages.rl.deferred_checkpoint":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run_module, seconds = spec.loader.exec_module, self.seconds

        def exec_module(module):
            run_module(module)
            flush = module.DeferredWrites.flush

            def slow_flush(writes, *args, **kwargs):
                print(f"slow_write: waiting {seconds:.0f}s before the deferred write", file=sys.stderr, flush=True)
                time.sleep(seconds)
                return flush(writes, *args, **kwargs)

            module.DeferredWrites.flush = slow_flush

        spec.loader.exec_module = exec_module
        return spec


if _target:
    iteration, rank, seconds = _target.split(":")
    argv = sys.orig_argv if hasattr(sys, "orig_argv") else sys.argv
    words = " ".join(argv) + " "
    if ("stages.train " in words and f"--iteration {iteration} " in words
            and os.environ.get("RANK", os.environ.get("SLURM_PROCID")) == rank
            and os.environ.get("SYNCRL_ATTEMPT", "1") == "1"):
        sys.meta_path.insert(0, _SlowFlush(float(seconds)))
