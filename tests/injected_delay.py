"""Fault injection for tests only: a delay put into one function of a stage's module when that module
is imported, in one chosen train process. The sitecustomize.py of tests/slow_write and tests/slow_train
(each put on PYTHONPATH by its test, with the repository root) call it, so that a test can inject a fault
while that process waits at a known point.
"""

import importlib.abc
import importlib.util
import os
import sys
import time


def is_train_process(iteration: str, rank: str) -> bool:
    """This process is train's rank `rank` of iteration `iteration`, in its first attempt."""
    argv = sys.orig_argv if hasattr(sys, "orig_argv") else sys.argv
    words = " ".join(argv) + " "
    return ("stages.train " in words and f"--iteration {iteration} " in words
            and os.environ.get("RANK", os.environ.get("SLURM_PROCID")) == rank
            and os.environ.get("SYNCRL_ATTEMPT", "1") == "1")


class _Delay(importlib.abc.MetaPathFinder):
    """Once `module` is imported, its `owner`'s `name` (a function of the module, or a method of one of
    its classes) first prints `message` to stderr and sleeps `seconds`."""

    def __init__(self, module: str, owner: str, name: str, seconds: float, message: str):
        self.module, self.owner, self.name, self.seconds, self.message = module, owner, name, seconds, message

    def find_spec(self, name, path, target=None):
        if name != self.module:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            owner = getattr(module, self.owner) if self.owner else module
            original = getattr(owner, self.name)

            def delayed(*args, **kwargs):
                print(self.message, file=sys.stderr, flush=True)
                time.sleep(self.seconds)
                return original(*args, **kwargs)

            setattr(owner, self.name, delayed)

        spec.loader.exec_module = exec_module
        return spec


def delay_on_import(module: str, attribute: str, seconds: float, message: str) -> None:
    """Delay `module`'s `attribute` ("function" or "Class.method") once the module is imported."""
    owner, _, name = attribute.rpartition(".")
    sys.meta_path.insert(0, _Delay(module, owner, name, seconds, message))


def delay_train_from_env(variable: str, module: str, attribute: str, label: str, before: str) -> None:
    """Where `variable` names this process ("0:1:30" = train's iteration 0, rank 1, 30 s), delay
    `module`'s `attribute` that long, printing "LABEL: waiting 30s BEFORE" first."""
    target = os.environ.get(variable, "")
    if not target:
        return
    iteration, rank, seconds = target.split(":")
    if is_train_process(iteration, rank):
        delay_on_import(module, attribute, float(seconds), f"{label}: waiting {float(seconds):.0f}s {before}")
