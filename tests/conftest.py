# The `slurm_cluster` fixture (a real 2-node SLURM cluster on this machine) for tests marked `slurm`,
# `tiny_run`: one undisturbed run that several modules inspect or compare against, and the grouping
# that lets pytest-xdist (`-n 2`) run the suite on two workers.
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from filelock import FileLock

pytest_plugins = ["tests.slurm_fixture"]

ROOT = Path(__file__).resolve().parents[1]

# configs/local_tiny.yaml's small workload, every other setting its default; start_early=always so
# that train, save and the next generate start early even on a 2-core machine.
TINY_RUN = ["configs/local_tiny.yaml", "iterations=2", "start_early=always", "data.prompts_per_iteration=8",
            "generate.attempts=4", "train.micro_batch_size=16"]


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own, which reads the groups
def pytest_collection_modifyitems(items):
    """Groups for `--dist loadgroup`: every test of the SLURM cluster in one group, run in order by one
    worker (some stop a node or fill the cluster), and every other module as a group of its own, so
    that a module's fixtures are built once."""
    groups = {}
    for item in items:
        on_cluster = item.get_closest_marker("slurm") or "slurm_cluster" in item.fixturenames
        group = "slurm" if on_cluster else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))
        groups.setdefault(group, []).append(item)
    # The order the workers take the groups in (with --no-loadscope-reorder): the SLURM group first, as
    # the longest, then the others by their count of slow tests, so that what is left for the end is
    # short. A worker takes its next group while it runs its last two tests: the SLURM group ends
    # with its quick tests, so that the worker left with it does not hold a long group back. Its
    # tests that compare with the session's tiny_run come after those that do not, so that the other
    # worker (whose first groups read it) has made it by then.
    slow = {g: sum(bool(i.get_closest_marker("slow")) for i in members) for g, members in groups.items()}
    if "slurm" in groups:  # a selection without SLURM tests has no such group
        groups["slurm"] = sorted(groups["slurm"], key=lambda i: (not i.get_closest_marker("slow"),
                                                                 "tiny_run" in i.fixturenames))
    order = sorted(groups, key=lambda g: (g != "slurm", -slow[g]))
    items[:] = [item for g in order for item in groups[g]]


@pytest.fixture(scope="session", autouse=True)
def preset_cache(tmp_path_factory):
    """Every run the tests start takes its built-in base model from one cache for the session (jobs/base_model.py,
    SYNCRL_PRESET_CACHE), shared by the xdist workers: one child process writes each preset, where each
    run would otherwise import torch and transformers to write the same one again."""
    from jobs.base_model import CACHE_ENV

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the folder the workers' own temp folders share
    os.environ.setdefault(CACHE_ENV, str(base / "preset_cache"))


@pytest.fixture
def kernels_on(monkeypatch, request):
    """The Triton kernels (stages/rl/fused_layers.py kernels()) where the test's tensors are: interpreted
    on the host, compiled on a GPU (parametrize indirectly with "cuda"); their cache cleared around
    the test, as the choice is made once per process."""
    from stages.rl import fused_layers

    device = getattr(request, "param", "cpu")
    if device == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    fused_layers.kernels.cache_clear()
    yield device
    fused_layers.kernels.cache_clear()


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """`syncrl run` of TINY_RUN with the local launcher, once per test session (about 35 s on 2 cores):
    .dir, and .proc (its CompletedProcess). Tests read it; one that changes it works on a copy.
    Under pytest-xdist the first worker to ask makes it and the others wait for it and read it."""
    return shared_run(tmp_path_factory, "tiny_run", TINY_RUN)


# TINY_RUN with its checkpoint written before train's marker (tuning.deferred_checkpoint=false) and
# two checkpoints kept, so that redoing iteration 1's train resumes iteration 0's optimizer state.
PLAIN_CHECKPOINT_RUN = [*TINY_RUN, "retry.backoff_s=0.5", "tuning.deferred_checkpoint=false", "save.keep_checkpoints=2"]


@pytest.fixture(scope="session")
def plain_checkpoint_run(tmp_path_factory):
    """`syncrl run` of PLAIN_CHECKPOINT_RUN, once per session, as tiny_run: the run the deferred
    checkpoint's weights are compared with, and the finished run the local disk-full cases copy."""
    return shared_run(tmp_path_factory, "plain_checkpoint_run", PLAIN_CHECKPOINT_RUN)


def shared_run(tmp_path_factory, name: str, args: list[str]) -> SimpleNamespace:
    """`syncrl run ARGS` under BASE/NAME/run, made by the first worker to ask and read by every other."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the folder the workers' own temp folders share
    run_dir, result = base / name / "run", base / name / "result.json"
    command = [sys.executable, "-m", "jobs.cli", "run", args[0], f"run_dir={run_dir}", *args[1:], "--launcher", "local"]
    with FileLock(str(base / f"{name}.lock"), timeout=900):
        if not result.is_file():
            result.parent.mkdir(parents=True, exist_ok=True)
            proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
            result.write_text(json.dumps({"returncode": proc.returncode, "stdout": proc.stdout,
                                          "stderr": proc.stderr}))
    done = json.loads(result.read_text())
    proc = subprocess.CompletedProcess(command, done["returncode"], done["stdout"], done["stderr"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    return SimpleNamespace(dir=run_dir, proc=proc)
