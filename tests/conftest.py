# The `slurm_cluster` fixture (a real 2-node SLURM cluster on this machine) for tests marked `slurm`,
# and `tiny_run`: one undisturbed run that several modules inspect or compare against.
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest_plugins = ["tests.slurm_fixture"]

ROOT = Path(__file__).resolve().parents[1]

# configs/local_tiny.yaml's small workload, every other setting its default; start_early=always so
# that train, save and the next generate start early even on a 2-core machine.
TINY_RUN = ["configs/local_tiny.yaml", "iterations=2", "start_early=always", "data.prompts_per_iteration=8",
            "generate.attempts=4", "train.micro_batch_size=16"]


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """`syncrl run` of TINY_RUN with the local launcher, once per test session (about 35 s on 2 cores):
    .dir, and .proc (its CompletedProcess). Tests read it; one that changes it works on a copy."""
    run_dir = tmp_path_factory.mktemp("tiny_run") / "run"
    proc = subprocess.run([sys.executable, "-m", "jobs.cli", "run", TINY_RUN[0], f"run_dir={run_dir}", *TINY_RUN[1:],
                           "--launcher", "local"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return SimpleNamespace(dir=run_dir, proc=proc)
