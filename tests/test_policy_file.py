"""The policy file train writes for save (stages/rl/policy_file.py): safetensors' own reader takes it
whole, tensors of every dtype a policy comes in, views into a flat buffer, tied weights once."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from stages.rl import policy_file, serialization


@pytest.mark.parametrize("threads", [1, 3])
def test_the_threaded_writer_leaves_what_safetensors_reads(tmp_path, monkeypatch, threads):
    monkeypatch.setattr(serialization, "CHUNK_BYTES", 4096)  # tensors over several chunks, split among threads
    flat = torch.randn(10_000).to(torch.bfloat16)  # ZeRO's flat buffer: the weights are views into it
    g = torch.Generator().manual_seed(0)
    embed = torch.randn(300, 17, generator=g)
    weights = {"model.embed_tokens.weight": embed, "lm_head.weight": embed,  # tied: written once
               "model.layers.0.q.weight": flat[7:7 + 64 * 33].view(64, 33),
               "model.layers.0.norm.weight": flat[5000:5003], "model.empty": torch.empty(0, 4),
               "model.rotary.inv_freq": torch.arange(9, dtype=torch.float64),
               "model.positions": torch.arange(1000, dtype=torch.int64), "model.mask": torch.rand(77, generator=g) > 0.5,
               "model.half": torch.randn(33, generator=g).half(), "model.t": embed[1:41].t()}  # non-contiguous
    path = policy_file.write(weights, tmp_path / "train" / "policy.safetensors", threads=threads)
    back = load_file(path)
    assert sorted(back) == sorted(k for k in weights if k != "lm_head.weight")
    for name, t in back.items():
        assert t.dtype == weights[name].dtype and torch.equal(t, weights[name]), name
    with safe_open(path, "pt") as f:
        assert f.metadata() == {"format": "pt"}
    assert not list(path.parent.glob(".*.tmp"))
    # The same tensors as safetensors' own writer lays them out read back the same.
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in back.items()}, str(tmp_path / "reference.safetensors"))
    reference = load_file(tmp_path / "reference.safetensors")
    assert all(torch.equal(reference[k], back[k]) for k in back)


def test_a_dtype_safetensors_names_otherwise_goes_through_its_writer(tmp_path):
    weights = {"w": torch.ones(3, dtype=torch.complex64), "b": torch.zeros(2)}
    back = load_file(policy_file.write(weights, tmp_path / "policy.safetensors"))
    assert torch.equal(back["w"], weights["w"]) and torch.equal(back["b"], weights["b"])
