"""Loading the policy and tokenizer, and the token log-probabilities both generate and train use."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def device_for(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def set_cpu_threads() -> None:
    # Several ranks share a CPU-only host: without this each rank spawns a thread per core and they
    # thrash. Launchers set OMP_NUM_THREADS; respect it.
    if not torch.cuda.is_available() and os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    if not Path(path).is_dir():
        raise FileNotFoundError(f"tokenizer directory {path} not found")
    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token  # common for Llama-family tokenizers, which ship no pad token
    return tok


def load_policy(path: Path, dtype: str, device: torch.device | None = None):
    from transformers import AutoModelForCausalLM

    if not (Path(path) / "config.json").is_file():
        raise FileNotFoundError(f"model directory {path} has no config.json (not an HF model)")
    # On GPU the weights go from the safetensors files straight to device memory, not through a CPU copy.
    on_gpu = device is not None and device.type == "cuda"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype],
                                                 **({"device_map": {"": str(device)}} if on_gpu else {}))
    if device is not None and not on_gpu:
        model.to(device)
    return model


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(token) under softmax(logits / temperature); logits [B, T, V], tokens [B, T] -> [B, T].

    Computed in float32: bf16 log-softmax over a large vocabulary loses the precision that the
    PPO ratio exp(new - old) depends on.
    """
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
