"""Sampling on a model sharded tensor-parallel (transformers' plan under torch.distributed), on the
host with gloo: the compact sampler on the sharded model draws what the whole model does, and the
generate stage with generate.gpus_per_process=2 samples with two processes
(stages/rl/tensor_parallel.py), every wait bounded when one of them dies."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaForCausalLM

from stages.rl.tiny_model import build_tokenizer, llama_config

ROOT = Path(__file__).resolve().parents[1]


def test_the_sharded_model_samples_what_the_whole_one_does(tmp_path):
    # tests/workers/tensor_parallel_sampling.py: two processes, each holding half of every layer's
    # heads. Grouped-query attention: 4 query heads over 2 K/V heads, one K/V head per process.
    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    dims = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512)
    model = LlamaForCausalLM(llama_config(dims, tokenizer))
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    out = tmp_path / "samples.json"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "tests.workers.tensor_parallel_sampling", str(tmp_path / "model"), str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(out.read_text())
    # Each process held one of the two K/V heads (16 rows of k_proj's 32).
    assert got["tp_size"] == 2 and (got["k_rows_local"], got["k_rows"]) == (16, 32)
    assert got["ids"] == got["ids_whole"] and sum(map(len, got["ids"])) > len(got["ids"])
    for a, b in zip(got["logprobs"], got["logprobs_whole"]):
        assert len(a) == len(b) and all(abs(x - y) < 1e-5 for x, y in zip(a, b))


def generate_by_hand(run, *overrides, **popen):
    for marker in (run / "iter_00000" / "markers").glob("generate*"):
        marker.unlink()
    args = [sys.executable, "-m", "stages.generate", "--run-dir", str(run), "--iteration", "0",
            "generate.gpus_per_process=2", *overrides]
    return subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def test_generate_samples_with_the_policy_sharded_over_two_processes(tmp_path, tiny_run):
    from stages.rl.batches import completion_logprobs
    from stages.runtime.config import load_config
    from transformers import AutoModelForCausalLM

    run = tmp_path / "run"
    shutil.copytree(tiny_run.dir, run)
    proc = generate_by_hand(run, "generate.max_new_tokens=24")
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-4000:]
    assert "sampling with the policy sharded over 2 processes" in err
    marker = json.loads((run / "iter_00000" / "markers" / "generate.rank_00000.done").read_text())
    assert marker["sampling"]["tensor_parallel"] == 2 and marker["sampling"]["logprobs"] == "sampler"
    rows = [json.loads(line) for line in (run / "iter_00000" / "generate" / "rank_00000.jsonl").read_text().splitlines()]
    config = load_config(run / "config.yaml", [])
    assert len(rows) == config.data.prompts_per_iteration * config.generate.attempts
    assert sum(len(r["completion_ids"]) for r in rows) > len(rows)
    # The log-probs the sharded sampler recorded are the whole policy's, as train recomputes them.
    whole = AutoModelForCausalLM.from_pretrained(run / "models" / "base").eval()
    with torch.no_grad():
        expected = completion_logprobs(whole, rows, config.generate.temperature, torch.device("cpu"))
    for r, lps in zip(rows, expected):
        assert len(r["logprobs"]) == len(lps) and all(abs(a - b) < 1e-4 for a, b in zip(r["logprobs"], lps))


def members_of(pid: int) -> list[int]:
    """The sampling members a generate process started (multiprocessing's spawned children)."""
    out = subprocess.run(["pgrep", "-P", str(pid), "-f", "multiprocessing-fork"], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def wait_for(what, timeout: float):
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = what()
        if found:
            return found
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout}s: {what}")


def test_a_member_that_dies_ends_the_generate_process_and_one_whose_generate_died_ends(tmp_path, tiny_run):
    run = tmp_path / "run"
    shutil.copytree(tiny_run.dir, run)
    # A member killed: generate, waiting for it in a collective, fails at once (not at the timeout).
    proc = generate_by_hand(run)
    member = wait_for(lambda: members_of(proc.pid), 120)[0]
    os.kill(member, signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, err[-3000:]
    assert "tensor-parallel member 1 exited with code -9 while sampling; ending this process" in err
    assert not (run / "iter_00000" / "markers" / "generate.rank_00000.done").exists()
    # generate killed: its member gets SIGTERM and does not wait out its collectives.
    proc = generate_by_hand(run)
    member = wait_for(lambda: members_of(proc.pid), 120)[0]
    proc.kill()
    proc.communicate(timeout=60)
    wait_for(lambda: not os.path.exists(f"/proc/{member}") or _state(member) == "Z", 30)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return "gone"
