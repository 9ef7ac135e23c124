"""The built-in presets (stages/rl/tiny_model.py): the shapes users run have the published block
dimensions, and every preset `model.preset` accepts is one the model writer knows."""

import pytest
import torch

from stages.rl.tiny_model import PRESETS, create_base_model, llama_config
from stages.runtime.config import PRESETS as CONFIG_PRESETS


def test_the_config_accepts_exactly_the_built_in_presets():
    assert set(CONFIG_PRESETS) == set(PRESETS)


@pytest.mark.parametrize("preset,params,kv_heads", [("llama3-3b-shape", 2.82e9, 8), ("llama3-8b-shape", 6.98e9, 8)])
def test_the_large_presets_have_the_llama3_block_dimensions(preset, params, kv_heads):
    from transformers import LlamaForCausalLM

    config = llama_config(PRESETS[preset])
    with torch.device("meta"):
        model = LlamaForCausalLM._from_config(config, dtype=torch.bfloat16)
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(params, rel=0.01)
    assert config.num_key_value_heads == kv_heads and config.head_dim == 128
    assert config.vocab_size < 200  # the character tokenizer: the parameters are the blocks'


def test_a_large_preset_is_written_in_the_stored_dtype(tmp_path, monkeypatch):
    """A large preset initialises in the stored dtype (no fp32 copy): written here at 2 layers, which
    is what changes with the dimensions, not the path."""
    from stages.rl import tiny_model

    small = dict(PRESETS["llama3-3b-shape"], hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1)
    monkeypatch.setitem(tiny_model.PRESETS, "llama3-3b-shape", small)
    out = create_base_model(tmp_path / "base", "llama3-3b-shape", seed=0, dtype="bfloat16")
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes == {"BF16"}
