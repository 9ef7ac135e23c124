"""Built-in base models, created locally from a config so that no model hub is needed.

    python -m stages.rl.tiny_model OUT_DIR [--preset tiny-llama] [--seed 0]

(the coordinator and `syncrl init-model` run it so, which keeps them free of torch).

The tokenizer is a real HF fast tokenizer at character level over printable ASCII: small enough for
a 100k-parameter model to learn from, and it can encode any GSM8K problem.
"""

from __future__ import annotations

from pathlib import Path

from stages.runtime.markers import publish_new_dir, write_json_atomic
from stages.runtime.presets import CHARACTERS, PRESETS, SPECIAL_TOKENS

# Presets initialised where they are created in the stored dtype, on a GPU when there is one: an
# fp32 copy of the 8B shape on the host would take 28 GB and minutes of one core's random numbers.
LARGE_PRESETS = ("llama3-3b-shape", "llama3-8b-shape")


def build_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(list(SPECIAL_TOKENS.values()) + CHARACTERS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIAL_TOKENS["unk_token"]))
    # One token per character; Fuse joins them back without the spaces WordLevel would insert.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, **SPECIAL_TOKENS)


def llama_config(dims: dict, tokenizer=None):
    """A Llama config of the given block dimensions over the built-in character tokenizer."""
    from transformers import LlamaConfig

    tokenizer = tokenizer or build_tokenizer()
    return LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                       tie_word_embeddings=True, **dims)


def create_base_model(out_dir: str | Path, preset: str = "tiny-llama", seed: int = 0, dtype: str = "float32") -> Path:
    """Write an HF model (safetensors + config + tokenizer) for `preset` to out_dir, atomically,
    initialised in fp32 and stored in `dtype` (the run's model.dtype: the same weights every stage
    loads, and a config like that of the models save exports, which vLLM's compile cache keys on).
    LARGE_PRESETS are initialised in `dtype` itself, on the GPU where there is one."""
    import torch
    from transformers import LlamaForCausalLM

    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; choose one of {', '.join(PRESETS)}")
    out_dir = Path(out_dir)
    if out_dir.exists():  # refused before building the model; publish_new_dir checks again at the end
        raise FileExistsError(f"{out_dir} already exists: choose another directory, or remove it first")
    tokenizer = build_tokenizer()
    config = llama_config(PRESETS[preset], tokenizer)
    torch.manual_seed(seed)
    if preset in LARGE_PRESETS:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        with torch.device(device):
            model = LlamaForCausalLM._from_config(config, dtype=getattr(torch, dtype))
    else:
        model = LlamaForCausalLM(config).to(getattr(torch, dtype))

    def fill(tmp: Path) -> None:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        write_json_atomic(tmp / "syncrl_preset.json", {"preset": preset, "seed": seed})

    publish_new_dir(out_dir, fill)
    if next(model.parameters()).is_cuda:  # the allocator would keep the weights' memory from the caller's work
        del model, fill
        torch.cuda.empty_cache()
    return out_dir


def main(argv=None) -> int:
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m stages.rl.tiny_model", description=create_base_model.__doc__)
    parser.add_argument("out_dir")
    parser.add_argument("--preset", default="tiny-llama", choices=sorted(PRESETS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", choices=("bfloat16", "float16", "float32"))
    args = parser.parse_args(argv)
    try:
        create_base_model(args.out_dir, args.preset, args.seed, args.dtype)
    except FileExistsError as e:
        print(e, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
