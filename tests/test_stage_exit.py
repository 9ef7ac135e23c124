"""A stage process ends with os._exit (stages/runtime/stage.py exit_now): nothing it printed may be lost."""

import os
import subprocess
import sys
from pathlib import Path

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
