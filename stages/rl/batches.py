"""Batches of rollouts (prompt + completion token ids) and the policy's log-probs of their completions.

One code path for both uses: generate records the log-probs of the tokens it sampled, and train
recomputes them for the PPO ratio; both run the same right-padded forward pass, so the ratio starts
at 1 up to kernel numerics.
"""

from __future__ import annotations

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from stages.rl import packing
from stages.rl.modeling import token_logprobs

# SDPA backends for these passes: every backend but cuDNN's. cuDNN builds an execution plan for each
# new (rows, width) shape, tens to hundreds of ms each, and these passes see a new shape at almost
# every micro-batch (rows grouped by length), so the plans would cost more than the passes.
# Flash attention needs no plan.
PASS_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

# Per forward pass when generate scores its completions: logit elements (2^30: 2 GB of bf16 logits)
# and positions (2^17: the MLP activations of a 0.5B model stay near 1 GB; with a small vocabulary
# the logits alone would let a pass grow to millions of positions).
LOGIT_BUDGET = 1 << 30
TOKEN_BUDGET = 1 << 17


def collate(micro: list[dict | None], device) -> dict:
    """Right-padded prompt+completion ids, with a mask over the completion tokens (shifted by one)."""
    real = [r for r in micro if r is not None] or [None]
    seqs = [(r["prompt_ids"] + r["completion_ids"]) if r else [0, 0] for r in real]
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(real), width, dtype=torch.long)
    attn = torch.zeros(len(real), width, dtype=torch.long)
    mask = torch.zeros(len(real), width - 1)
    old = torch.zeros(len(real), width - 1)
    adv = torch.zeros(len(real))
    for i, (r, s) in enumerate(zip(real, seqs)):
        ids[i, :len(s)] = torch.tensor(s)
        attn[i, :len(s)] = 1
        if r is None:
            continue
        p, c = len(r["prompt_ids"]), len(r["completion_ids"])
        # Position j of the shifted targets predicts token j + 1: completion tokens are p .. p + c - 1.
        mask[i, p - 1:p - 1 + c] = 1
        # Train-set rows carry both; generate batches its rows before they have either.
        if "logprobs" in r:
            old[i, p - 1:p - 1 + c] = torch.tensor(r["logprobs"])
        adv[i] = r.get("advantage", 0.0)
    out = {k: v.to(device) for k, v in
           dict(input_ids=ids, attention_mask=attn, mask=mask, old_logp=old, advantages=adv).items()}
    # Counted here, on the host, so that bookkeeping never waits for the GPU.
    out["lengths"] = [len(s) for r, s in zip(real, seqs) if r is not None]
    out["tokens"] = sum(len(r["completion_ids"]) for r in real if r is not None)
    return out


def sequence_logprobs(model, batch: dict, temperature: float) -> torch.Tensor:
    """Log-probs of tokens 1.. of each row under `model`: [B, T - 1].

    Rows are right-padded and attention is causal, so no real token can attend to padding: the
    attention mask would change only the padding's own outputs, which the loss masks out. Leaving it
    out lets SDPA run its fused causal kernel instead of a masked one. A packed batch (packing.pack:
    one sequence, [1, T]) passes its row offsets instead; its log-probs are computed per position.
    """
    ids = batch["input_ids"]
    if "cu_seq_lens" not in batch:
        with sdpa_kernel(PASS_BACKENDS):
            # use_cache=False: transformers would otherwise keep every layer's keys and values of a
            # pass that decodes nothing after it (and tuning.fused_layers takes only cache-free passes).
            logits = model(input_ids=ids, use_cache=False).logits
        return token_logprobs(logits[:, :-1], ids[:, 1:], temperature)
    logits = model(input_ids=ids, **packing.model_kwargs(batch)).logits
    # [T - 1, 1, V]: token_logprobs works through its float32 pass a few rows at a time.
    return token_logprobs(logits[0, :-1].unsqueeze(1), ids[0, 1:].unsqueeze(1), temperature).T


@torch.no_grad()
def completion_logprobs(model, rows: list[dict], temperature: float, device) -> list[list[float]]:
    """log p(completion token) under `model` for each row, a few rows per forward pass.

    Rows go through in order of length, so that each pass pads its rows to a similar width; the
    results come back in the rows' order.
    """
    lengths = [packing.row_width(r) for r in rows]
    order = sorted(range(len(rows)), key=lengths.__getitem__)
    out: list = [None] * len(rows)
    vocab = model.config.vocab_size
    i = 0
    while i < len(order):
        width, take = lengths[order[i]], 1
        while i + take < len(order):
            w = max(width, lengths[order[i + take]])
            if (take + 1) * w * vocab > LOGIT_BUDGET or (take + 1) * w > TOKEN_BUDGET:
                break
            width, take = w, take + 1
        chunk = [rows[k] for k in order[i:i + take]]
        batch = collate(chunk, device)
        logp = sequence_logprobs(model, batch, temperature).cpu()
        for j, (k, r) in enumerate(zip(order[i:i + take], chunk)):
            p, c = len(r["prompt_ids"]), len(r["completion_ids"])
            out[k] = logp[j, p - 1:p - 1 + c].tolist()
        i += take
    return out
