"""The pipeline on GPUs (NCCL training, bf16): run on the lent H200 machines with `pytest -m gpu`.

Deselected by default (pyproject's addopts); skips where fewer than the needed GPUs are visible.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from stages.common.paths import STAGES

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[1]


def gpu_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.skipif(gpu_count() < 2, reason="needs 2 GPUs")
def test_one_iteration_on_two_gpus(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "jobs.cli", "run", "configs/gpu_small.yaml", f"run_dir={run}",
                           "iterations=1", "data.prompts_per_iteration=32", "generate.max_new_tokens=64",
                           "--launcher", "local"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for stage in STAGES:
        assert (run / "iter_00000" / "markers" / f"{stage}.done").is_file(), stage
    train_log = (run / "logs" / "iter_00000" / "train" / "attempt_1" / "rank_00001.log").read_text()
    assert "backend=nccl world=2" in train_log
    train = json.loads((run / "iter_00000" / "markers" / "train.done").read_text())
    assert 0 < train["mfu"] < 1
    assert train["memory"]["gpu_peak_allocated_gib"] > 0.5 and train["memory"]["gpu_ooms"] == 0
    generate = json.loads((run / "iter_00000" / "markers" / "generate.done").read_text())
    assert generate["memory"]["gpu_peak_reserved_pct"] > 0 and generate["tokens_per_s"] > 0
    from transformers import AutoModelForCausalLM
    import torch
    model = AutoModelForCausalLM.from_pretrained(run / "models" / "iter_00000", dtype=torch.bfloat16)
    assert sum(p.numel() for p in model.parameters()) > 4e8
