import math

import pytest
import torch

from stages.rl.loss import ppo_clip_loss
from stages.rl.modeling import token_logprobs


def test_ppo_clip_hand_computed():
    # Two sequences, two tokens each, the second sequence's last token masked out.
    old = torch.log(torch.tensor([[0.5, 0.5], [0.5, 0.5]]))
    new = torch.log(torch.tensor([[0.75, 0.5], [0.25, 0.9]]))  # ratios 1.5, 1.0 | 0.5, (masked)
    adv = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    loss, m = ppo_clip_loss(new, old, adv, mask, clip_eps=0.2)
    # token 1: A=1, r=1.5 -> max(-1.5, -1.2) = -1.2 (clipped)
    # token 2: A=1, r=1.0 -> -1.0
    # token 3: A=-2, r=0.5 -> max(1.0, 1.6) = 1.6 (clipped at 0.8)
    expected = (-1.2 - 1.0 + 1.6) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert float(m["clip_frac"]) == pytest.approx(2 / 3)
    assert float(m["ratio_mean"]) == pytest.approx((1.5 + 1.0 + 0.5) / 3)
    assert all(v.dim() == 0 and not v.requires_grad for v in m.values())  # read once per step, no graph kept


def test_on_policy_gradient_is_advantage_weighted():
    logp = torch.log(torch.tensor([[0.2, 0.4]])).requires_grad_(True)
    loss, _ = ppo_clip_loss(logp, logp.detach(), torch.tensor([0.5]), torch.ones(1, 2), clip_eps=0.2)
    loss.backward()
    # d/dlogp of -A * exp(logp - old) at ratio 1 is -A, averaged over 2 tokens
    assert logp.grad[0].tolist() == pytest.approx([-0.25, -0.25])


def test_kl_term_k3():
    logp = torch.log(torch.tensor([[0.5]]))
    ref = torch.log(torch.tensor([[0.25]]))
    loss, m = ppo_clip_loss(logp, logp, torch.tensor([0.0]), torch.ones(1, 1), 0.2, ref_logp=ref, kl_coef=0.1)
    k3 = 0.5 - math.log(0.5) - 1  # exp(ref - logp) - (ref - logp) - 1
    assert float(m["kl"]) == pytest.approx(k3, rel=1e-6)
    assert loss.item() == pytest.approx(0.1 * k3, rel=1e-6)


def test_empty_batch_is_zero_and_backpropagates():
    logp = torch.zeros(1, 3, requires_grad=True)
    loss, _ = ppo_clip_loss(logp, torch.zeros(1, 3), torch.tensor([1.0]), torch.zeros(1, 3), 0.2)
    loss.backward()
    assert loss.item() == 0.0 and logp.grad is not None


def test_token_logprobs_temperature():
    logits = torch.tensor([[[2.0, 0.0]]])
    lp = token_logprobs(logits, torch.tensor([[0]]), temperature=2.0)
    assert lp.item() == pytest.approx(math.log(math.e / (math.e + 1)))


@pytest.mark.parametrize("dtype,temperature", [(torch.float32, 1.0), (torch.float32, 0.7), (torch.bfloat16, 1.3)])
def test_token_logprobs_value_and_gradient_match_log_softmax(dtype, temperature, monkeypatch):
    import stages.rl.modeling as modeling

    monkeypatch.setattr(modeling, "_CHUNK_ELEMENTS", 5 * 11)  # several chunks of rows, and a ragged last one
    torch.manual_seed(0)
    base = (torch.randn(7, 5, 11) * 3).to(dtype)
    tokens = torch.randint(0, 11, (7, 5))
    weights = torch.randn(7, 5)
    a = base.clone().requires_grad_(True)
    b = base.clone().requires_grad_(True)
    got = token_logprobs(a, tokens, temperature)
    want = torch.log_softmax(b.float() / temperature, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    assert got.dtype == torch.float32
    assert torch.allclose(got, want, atol=1e-5)
    (got * weights).sum().backward()
    (want * weights).sum().backward()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert a.grad.dtype == dtype and torch.allclose(a.grad.float(), b.grad.float(), atol=tol)
    with torch.no_grad():  # the no-grad path (generate) gives the same values
        assert torch.equal(token_logprobs(base, tokens, temperature), got.detach())
