"""One rank of tests/test_tensor_parallel_decoding.py: the compact sampler on a model sharded
tensor-parallel over the ranks, and on the same model whole.

Run as `python -m torch.distributed.run --nproc-per-node N -m tests.workers.tensor_parallel_sampling
MODEL_DIR OUT_FILE`. Each rank loads MODEL_DIR twice: sharded by transformers' tensor-parallel
plan (stages/rl/tensor_parallel.load_sharded, gloo on CPU: each rank holds its shard of every
layer's heads and MLP, the logits gathered whole on every rank) and whole; each samples the same
prompts with the same seed. Rank 0 writes both samplers' ids and log-probs, and what the sharded
model held, to OUT_FILE.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as tdist
from transformers import AutoModelForCausalLM

from stages.rl.decoding import CompactDecoder, SamplingParams, buffer_length, tensor_parallel_size
from stages.rl.tensor_parallel import load_sharded

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [20, 21]]
ATTEMPTS, NEW_TOKENS = 3, 12


def sample(model, eos: int) -> tuple[list, list]:
    decoder = CompactDecoder(model, rows=len(PROMPTS) * ATTEMPTS, length=buffer_length(5, NEW_TOKENS),
                             cuda_graphs=False)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, eos_token_id=eos, pad_token_id=0)
    return decoder.sample(PROMPTS, ATTEMPTS, params, torch.Generator().manual_seed(3), record_logprobs=True)


def main(model_dir: str, out_file: str) -> None:
    tdist.init_process_group("gloo")
    sharded = load_sharded(model_dir, torch.float32, 2)
    whole = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos = whole.config.eos_token_id
    (ids, lps), (ids_whole, lps_whole) = sample(sharded, eos), sample(whole, eos)
    k_proj = sharded.model.layers[0].self_attn.k_proj.weight
    if tdist.get_rank() == 0:
        with open(out_file, "w") as f:
            json.dump({"ids": ids, "logprobs": lps, "ids_whole": ids_whole, "logprobs_whole": lps_whole,
                       "tp_size": tensor_parallel_size(sharded), "k_rows_local": k_proj.to_local().shape[0],
                       "k_rows": k_proj.shape[0]}, f)
    tdist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
