"""save's two ways to make an export: the weights written through save_pretrained and read back,
or (tuning.deferred_checkpoint) the policy file train wrote linked in, its safetensors header checked
against the architecture. Both must give the same model directory."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from stages.rl.tiny_model import create_base_model
from stages.save import SAFE_WEIGHTS_NAME, check_layout, link_export, meta_model, write_weights


def policy_file(base, path, dtype=torch.bfloat16):
    """What train writes before its marker (deferred_checkpoint.write_policy): each tensor once."""
    weights = {k: v.to(dtype) for k, v in load_file(base / SAFE_WEIGHTS_NAME).items()}
    save_file(weights, str(path), metadata={"format": "pt"})
    return weights


def without_version(path):
    return {k: v for k, v in json.loads(path.read_text()).items() if k != "transformers_version"}


def test_the_linked_export_is_the_written_one(tmp_path):
    from transformers import AutoModelForCausalLM

    base = create_base_model(tmp_path / "base", "tiny-llama", seed=0)  # fp32, tied embeddings
    policy = tmp_path / "policy.safetensors"
    weights = policy_file(base, policy)

    written, linked = tmp_path / "written", tmp_path / "linked"
    assert write_weights(weights, base, "bfloat16", written, base)["export"] == "written"
    assert link_export(policy, base, "bfloat16", linked, base)["export"] == "linked"
    assert os.path.samefile(policy, linked / SAFE_WEIGHTS_NAME)

    assert sorted(p.name for p in written.iterdir()) == sorted(p.name for p in linked.iterdir())
    for name in ("config.json", "generation_config.json"):
        assert without_version(written / name) == without_version(linked / name), name
    assert json.loads((linked / "config.json").read_text())["dtype"] == "bfloat16"  # the base model's is float32
    a, b = load_file(written / SAFE_WEIGHTS_NAME), load_file(linked / SAFE_WEIGHTS_NAME)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    loaded = AutoModelForCausalLM.from_pretrained(linked)
    assert loaded.dtype == torch.bfloat16
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in weights.items())
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()  # tied again


@pytest.mark.parametrize("change, message", [
    (lambda w: w.pop("model.norm.weight"), r"missing \['model.norm.weight'\]"),
    (lambda w: w.update({"extra.weight": torch.zeros(2)}), r"unexpected \['extra.weight'\]"),
    (lambda w: w.update({"model.norm.weight": torch.zeros(3, dtype=torch.bfloat16)}),
     r"model.norm.weight: \('BF16', \(3,\)\) where"),
    (lambda w: w.update({"model.norm.weight": w["model.norm.weight"].float()}),
     r"\('F32', \(64,\)\) where the model has \('BF16', \(64,\)\)"),
], ids=["missing", "unexpected", "shape", "dtype"])
def test_a_policy_file_that_does_not_fit_the_architecture_is_refused(tmp_path, change, message):
    base = create_base_model(tmp_path / "base", "tiny-llama", seed=0)
    weights = {k: v.to(torch.bfloat16) for k, v in load_file(base / SAFE_WEIGHTS_NAME).items()}
    change(weights)
    policy = tmp_path / "policy.safetensors"
    save_file(weights, str(policy))
    with pytest.raises(RuntimeError, match=f"{policy} does not match the model .*{message}"):
        check_layout(policy, meta_model(base, "bfloat16"))


def test_a_policy_file_laid_out_as_the_previous_export_takes_its_files_without_building_the_model(tmp_path):
    base = create_base_model(tmp_path / "base", "tiny-llama", seed=0)
    first, second = tmp_path / "iter_00000", tmp_path / "iter_00001"
    weights = policy_file(base, tmp_path / "policy0.safetensors")
    assert link_export(tmp_path / "policy0.safetensors", base, "bfloat16", first, base)["layout"] == \
        "checked against the architecture"  # the base model: built and checked
    # The next iteration's policy file: other values, the same names, dtypes and shapes.
    save_file({k: v + 1 for k, v in weights.items()}, str(tmp_path / "policy1.safetensors"), metadata={"format": "pt"})
    seconds = link_export(tmp_path / "policy1.safetensors", first, "bfloat16", second, first, previous_export=True)
    assert seconds["layout"] == "as the previous export"
    assert sorted(p.name for p in first.iterdir()) == sorted(p.name for p in second.iterdir())
    for name in ("config.json", "generation_config.json", "tokenizer_config.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    assert os.path.samefile(tmp_path / "policy1.safetensors", second / SAFE_WEIGHTS_NAME)
    # A file laid out otherwise is checked against the architecture, and refused where it does not fit.
    weights.pop("model.norm.weight")
    save_file(weights, str(tmp_path / "policy2.safetensors"))
    with pytest.raises(RuntimeError, match=r"missing \['model.norm.weight'\]"):
        link_export(tmp_path / "policy2.safetensors", second, "bfloat16", tmp_path / "iter_00002", second,
                    previous_export=True)
