"""The GPU benchmarks still run end to end: each once on CPU, tiny, so they cannot rot between GPU sessions.

The figures they print here mean nothing (2 CPU cores, a 70k-parameter model); the runs check that
the scripts drive the current stage code and print their tables.
"""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT)}


def run(args, timeout=300):
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_train_mfu_benchmark_runs_the_train_micro_step(tmp_path):
    out = run(["-m", "torch.distributed.run", "--nproc-per-node", "2", "tests/benchmarks/train_mfu.py",
               "--preset", "tiny-llama", "--seq", "160", "--steps", "2", "--warmup", "1",
               "--variants", "z2:m2,z3:m2:kl", "--model-dir", str(tmp_path / "base")])
    assert "z2:m2" in out and "z3:m2:kl" in out and out.count("s/step") == 2
    assert "forward = 2*N*s + 4*L*d*s^2" in out


def test_generate_benchmark_runs_every_mode(tmp_path):
    out = run(["tests/benchmarks/generate_cache.py", "--preset", "tiny-llama", "--dtype", "float32",
               "--prompts", "2", "--attempts", "2", "--new-tokens", "4", "--repeats", "1", "--json",
               str(tmp_path / "gen.json")])
    for mode in ("eager", "dynamic", "static", "compiled"):
        assert f"{mode:<11} / eager" in out
