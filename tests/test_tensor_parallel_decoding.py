"""The compact sampler on a model sharded tensor-parallel (transformers' tp_plan under
torch.distributed): two processes, gloo on CPU, each holding half of every layer's heads, draw the
same tokens with the same log-probs as the whole model (tests/workers/tensor_parallel_sampling.py).
Grouped-query attention: 4 query heads over 2 K/V heads, one K/V head per process."""

import json
import subprocess
import sys
from pathlib import Path

import torch
from transformers import LlamaForCausalLM

from stages.rl.tiny_model import build_tokenizer, llama_config

ROOT = Path(__file__).resolve().parents[1]


def test_the_sharded_model_samples_what_the_whole_one_does(tmp_path):
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
