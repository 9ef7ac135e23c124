"""The built-in base models' dimensions (model.preset): Llama-architecture decoders over the
character tokenizer, created by stages/rl/tiny_model.py. Torch-free, so that `syncrl check` can read
a preset's shape without building it."""

import string

# The built-in tokenizer's vocabulary (stages/rl/tiny_model.py builds it): the special tokens, then
# one token per printable character.
SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
CHARACTERS = [c for c in string.printable if c not in "\r\x0b\x0c"]
VOCAB_SIZE = len(SPECIAL_TOKENS) + len(CHARACTERS)

PRESETS = {
    # ~70k parameters: trains in well under a second per step on 2 CPU cores.
    "tiny-llama": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=4, max_position_embeddings=512),
    # ~0.48B parameters in its transformer blocks: the reference workload's model (bf16, one GPU).
    "small-llama": dict(hidden_size=1280, intermediate_size=3456, num_hidden_layers=24, num_attention_heads=20,
                        num_key_value_heads=20, max_position_embeddings=4096),
    # The block dimensions of Llama-3.2-3B (2.8B parameters in its blocks) and Llama-3.1-8B (7.0B),
    # grouped-query attention with head size 128, over the character vocabulary: random weights at
    # the sizes users run, for GPU benchmarks and for trying a cluster before real weights are on it.
    # Real models come through model.path.
    "llama3-3b-shape": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                            num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0),
    "llama3-8b-shape": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                            num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0),
}
