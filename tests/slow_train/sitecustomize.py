"""Fault injection for tests only (tests/test_faults.py): on PYTHONPATH, it makes the train process
named by SYNCRL_TEST_SLOW_TRAIN ("0:1:30" = iteration 0, rank 1, 30 s) wait that long at the start of
its updates (after its turn and its `pid=` line), in its first attempt only: long enough for a test to
inject a fault mid-train, however short the tiny model's update is.

The wait is put into stages.rl.steps.optimizer_steps, which train's updates call first, when that
module is imported (train itself runs as __main__, which runpy executes without its loader's
exec_module).
"""

import importlib.abc
import importlib.util
import os
import sys
import time

_target = os.environ.get("SYNCRL_TEST_SLOW_TRAIN", "")


class _SlowUpdates(importlib.abc.MetaPathFinder):
    def __init__(self, seconds: float):
        self.seconds = seconds

    def find_spec(self, name, path, target=None):
        if name != "stages.rl.steps":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run_module, seconds = spec.loader.exec_module, self.seconds

        def exec_module(module):
            run_module(module)
            steps = module.optimizer_steps

            def slow_steps(*args, **kwargs):
                print(f"slow_train: waiting {seconds:.0f}s before the updates", file=sys.stderr, flush=True)
                time.sleep(seconds)
                return steps(*args, **kwargs)

            module.optimizer_steps = slow_steps

        spec.loader.exec_module = exec_module
        return spec


if _target:
    iteration, rank, seconds = _target.split(":")
    argv = sys.orig_argv if hasattr(sys, "orig_argv") else sys.argv
    words = " ".join(argv) + " "
    if ("stages.train " in words and f"--iteration {iteration} " in words
            and os.environ.get("RANK", os.environ.get("SLURM_PROCID")) == rank
            and os.environ.get("SYNCRL_ATTEMPT", "1") == "1"):
        sys.meta_path.insert(0, _SlowUpdates(float(seconds)))
