"""generate: sample `attempts` completions per prompt of this rank's shard with the current policy.

Writes iter_I/generate/rank_K.jsonl: one row per completion with prompt and completion token ids,
text, and per-token log-probabilities of the sampled tokens under the policy at the sampling
temperature (the "old" log-probs of the PPO ratio). They come from one forward pass over each
finished sequence, the same pass train runs (stages/common/batches.py), rather than from the logits
of every decoding step: keeping those would cost batch x new tokens x vocabulary floats (67 GB for
256 sequences x 512 tokens with a 128k vocabulary). With top_p < 1 the sampler draws from a
truncated distribution; the recorded log-probs are still the policy's, which is what train recomputes.
"""

from __future__ import annotations

import hashlib
import logging
import time

import torch

from stages.common.batches import completion_logprobs
from stages.common.data import iteration_prompts, load_problems, shard
from stages.common.logs import Progress
from stages.common.markers import write_jsonl_atomic
from stages.common.memory import release_cached_memory
from stages.common.modeling import device_for, load_policy, load_tokenizer, preload_model_code, set_cpu_threads
from stages.common.stage import StageContext, run_stage

log = logging.getLogger("syncrl.generate")

# generate() arguments per generate.cache setting (config.py says what each is for).
CACHE_ARGS = {
    "dynamic": {},
    "static": {"cache_implementation": "static", "disable_compile": True},
    "compiled": {"cache_implementation": "static"},
}


def main(ctx: StageContext) -> None:
    """Sample completions for this rank's shard of the iteration's prompts."""
    cfg = ctx.cfg
    set_cpu_threads()
    device = device_for(ctx.info.local_rank)
    t0 = time.time()
    tokenizer = load_tokenizer(ctx.tokenizer_path())
    spread = cfg.generate.gpus_per_process > 1
    model = load_policy(ctx.policy_path(), cfg.model.dtype, device, spread=spread).eval()
    if spread:
        device = model.device  # where the first layers live: inputs go there
    load_s = time.time() - t0
    log.info("loaded %s on %s in %.1fs", ctx.policy_path(), device, load_s)

    problems = load_problems(cfg.data, cfg.seed)
    items = shard(iteration_prompts(cfg.data, problems, cfg.seed, ctx.iteration), ctx.rank, ctx.world_size)
    torch.manual_seed(sample_seed(cfg.seed, ctx.iteration, ctx.rank))

    g = cfg.generate
    per_call = max(1, g.batch_size // g.attempts)
    rows, new_tokens = [], 0
    t1 = time.time()
    bar = Progress(len(items), f"generate iteration {ctx.iteration}: prompts", ctx.rank)
    for start in range(0, len(items), per_call):
        batch = items[start:start + per_call]
        batch_rows = sample_batch(model, tokenizer, batch, g, device)
        new_tokens += sum(len(r["completion_ids"]) for r in batch_rows)
        rows += batch_rows
        bar.update(len(batch))
        release_cached_memory()
    bar.close()
    gen_s = time.time() - t1
    for r in rows:
        r["rank"] = ctx.rank
    out = ctx.paths.shard(ctx.iteration, "generate", ctx.rank)
    n = write_jsonl_atomic(out, rows)
    tps = new_tokens / gen_s if gen_s > 0 else 0.0
    ctx.summarize("wrote %d completions for %d prompts (%d new tokens, %.0f tok/s) to %s",
                  n, len(items), new_tokens, tps, out)
    ctx.write_marker([out], extra={"rows": n, "new_tokens": new_tokens, "tokens_per_s": tps,
                                   "load_s": load_s, "generate_s": gen_s})


def sample_seed(seed: int, iteration: int, rank: int) -> int:
    """Distinct, reproducible sampling seed per (run seed, iteration, rank)."""
    digest = hashlib.sha256(f"{seed}:{iteration}:{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % (2**63)


@torch.no_grad()
def sample_batch(model, tokenizer, items: list[dict], g, device) -> list[dict]:
    # Left padding keeps every prompt's last token at the same position, which batched decoding needs.
    enc = tokenizer([it["prompt"] for it in items], return_tensors="pt", padding=True,
                    padding_side="left", add_special_tokens=False).to(device)
    sequences = model.generate(
        **enc, do_sample=True, temperature=g.temperature, top_p=g.top_p, top_k=0,
        max_new_tokens=g.max_new_tokens, num_return_sequences=g.attempts,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, **CACHE_ARGS[g.cache],
    )
    prompt_len = enc["input_ids"].shape[1]
    completions = sequences[:, prompt_len:]
    # The prompts without their left padding, once per prompt.
    prompt_ids = [ids[mask.bool()].tolist() for ids, mask in zip(enc["input_ids"], enc["attention_mask"])]
    rows = []
    for j in range(completions.shape[0]):
        item = items[j // g.attempts]
        ids = completions[j].tolist()
        # Keep the end-of-sequence token: the policy must learn to stop, so train scores it too.
        n = ids.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in ids else len(ids)
        rows.append({
            "prompt_id": item["prompt_id"],
            "problem_index": item["problem_index"],
            "sample_index": j % g.attempts,
            "question": item["question"],
            "answer": item["answer"],
            "prompt": item["prompt"],
            "prompt_ids": prompt_ids[j // g.attempts],
            "completion_ids": ids[:n],
            "completion": tokenizer.decode(ids[:n], skip_special_tokens=True),
            "truncated": tokenizer.eos_token_id not in ids[:n],
        })
    for r, logprobs in zip(rows, completion_logprobs(model, rows, g.temperature, device)):
        r["logprobs"] = [round(x, 6) for x in logprobs]
    return rows


if __name__ == "__main__":
    run_stage("generate", main, preload=preload_model_code)
