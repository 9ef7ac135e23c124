"""The pipeline on GPUs (NCCL training, bf16): run on the lent H200 machines with `pytest -m gpu`.

Deselected by default (pyproject's addopts); skips where fewer than the needed GPUs are visible.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from stages.runtime.paths import STAGES

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[1]


def gpu_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.skipif(gpu_count() < 1, reason="needs a GPU")
def test_two_iterations_on_the_gpus(tmp_path):
    # One rank per GPU, up to the config's 2 (NCCL even with one); iteration 1 resumes iteration 0's checkpoint.
    ranks = min(2, gpu_count())
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "jobs.cli", "run", "configs/gpu_small.yaml", f"run_dir={run}",
                           "iterations=2", f"ranks={ranks}", "data.prompts_per_iteration=32",
                           "generate.max_new_tokens=64", "--launcher", "local"],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for it in (0, 1):
        for stage in STAGES:
            assert (run / f"iter_{it:05d}" / "markers" / f"{stage}.done").is_file(), (it, stage)
    train_log = (run / "logs" / "iter_00001" / "train" / "attempt_1" / f"rank_{ranks - 1:05d}.log").read_text()
    assert f"world {ranks}" in train_log and "resumed weights and optimizer state" in train_log
    assert "NCCL version" in train_log and (ranks == 1 or f"backend=nccl world={ranks}" in train_log)
    train = json.loads((run / "iter_00000" / "markers" / "train.done").read_text())
    assert 0 < train["mfu"] < 1
    assert train["memory"]["gpu_peak_allocated_gib"] > 0.5 and train["memory"]["gpu_ooms"] == 0
    generate = json.loads((run / "iter_00000" / "markers" / "generate.done").read_text())
    assert generate["memory"]["gpu_peak_reserved_pct"] > 0 and generate["tokens_per_s"] > 0
    from transformers import AutoModelForCausalLM
    import torch
    model = AutoModelForCausalLM.from_pretrained(run / "models" / "iter_00001", dtype=torch.bfloat16)
    assert sum(p.numel() for p in model.parameters()) > 4e8


@pytest.mark.skipif(gpu_count() < 1, reason="needs a GPU")
def test_node_local_checkpoints_export_the_weights_the_shards_hold(tmp_path):
    # bf16 on the GPU: the model states save exports from are the fp32 master weights as the optimizer
    # step rounded them, bit for bit what consolidating the shards and casting gives.
    from tests.test_local_checkpoints import assert_export_matches_the_durable_copy

    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "jobs.cli", "run", "configs/gpu_small.yaml", f"run_dir={run}",
                           "iterations=2", "ranks=1", "data.prompts_per_iteration=32", "generate.max_new_tokens=64",
                           f"train.local_checkpoint_dir={tmp_path / 'store'}", "--launcher", "local"],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert_export_matches_the_durable_copy(run, 1)  # iteration 0's durable copy is pruned (keep 1)


def vllm_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


@pytest.mark.skipif(gpu_count() < 1 or not vllm_importable(), reason="needs a GPU and vLLM")
@pytest.mark.parametrize("persistent", [False, True])
def test_two_iterations_with_the_real_vllm_engine(tmp_path, persistent):
    # The real engine on the GPU: rows whose old log-probs are the policy's (the generate stage's
    # pass), and with generate.persistent one engine that serves iteration 1 the weights of iteration 0.
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "jobs.cli", "run", "configs/gpu_small.yaml", f"run_dir={run}",
                           "iterations=2", "ranks=1", "data.prompts_per_iteration=32", "generate.max_new_tokens=64",
                           "generate.backend=vllm", f"generate.persistent={str(persistent).lower()}",
                           "--launcher", "local"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    from stages.rl.modeling import load_tokenizer

    eos = load_tokenizer(run / "models" / "base").eos_token_id
    engines = []
    for it in (0, 1):
        marker = json.loads((run / f"iter_{it:05d}" / "markers" / "generate.rank_00000.done").read_text())
        assert marker["rows"] == 32 * 8 and marker["new_tokens"] > 0
        engines.append(marker["sampling"]["engine"])
        rows = [json.loads(line) for line in (run / f"iter_{it:05d}" / "generate" / "rank_00000.jsonl").open()]
        assert all(len(r["logprobs"]) == len(r["completion_ids"]) > 0 for r in rows)
        assert all(r["truncated"] or r["completion_ids"][-1] == eos for r in rows)
    if persistent:
        assert engines[0]["engine_pid"] == engines[1]["engine_pid"]
        assert engines[1]["served"] == str(run / "models" / "iter_00000") and engines[1]["reload_s"] > 0
    else:
        # vLLM's start-up lines were read in both iterations.
        assert all(e["weights_s"] > 0 and e["engine_start_s"] > 0 for e in engines)
