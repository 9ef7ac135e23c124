"""train's rehearsal before its turn (stages/rl/rehearsal.py): the micro-step path of a one-layer model
of the policy's architecture, the fused layers' kernels included (interpreted here, as in
tests/test_fused_layers.py). That it saves the first micro-batch its kernel loads is measured on a GPU
(docs/benchmarks.md); here: that it runs every piece train's first step runs, for each setting that
changes which pieces those are."""


import pytest
import torch

from stages.rl import fused_layers, rehearsal
from stages.runtime.config import ModelConfig, TrainConfig

pytest.importorskip("triton")


@pytest.fixture
def interpreted(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    fused_layers.kernels.cache_clear()
    yield
    fused_layers.kernels.cache_clear()


def config(kind: str = "llama"):
    from transformers import Qwen2Config

    from stages.rl.tiny_model import build_tokenizer, llama_config

    dims = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256)
    if kind == "llama":
        return llama_config(dims)
    return Qwen2Config(vocab_size=len(build_tokenizer()), **dims)


@pytest.mark.parametrize("settings", [{}, {"remove_padding": False, "kl_coef": 0.1}], ids=["packed", "padded-kl"])
def test_the_rehearsal_runs_the_micro_steps_pieces(interpreted, monkeypatch, settings):
    ran = []
    for name in ("RotaryQKV", "SwiGLU"):
        fn = getattr(fused_layers, name).apply
        monkeypatch.setattr(getattr(fused_layers, name), "apply", lambda *a, fn=fn, name=name: ran.append(name) or fn(*a))
    steps = []
    original = torch.optim.AdamW.step
    monkeypatch.setattr(torch.optim.AdamW, "step", lambda self, *a: steps.append(self) or original(self, *a))
    before = torch.random.get_rng_state()
    seconds = rehearsal.rehearse(config(), torch.float32, ModelConfig(), TrainConfig(**settings), 1.0, "cpu")
    assert seconds > 0
    assert torch.equal(torch.random.get_rng_state(), before)  # train's own draws are not moved
    assert ran.count("RotaryQKV") == 1 and ran.count("SwiGLU") == 1  # one layer, fused
    (adam,) = steps
    params = adam.param_groups[0]["params"]
    assert all(p.dtype == torch.float32 and p.grad is not None and torch.isfinite(p.grad).all() for p in params)
    assert any(p.grad.abs().sum() > 0 for p in params)


def test_one_layer_keeps_the_architecture_and_cuts_per_layer_lists():
    qwen = config("qwen2")
    assert len(qwen.layer_types) == 3
    small = rehearsal.one_layer(qwen)
    assert small.num_hidden_layers == 1 and small.layer_types == qwen.layer_types[:1]
    assert (small.hidden_size, small.vocab_size, small.num_key_value_heads) == (64, qwen.vocab_size, 2)
    assert qwen.num_hidden_layers == 3  # a copy
    rows = rehearsal.synthetic_rows(qwen.vocab_size)
    assert all(max(r["prompt_ids"] + r["completion_ids"]) < qwen.vocab_size for r in rows)
    assert {r["advantage"] for r in rows} == {1.0, -1.0}
