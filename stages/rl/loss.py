"""The policy-gradient loss: PPO-clip over sampled tokens, with an optional KL penalty to a reference."""

from __future__ import annotations

import torch


def ppo_clip_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                  clip_eps: float, ref_logp: torch.Tensor | None = None, kl_coef: float = 0.0,
                  normalizer: float | None = None):
    """Token-mean PPO-clip loss.

    logp, old_logp, mask, ref_logp: [B, T]; advantages: [B] (one per sequence, shared by its tokens),
    or [B, T] (per token: a packed batch's rows share one sequence).
    Per token: max(-A * r, -A * clip(r, 1 - eps, 1 + eps)) with r = exp(logp - old_logp), plus
    kl_coef * KL estimated with k3 = exp(ref - logp) - (ref - logp) - 1 (unbiased, always >= 0).
    Averaged over the unmasked tokens, or summed and divided by `normalizer` when given (a token
    mean over more than this batch: the micro-batches of one optimizer step); a batch with no tokens
    gives a zero loss that still backpropagates, so every rank takes part in the gradient reduction.
    The metrics are means over this batch's tokens either way.
    Returns (loss, metrics): metrics are detached 0-dim tensors on the loss's device, so a training
    loop can read them once per optimizer step instead of stalling the GPU on every micro-batch.
    """
    mask = mask.to(logp.dtype)
    n_tokens = mask.sum()
    denom = n_tokens.clamp(min=1.0)
    adv = advantages.to(logp.dtype)
    if adv.dim() < logp.dim():
        adv = adv.unsqueeze(-1)
    ratio = torch.exp(logp - old_logp)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
    per_token = torch.maximum(unclipped, clipped)
    metrics = {}
    if ref_logp is not None and kl_coef > 0:
        delta = ref_logp - logp
        kl = torch.exp(delta) - delta - 1.0
        per_token = per_token + kl_coef * kl
        metrics["kl"] = ((kl * mask).sum() / denom).detach()
    loss = (per_token * mask).sum() / (denom if normalizer is None else normalizer)
    with torch.no_grad():
        metrics["clip_frac"] = ((clipped > unclipped).to(logp.dtype) * mask).sum() / denom
        metrics["ratio_mean"] = (ratio * mask).sum() / denom
    return loss, metrics
