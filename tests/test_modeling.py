"""The fused RMSNorm (tuning.fused_rms_norm, stages/rl/modeling.py) computes what HF's forward does.

On CPU in float32 F.rms_norm runs the same arithmetic, so logits and gradients are equal; on a GPU
(`pytest -m gpu`) in bf16 the fused kernel rounds once where HF rounds twice, so they agree within
bf16 tolerance.
"""

import pytest
import torch

from stages.rl.modeling import fuse_rms_norms, load_policy
from stages.rl.tiny_model import create_base_model
from tests.devices import DEVICES



@pytest.mark.parametrize("device", DEVICES)
def test_fused_rms_norms_compute_what_hf_computes(tmp_path, device):
    preset, dtype = ("tiny-llama", "float32") if device == "cpu" else ("small-llama", "bfloat16")
    path = create_base_model(tmp_path / "base", preset, seed=0)
    plain = load_policy(path, dtype, torch.device(device))
    fused = load_policy(path, dtype, torch.device(device), fused_norms=True)
    layers = plain.config.num_hidden_layers
    assert fuse_rms_norms(load_policy(path, dtype)) == 2 * layers + 1  # two per layer and the final one
    ids = torch.randint(4, plain.config.vocab_size, (4, 40), device=device)
    a, b = plain(input_ids=ids).logits.float(), fused(input_ids=ids).logits.float()
    a.logsumexp(-1).sum().backward()
    b.logsumexp(-1).sum().backward()
    grads = [(p.grad.float(), q.grad.float()) for p, q in zip(plain.parameters(), fused.parameters())]
    if device == "cpu":
        assert torch.equal(a, b)
        assert all(torch.equal(g, h) for g, h in grads)
    else:
        assert (a - b).abs().mean() < 0.02 * a.abs().mean()
        for g, h in grads:
            assert (g - h).norm() <= 0.05 * g.norm() + 1e-6


def test_other_norms_are_left_alone(tmp_path):
    path = create_base_model(tmp_path / "base", "tiny-llama", seed=0)
    model = load_policy(path, "float32")
    model.model.norm.__class__ = type("GemmaRMSNorm", (type(model.model.norm),), {})  # weight + 1: not fusable
    assert fuse_rms_norms(model) == 2 * model.config.num_hidden_layers
    assert "forward" not in vars(model.model.norm)
