"""A tiny model with a real subword tokenizer, made here: a byte-level BPE trained with `tokenizers`
on GSM8K's text (../shared/data/gsm8k, or text written here where that is absent), set up the way
Llama-3's is: a BOS its post-processor adds, an end-of-turn token as EOS, no pad token, and a chat
template. What users bring, without a model hub."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

GSM8K_TEST = Path(os.environ.get("SYNCRL_GSM8K_DIR")
                  or Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k") / "test.jsonl"

BOS, EOS = "<|begin_of_text|>", "<|eot_id|>"
HEADER_START, HEADER_END = "<|start_header_id|>", "<|end_header_id|>"
# Llama-3's conversation format: the template writes the BOS itself.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}" + HEADER_START + "{{ m['role'] }}" + HEADER_END
    + "\n\n{{ m['content'] }}" + EOS + "{% endfor %}{% if add_generation_prompt %}" + HEADER_START
    + "assistant" + HEADER_END + "\n\n{% endif %}"
)


def corpus(limit: int = 400) -> list[str]:
    """Questions and answers of GSM8K's test set, or arithmetic word problems written here."""
    if GSM8K_TEST.is_file():
        rows = [json.loads(line) for line in GSM8K_TEST.read_text().splitlines()[:limit]]
        return [t for r in rows for t in (r["question"], r["answer"])]
    rng = random.Random(0)
    texts = []
    for _ in range(limit):
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        texts += [f"Sam has {a} apples and buys {b} more. How many apples does Sam have now?",
                  f"Sam has {a} + {b} = {a + b} apples.\n#### {a + b}"]
    return texts


def train_tokenizer(texts: list[str], vocab_size: int = 600, chat_template: bool = True):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, EOS, HEADER_START, HEADER_END],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    # The BOS goes before every text encoded with special tokens, as Llama-3's tokenizer does.
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                      special_tokens=[(BOS, tok.token_to_id(BOS))]),
    ])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS)
    if chat_template:
        fast.chat_template = CHAT_TEMPLATE
    return fast


def create_bpe_model(out_dir: Path, chat_template: bool = True, seed: int = 0) -> Path:
    """The tiny-llama preset's blocks over the trained tokenizer, saved as an HF model directory."""
    import torch
    from transformers import AutoModelForCausalLM

    from stages.rl.tiny_model import PRESETS, llama_config

    tokenizer = train_tokenizer(corpus(), chat_template=chat_template)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(llama_config(PRESETS["tiny-llama"], tokenizer))
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
