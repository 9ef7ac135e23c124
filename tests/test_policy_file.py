"""The policy file train writes for save (stages/rl/policy_file.py): safetensors, its bytes written
straight from the tensors by several threads; it must read back as the weights, as save_file's would."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from stages.rl import policy_file, serialization
from stages.runtime import safetensors_header


def weights():
    g = torch.Generator().manual_seed(0)
    embed = torch.randn(50, 8, generator=g).to(torch.bfloat16)
    w = {"model.embed_tokens.weight": embed, "lm_head.weight": embed,  # tied: written once
         "model.layers.0.mlp.up_proj.weight": torch.randn(24, 8, generator=g).to(torch.bfloat16),
         "model.norm.weight": torch.randn(8, generator=g),  # float32 beside bf16
         "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 16, generator=g).to(torch.bfloat16).t(),
         "step": torch.tensor([3], dtype=torch.int64)}
    # A view into the middle of a larger storage: its own bytes only.
    w["model.layers.0.mlp.down_proj.weight"] = torch.randn(40, 8, generator=g).to(torch.bfloat16)[16:32]
    return w


@pytest.mark.parametrize("threads", [1, 3])
def test_the_policy_file_reads_back_as_save_file_writes_it(tmp_path, monkeypatch, threads):
    monkeypatch.setattr(serialization, "CHUNK_BYTES", 64)  # many chunks a tensor, several threads at once
    w = weights()
    path = policy_file.write(w, tmp_path / "train" / "policy.safetensors", threads)
    expected = tmp_path / "expected.safetensors"
    save_file({k: v.contiguous() for k, v in w.items() if k != "lm_head.weight"}, str(expected),
              metadata={"format": "pt"})

    got, want = load_file(path), load_file(expected)
    assert sorted(got) == sorted(want) and "lm_head.weight" not in got
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    assert safetensors_header.layout(path) == safetensors_header.layout(expected)
    def data_bytes(p):  # the file past its header: the tensors' bytes and nothing else
        with open(p, "rb") as f:
            return p.stat().st_size - 8 - int.from_bytes(f.read(8), "little")

    assert data_bytes(path) == data_bytes(expected)
    with open(path, "rb") as f:  # the data starts 8-byte aligned, with the metadata transformers looks for
        size = int.from_bytes(f.read(8), "little")
        assert size % 8 == 0 and b'"__metadata__":{"format":"pt"}' in f.read(size)
    assert [p.name for p in path.parent.iterdir()] == ["policy.safetensors"]  # no temporary left


def test_a_dtype_safetensors_has_no_name_for_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(KeyError):
        policy_file.write({"w": torch.zeros(2, dtype=torch.complex64)}, tmp_path / "p.safetensors")
    assert not list(tmp_path.iterdir())
