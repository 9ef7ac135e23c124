"""A stage process ends with os._exit (stages/runtime/stage.py exit_now): nothing it printed may be lost."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import ctypes, logging, sys
from stages.runtime.stage import exit_now
logging.basicConfig(filename=sys.argv[1], level=logging.INFO)
logging.info("from logging")
print("from python")
ctypes.CDLL(None).printf(b"from C stdio\\n")  # as NCCL prints: buffered by libc when stdout is a pipe
exit_now(3)
"""


def test_exit_now_keeps_the_exit_code_and_flushes_python_logging_and_c_output(tmp_path):
    # Launchers set PYTHONUNBUFFERED; a stage module run by hand (python -m stages.train ...) may not have it.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    log = tmp_path / "stage.log"
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(log)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 3, proc.stderr
    assert "from python" in proc.stdout and "from C stdio" in proc.stdout
    assert "from logging" in log.read_text()


@pytest.mark.slow
def test_a_rank_that_hangs_in_its_exit_after_its_marker_holds_nothing_up(tmp_path):
    # tests/slow_exit makes train's rank 1 hang in its exit once its marker is written, in both
    # iterations: the stage is done by its markers, save goes ahead beside it, and the rank is
    # killed once the next stage on the GPUs is due and tuning.exit_grace_s has passed.
    import json

    run = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "tests" / "slow_exit"), str(ROOT)]),
               SYNCRL_TEST_SLOW_EXIT="train:1")
    proc = subprocess.run([sys.executable, "-m", "jobs.cli", "run", "configs/local_tiny.yaml", f"run_dir={run}",
                           "iterations=2", "data.prompts_per_iteration=8", "tuning.exit_grace_s=4", "--launcher",
                           "local"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for it in (0, 1):
        assert f"iteration {it} train: rank(s) still running 4s after the stage was done were killed" in proc.stderr
        train, save = (json.loads((run / f"iter_{it:05d}" / "markers" / f"{s}.done").read_text())
                       for s in ("train", "save"))
        assert save["start"] - train["end"] < 2  # save did not wait for the hung rank
    out = subprocess.run(["pgrep", "-af", "stages.train"], capture_output=True, text=True).stdout
    assert str(run) not in out
