"""The MFU numerator: the analytic model FLOPs agree with what torch counts on a real forward pass."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import LlamaConfig, LlamaForCausalLM

from stages.rl import flops


@pytest.mark.parametrize("tied,seq", [(True, 48), (False, 97)])
def test_forward_flops_match_torch_flop_counter(tied, seq):
    cfg = LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied,
                      attn_implementation="eager")  # attention as plain matmuls, which the counter sees
    model = LlamaForCausalLM(cfg).eval()
    shape = flops.model_shape(model)
    embed = model.get_input_embeddings().weight.numel()
    assert shape["n"] == sum(p.numel() for p in model.parameters()) - embed + (embed if tied else 0)
    assert (shape["layers"], shape["attn_dim"]) == (3, 64)
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(input_ids=torch.randint(0, 101, (2, seq)))
    counted = counter.get_total_flops()
    # Norm weights are parameters that do no matmul: the analytic figure is a hair above the count.
    assert counted == pytest.approx(2 * flops.forward_flops(shape, seq), rel=0.01)


def test_peak_by_device_name():
    assert flops.peak_flops("NVIDIA H200") == 989e12
    assert flops.peak_flops("Some CPU") is None
