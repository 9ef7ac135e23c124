"""generate.persistent: one long-lived generation engine per generate rank (stages/engine.py), kept
by the coordinator (jobs/engines.py) and asked by each generate step (stages/runtime/engine_link.py).

vLLM cannot run here, so the engines run the stand-in for vLLM's API (tests/standins/vllm, which
samples with the HF model and keeps vLLM's sleep, wake-up and reload rules); the coordinator, the
launcher, the engine's process, its socket and the generate steps are real. The GPU test in
tests/test_gpu.py runs the real engine where vLLM is installed. One engine serving several
iterations, and a dead one started again, run on the two-node cluster (tests/test_faults.py).
"""

import json
import os
import subprocess
import sys
import time
from multiprocessing.connection import Listener
from pathlib import Path
from types import SimpleNamespace

import pytest

from stages.runtime.engine_link import EngineClient, failure_path, publish_address, read_address
from stages.runtime.paths import RunPaths

ROOT = Path(__file__).resolve().parents[1]
STANDINS = Path(__file__).parent / "standins"
G = SimpleNamespace(attempts=2, temperature=1.0, top_p=1.0, max_new_tokens=4)


def run(run_dir: Path, iterations: int, extra_env=None, *overrides):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(STANDINS), str(ROOT)]), **(extra_env or {}))
    return subprocess.run([sys.executable, "-m", "jobs.cli", "run", "configs/local_tiny.yaml", f"run_dir={run_dir}",
                           f"iterations={iterations}", "generate.backend=vllm", "generate.persistent=true",
                           "data.prompts_per_iteration=4", "generate.attempts=2", "generate.max_new_tokens=6",
                           *overrides, "--launcher", "local"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def engine_figures(run_dir: Path, it: int, rank: int) -> dict:
    marker = json.loads((run_dir / f"iter_{it:05d}" / "markers" / f"generate.rank_{rank:05d}.done").read_text())
    return marker["sampling"]["engine"]


def engine_processes(run_dir: Path) -> list[str]:
    out = subprocess.run(["pgrep", "-af", "stages.engine"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if str(run_dir) in line]


@pytest.mark.slow
def test_a_generate_attempt_that_failed_gets_new_engines(tmp_path):
    run_dir, hang = tmp_path / "run", tmp_path / "hang"
    hang.touch()  # the first engine asked hangs in its request
    proc = run(run_dir, 1, {"VLLM_STANDIN_HANG_ONCE": str(hang)}, "generate.engine_timeout_s=20",
               "retry.attempts=2", "retry.backoff_s=0.5")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "no answer from the generation engine of rank" in proc.stderr
    assert "replacing them after the failed attempt" in proc.stderr
    for rank in (0, 1):
        assert (run_dir / "logs" / "iter_00000" / "engine" / f"attempt_{rank + 1}").is_dir()
    marker = json.loads((run_dir / "iter_00000" / "markers" / "generate.done").read_text())
    assert marker["attempt"] == 2
    assert engine_processes(run_dir) == []  # the hung one was stopped too


def test_an_engine_that_is_gone_fails_the_request_at_once(tmp_path):
    paths = RunPaths(tmp_path)
    with Listener(("127.0.0.1", 0)) as listener:
        port = listener.address[1]
    publish_address(paths, 0, port, b"k" * 32, {})  # nothing listens there any more
    assert oct(paths.engine_address(0).stat().st_mode & 0o777) == "0o600"
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"generation engine of rank 0 at .* is not answering.*next attempt"):
        EngineClient(paths, 0, tmp_path / "models" / "base", timeout_s=30).sample([[1, 2]], G, 0, seed=1)
    assert time.monotonic() - t0 < 5


def test_waiting_for_an_engine_is_bounded_and_a_failed_start_ends_it(tmp_path):
    paths = RunPaths(tmp_path)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"did not start within 1s .*raise generate.engine_timeout_s"):
        read_address(paths, 0, timeout_s=1)
    assert time.monotonic() - t0 < 3
    failure_path(paths, 1).parent.mkdir(parents=True, exist_ok=True)
    failure_path(paths, 1).write_text("CUDA out of memory\n")
    with pytest.raises(RuntimeError, match="engine of rank 1 failed to start: CUDA out of memory"):
        read_address(paths, 1, timeout_s=60)

