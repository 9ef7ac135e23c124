"""Each prompt's token ids as the policy sees them, made once in generate: the rows it writes carry
them, and train scores exactly those ids, so no later stage tokenizes a prompt again.

With data.chat_template, the prompt is the tokenizer's own chat template around the prompt text (an
optional system turn, the text as the user turn, then the opening of the assistant's turn); the
template writes its special tokens itself. Without it, the prompt is the text after the special
tokens the tokenizer puts before any text (a Llama tokenizer's BOS), as the model saw in pretraining.
"""

from __future__ import annotations

from stages.runtime.config import ConfigError, DataConfig
from stages.runtime.data import CHAT_TEMPLATE_FIX


def encode(tokenizer, items: list[dict], data: DataConfig, tokenizer_path) -> None:
    """Give each item its "prompt_ids", and its "prompt" as rendered (the chat template's text where
    it applies); `tokenizer_path` names the tokenizer in an error."""
    if data.chat_template:
        check_chat_template(tokenizer, tokenizer_path)
        texts = [render_chat(tokenizer, it["prompt"], data.system_prompt) for it in items]
        prefix = []  # the template writes the BOS where the model wants one: adding it again doubles it
    else:
        texts = [it["prompt"] for it in items]
        prefix = leading_special_ids(tokenizer)
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    for it, text, one in zip(items, texts, ids, strict=True):
        it["prompt"], it["prompt_ids"] = text, prefix + list(one)


def render_chat(tokenizer, text: str, system_prompt: str = "") -> str:
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": text})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def check_chat_template(tokenizer, tokenizer_path) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"data.chat_template is true but the tokenizer in {tokenizer_path} has no chat template: "
                          f"{CHAT_TEMPLATE_FIX}")


def leading_special_ids(tokenizer) -> list[int]:
    """The special tokens the tokenizer puts before a text (Llama's BOS; none for most others), never
    those it appends after one: an end-of-sequence token there would end the prompt before sampling."""
    plain = tokenizer("1", add_special_tokens=False)["input_ids"]
    full = tokenizer("1", add_special_tokens=True)["input_ids"]
    for k in range(len(full) - len(plain) + 1):
        if full[k:k + len(plain)] == plain:
            return list(full[:k])
    return []
