"""generate: sample `attempts` completions per prompt of this rank's shard with the current policy.

Writes iter_I/generate/rank_K.jsonl: one row per completion with prompt and completion token ids,
text, and per-token log-probabilities of the sampled tokens under the policy at the sampling
temperature (the "old" log-probs of the PPO ratio). The compact sampler records them as it draws
each token, from the same logits (tuning.logprobs: sampler, its default); the other samplers, or
tuning.logprobs: recompute, get them from one forward pass over each finished sequence, the pass
train runs (stages/rl/batches.py). With top_p < 1 the sampler draws from a truncated
distribution; the recorded log-probs are still the policy's, which is what train recomputes.
With generate.gpus_per_process N > 1 and the compact sampler, the process samples together with
N - 1 more that it starts, the policy sharded over them (stages/rl/tensor_parallel.py).

By hand (one process, rank 0 of 1; `RANK`/`WORLD_SIZE` or srun's variables set the layout):

    python -m stages.generate --run-dir RUN_DIR --iteration I [key=value ...]
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import time

import torch

from stages.rl import decoding, prompts, rehearsal, tensor_parallel
from stages.rl.batches import completion_logprobs
from stages.rl.modeling import DTYPES, device_for, load_policy, load_tokenizer, preload_model_code, set_cpu_threads
from stages.rl.vllm_sampler import VllmSampler
from stages.runtime.engine_link import EngineClient
from stages.runtime.config import TuningConfig
from stages.runtime.data import iteration_prompts, load_problems, shard
from stages.runtime.logs import Progress
from stages.runtime.markers import write_jsonl_atomic
from stages.runtime.memory import release_cached_memory
from stages.runtime.stage import StageContext, run_stage

log = logging.getLogger("syncrl.generate")

# generate() arguments per generate.cache setting (config.py says what each is for).
CACHE_ARGS = {
    "dynamic": {},
    "static": {"cache_implementation": "static", "disable_compile": True},
}


def main(ctx: StageContext) -> None:
    """Sample completions for this rank's shard of the iteration's prompts."""
    cfg = ctx.cfg
    set_cpu_threads()
    t0 = time.time()
    tokenizer = load_tokenizer(ctx.tokenizer_path())
    g = cfg.generate
    tp = tensor_parallel_size(g)
    device = model = sampler = None
    if tp == 1:
        device = device_for(ctx.info.local_rank)
        spread = g.gpus_per_process > 1
        # vLLM first: it sizes its cache from the memory free when it starts.
        if g.backend == "vllm" and g.persistent:
            sampler = EngineClient(ctx.paths, ctx.rank, ctx.policy_path(), g.engine_timeout_s)
        elif g.backend == "vllm":
            sampler = VllmSampler(ctx.policy_path(), ctx.tokenizer_path(), cfg.model.dtype, g,
                                  sample_seed(cfg.seed, ctx.iteration, ctx.rank),
                                  cache_dir=ctx.paths.vllm_cache(ctx.rank), enforce_eager=cfg.tuning.vllm_enforce_eager)
        model = load_policy(ctx.policy_path(), cfg.model.dtype, device, spread=spread,
                            fused_norms=cfg.tuning.fused_rms_norm, fused_layers=cfg.tuning.fused_layers).eval()
        if spread:
            device = model.device  # where the first layers live: inputs go there
        log.info("loaded %s on %s in %.1fs", ctx.policy_path(), device, time.time() - t0)
    load_s = time.time() - t0

    problems = load_problems(cfg.data, cfg.seed)
    items = shard(iteration_prompts(cfg.data, problems, cfg.seed, ctx.iteration), ctx.rank, ctx.world_size)
    prompts.encode(tokenizer, items, cfg.data, ctx.tokenizer_path())
    torch.manual_seed(sample_seed(cfg.seed, ctx.iteration, ctx.rank))

    t1 = time.time()
    if tp > 1:
        rows, stats = sample_sharded(ctx, tokenizer, items, tp)
        load_s += stats.pop("load_s")
    else:
        rows, stats = sample_rows(model, tokenizer, items, g, device, sampler, ctx.rank, cfg.tuning)
    new_tokens = sum(len(r["completion_ids"]) for r in rows)
    gen_s = time.time() - t1
    for r in rows:
        r["rank"] = ctx.rank
    out = ctx.paths.shard(ctx.iteration, "generate", ctx.rank)
    n = write_jsonl_atomic(out, rows)
    tps = new_tokens / gen_s if gen_s > 0 else 0.0
    ctx.summarize("wrote %d completions for %d prompts (%d new tokens, %.0f tok/s) to %s",
                  n, len(items), new_tokens, tps, out)
    ctx.write_marker([out], extra={"rows": n, "new_tokens": new_tokens, "tokens_per_s": tps,
                                   "load_s": load_s, "generate_s": gen_s, "sampling": stats})


def tensor_parallel_size(g) -> int:
    """Processes one generate task samples with, each holding a shard of every layer: its GPUs with
    the compact sampler (stages/rl/tensor_parallel.py); 1 where one process drives them all (vLLM's
    own workers, or HF's layer split with the static and dynamic caches)."""
    return g.gpus_per_process if g.backend == "hf" and g.cache == "compact" else 1


def sample_sharded(ctx: StageContext, tokenizer, items: list[dict], size: int) -> tuple[list, dict]:
    """sample_rows' rows and figures, sampled by `size` processes on the policy sharded over them."""
    cfg = ctx.cfg
    t0 = time.time()
    prompt_ids = unpadded_prompt_ids(items)
    job = tensor_parallel.Job(policy=str(ctx.policy_path()), tokenizer=str(ctx.tokenizer_path()), dtype=cfg.model.dtype,
                              prompt_ids=prompt_ids, generate=cfg.generate, tuning=cfg.tuning, seed=call_seed(),
                              size=size, tag=ctx.info.tag)
    log.info("sampling with the policy sharded over %d processes (generate.gpus_per_process)", size)
    completions, logprobs, stats = tensor_parallel.sample(job)
    stats["sample_s"] = time.time() - t0 - stats["load_s"]
    rows = completion_rows(tokenizer, items, cfg.generate, prompt_ids, completions)
    add_logprobs(rows, logprobs)
    stats["logprobs"] = "sampler" if cfg.tuning.logprobs_from_sampler(cfg.generate) else "recompute"
    return rows, stats


def sample_seed(seed: int, iteration: int, rank: int) -> int:
    """Distinct, reproducible sampling seed per (run seed, iteration, rank)."""
    digest = hashlib.sha256(f"{seed}:{iteration}:{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % (2**63)


def sample_rows(model, tokenizer, items: list[dict], g, device, sampler=None, rank: int = 0,
                tuning: TuningConfig | None = None) -> tuple[list, dict]:
    """Rows for every item (with its "prompt_ids": stages/rl/prompts.encode) x g.attempts samples,
    with the policy's log-probs of the sampled tokens, and figures on how they were sampled (the
    marker's `sampling`); `tuning` None: its defaults."""
    tuning = tuning or TuningConfig()
    if sampler is not None:
        return sample_with(sampler, model, tokenizer, items, g, device)
    if g.cache == "compact":
        t0 = time.time()
        prompt_ids = unpadded_prompt_ids(items)
        completions, logprobs, stats = sample_compact(model, tokenizer, prompt_ids, g, device, tuning)
        stats["sample_s"] = time.time() - t0
        rows = completion_rows(tokenizer, items, g, prompt_ids, completions)
        t0 = time.time()
        recorded = logprobs is not None
        add_logprobs(rows, logprobs if recorded else completion_logprobs(model, rows, g.temperature, device))
        stats["logprob_pass_s"] = time.time() - t0
        stats["logprobs"] = "sampler" if recorded else "recompute"
        return rows, stats
    per_call = max(1, (g.batch_size or 64) // g.attempts)
    rows = []
    bar = Progress(len(items), "generate: prompts", rank)
    for start in range(0, len(items), per_call):
        batch = items[start:start + per_call]
        rows += sample_batch(model, tokenizer, batch, g, device)
        bar.update(len(batch))
        release_cached_memory()
    bar.close()
    return rows, {"calls": math.ceil(len(items) / per_call)}


def sample_with(sampler, model, tokenizer, items: list[dict], g, device) -> tuple[list, dict]:
    """Rows from one call of a vLLM sampler for every prompt of the shard (the engine schedules its
    own batches: generate.batch_size caps them), then the policy's pass for the old log-probs."""
    t0 = time.time()
    prompt_ids = unpadded_prompt_ids(items)
    completions = sampler.sample(prompt_ids, g, tokenizer.eos_token_id, call_seed())
    stats = {"sample_s": time.time() - t0, "engine": sampler.figures()}
    rows = completion_rows(tokenizer, items, g, prompt_ids, completions)
    t0 = time.time()
    add_logprobs(rows, completion_logprobs(model, rows, g.temperature, device))
    stats.update(logprob_pass_s=time.time() - t0, logprobs="recompute")
    return rows, stats


def sample_compact(model, tokenizer, prompt_ids: list[list[int]], g, device,
                   tuning: TuningConfig) -> tuple[list, list | None, dict]:
    """Completions of each prompt's g.attempts sequences through stages/rl/decoding.py, all at once
    where they fit, and with tuning.logprobs=sampler the log-probs it recorded as it drew them."""
    length = decoding.buffer_length(max(len(p) for p in prompt_ids), g.max_new_tokens)
    n_seq = len(prompt_ids) * g.attempts
    rows = min(n_seq, g.batch_size or n_seq)
    positions = min(rows * length, decoding.positions_that_fit(model, rows, g.memory_fraction))
    if positions < length:
        raise RuntimeError(f"generate: not even one sequence of {length} positions fits "
                           f"generate.memory_fraction={g.memory_fraction} of the free GPU memory; lower "
                           f"generate.max_new_tokens, or raise generate.memory_fraction")
    decoder = decoding.CompactDecoder(model, rows, length, cuda_graphs=tuning.decode_graphs, positions=positions,
                                      decode_kernel=tuning.decode_kernel)
    log.info("compact decoding: %d sequences, up to %d at once, rows of up to %d positions "
             "(KV buffer %.2f GiB, %d positions)", n_seq, rows, length, decoder.cache.nbytes() / 2**30, positions)
    params = decoding.SamplingParams(max_new_tokens=g.max_new_tokens, temperature=g.temperature, top_p=g.top_p,
                                     eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    generator = torch.Generator(device).manual_seed(call_seed())
    record = tuning.logprobs_from_sampler(g)
    out = decoder.sample(prompt_ids, g.attempts, params, generator, record_logprobs=record)
    completions, logprobs = out if record else (out, None)
    stats = dataclasses.asdict(decoder.stats)
    stats.update(length=length, weight_bytes=decoder.weight_bytes, kv_bytes_per_position=decoder.kv_per_position)
    del decoder
    release_cached_memory()  # the buffer's memory goes back (to the log-prob pass, where it runs)
    return completions, logprobs, stats


@torch.no_grad()
def sample_batch(model, tokenizer, items: list[dict], g, device) -> list[dict]:
    """Rows for `items` x g.attempts samples in one call of HF generate (generate.cache static or
    dynamic); the compact cache and vLLM go through sample_rows."""
    prompt_ids, completions = sample_generate(model, tokenizer, items, g, device)
    rows = completion_rows(tokenizer, items, g, prompt_ids, completions)
    add_logprobs(rows, completion_logprobs(model, rows, g.temperature, device))
    return rows


def completion_rows(tokenizer, items: list[dict], g, prompt_ids: list, completions: list) -> list[dict]:
    """One row per sequence, cut after its first end-of-sequence token."""
    rows = []
    for j, ids in enumerate(completions):
        item = items[j // g.attempts]
        n = completion_length(ids, tokenizer.eos_token_id)
        rows.append({
            "prompt_id": item["prompt_id"],
            "problem_index": item["problem_index"],
            "sample_index": j % g.attempts,
            "question": item["question"],
            "answer": item["answer"],
            **({"fields": item["fields"]} if "fields" in item else {}),
            "prompt": item["prompt"],
            "prompt_ids": prompt_ids[j // g.attempts],
            "completion_ids": ids[:n],
            "completion": tokenizer.decode(ids[:n], skip_special_tokens=True),
            "truncated": tokenizer.eos_token_id not in ids[:n],
        })
    return rows


def completion_length(ids: list[int], eos: int) -> int:
    """Tokens of a sampled sequence that are its completion: up to and with its first end-of-sequence
    token (the policy must learn to stop, so train scores that token too)."""
    return ids.index(eos) + 1 if eos in ids else len(ids)


def add_logprobs(rows: list[dict], per_row: list[list[float]]) -> None:
    """Each row's log-probs of its completion tokens, as the shard records them."""
    for r, logprobs in zip(rows, per_row):
        r["logprobs"] = [round(x, 6) for x in logprobs]


def unpadded_prompt_ids(items: list[dict]) -> list[list[int]]:
    """Each prompt's token ids on its own, for samplers that take prompts of different lengths."""
    return [it["prompt_ids"] for it in items]


def call_seed() -> int:
    """A seed for a sampler with its own generator, drawn from the stage's seeded one: a rerun samples
    the same, and every call of a stage samples differently."""
    return int(torch.randint(0, 2**62, (1,)).item())


def sample_generate(model, tokenizer, items: list[dict], g, device) -> tuple[list, list]:
    """HF generate over the left-padded batch: (prompt ids per prompt, completion ids per sequence, in
    prompt order, `attempts` consecutive sequences per prompt; each runs to the longest one's end)."""
    # Left padding keeps every prompt's last token at the same position, which batched decoding needs.
    prompt_ids = unpadded_prompt_ids(items)
    width = max(len(p) for p in prompt_ids)
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompt_ids], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids], device=device)
    sequences = model.generate(
        input_ids=ids, attention_mask=mask, do_sample=True, temperature=g.temperature, top_p=g.top_p, top_k=0,
        max_new_tokens=g.max_new_tokens, num_return_sequences=g.attempts,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, **CACHE_ARGS[g.cache],
    )
    return prompt_ids, sequences[:, width:].tolist()


def preload(ctx: StageContext):
    """What a generate process started early does before its turn: the model code's imports, then, on
    a GPU with the compact sampler in this process, a rehearsal of its call on a one-layer model
    (stages/rl/rehearsal.py), so that the first call finds its kernels and libraries loaded. Returns
    the base model's config."""
    config = preload_model_code(ctx)
    g = ctx.cfg.generate
    if not torch.cuda.is_available() or g.backend != "hf" or g.cache != "compact" or g.gpus_per_process > 1:
        return config
    if ctx.turn_came():
        log.info("no rehearsal of the sampler: the turn came while preloading")
        return config
    t0 = time.time()
    rehearse_sampler(ctx, config)
    ctx.preload_phases["rehearsal"] = round(time.time() - t0, 3)
    return config


def rehearse_sampler(ctx: StageContext, config) -> None:
    """rehearsal.rehearse_sampling on this rank's GPU where it fits beside the stage that holds it. It
    only saves time: a failure is logged, and the first call loads what it needs itself."""
    cfg = ctx.cfg
    device, dtype = device_for(ctx.info.local_rank), DTYPES[cfg.model.dtype]
    skip = rehearsal.sampling_skip_reason(config, dtype, torch.cuda.get_device_properties(device).total_memory)
    rehearsal.before_turn("the sampler", "on", "the first call", skip, lambda: rehearsal.rehearse_sampling(
        config, dtype, cfg.tuning, cfg.generate, device))


if __name__ == "__main__":
    run_stage("generate", main, preload=preload)
