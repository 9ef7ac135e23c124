"""Loading the policy and tokenizer, and the token log-probabilities both generate and train use."""

from __future__ import annotations

import contextlib
import importlib.util
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


def load_policy(path: Path, dtype: str, device: torch.device | None = None, spread: bool = False,
                fused_norms: bool = False, fused_layers: bool = False):
    """The HF model at `path`: on the host (device None), on `device`, or with `spread` on GPU, its
    layers split over every GPU this process sees (transformers' device_map="auto"); with
    fused_norms its RMSNorms run torch's fused kernel (fuse_rms_norms), with fused_layers its
    attention and MLP Triton's (stages/rl/fused_layers.py)."""
    from transformers import AutoModelForCausalLM

    if not (Path(path) / "config.json").is_file():
        raise FileNotFoundError(f"model directory {path} has no config.json (not an HF model)")
    on_gpu = device is not None and device.type == "cuda"
    kwargs = {}
    if on_gpu and spread:
        if not has_accelerate():
            raise RuntimeError("generate.gpus_per_process > 1 splits the model with transformers' device_map, "
                               "which needs the accelerate package: pip install accelerate")
        kwargs["device_map"] = "auto"
    elif on_gpu and has_accelerate():
        # The weights go from the safetensors files straight to device memory, not through a CPU copy.
        kwargs["device_map"] = {"": str(device)}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype], **kwargs)
    if device is not None and "device_map" not in kwargs:
        model.to(device)
    return _with_kernels(model, fused_norms, fused_layers)


def build_policy(path: Path, dtype: str, device: torch.device | None = None, fused_norms: bool = False,
                 fused_layers: bool = False):
    """The architecture of the HF model at `path` with its weights left unset, for a train whose
    checkpoint sets every one of them: reading them from `path` first would read the same values
    twice (at 70B, 140 GB from the shared filesystem). On `device`, or on the host (device None:
    ZeRO-3 partitions it as it is built); the kernels as load_policy's."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers 4
        from transformers.modeling_utils import no_init_weights

    config = AutoConfig.from_pretrained(path)
    with no_init_weights(), (torch.device(device) if device is not None else contextlib.nullcontext()):
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype])
    model.tie_weights()  # as from_pretrained ties them (the skipped initialisation skips the tying too)
    return _with_kernels(model, fused_norms, fused_layers)


def _with_kernels(model, fused_norms: bool, fused_layers: bool):
    if fused_norms:
        fuse_rms_norms(model)
    if fused_layers:
        from stages.rl.fused_layers import fuse_layers

        fuse_layers(model)
    return model


# RMSNorm classes whose forward is weight * x / rms(x), the formula torch.nn.functional.rms_norm
# computes (Gemma's, weight + 1, is not). HF's forward is seven kernels and an fp32 copy of its
# input, forward and again backward; on CUDA F.rms_norm is one fused kernel each way.
FUSABLE_RMS_NORMS = {"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"}


def fuse_rms_norms(model) -> int:
    """Route the forward of every RMSNorm of FUSABLE_RMS_NORMS in `model` through F.rms_norm (in
    fp32 inside, as HF's is; the output is rounded once where HF rounds twice). Returns how many."""
    import types

    n = 0
    for module in model.modules():
        if type(module).__name__ in FUSABLE_RMS_NORMS and hasattr(module, "variance_epsilon"):
            module.forward = types.MethodType(_fused_rms_norm_forward, module)
            n += 1
    return n


def _fused_rms_norm_forward(self, hidden_states):
    if hidden_states.dtype != self.weight.dtype:  # HF's mixed-precision case: keep its arithmetic
        return type(self).forward(self, hidden_states)
    return torch.nn.functional.rms_norm(hidden_states, self.weight.shape, self.weight, self.variance_epsilon)


def compile_layers(model, backend: str) -> int:
    """torch.compile each of `model`'s repeated blocks (the classes its _no_split_modules names: an HF
    model's decoder layers) in place; returns how many.

    One block's graph serves every layer (its weights are the graph's inputs), and its sequence
    length and row offsets are symbolic (dynamic=True): a fresh train process traces one layer once,
    where compiling the whole model traced all of them, and the packed micro-batches' lengths, new
    every time, do not recompile.
    The module tree and the parameters stay as they are: DeepSpeed's gradient hooks and the
    checkpoint's names do not see the compile."""
    blocks = repeated_blocks(model, "train.compile", "eager")
    for block in blocks:
        block.compile(backend=backend, dynamic=True)
    return len(blocks)


def repeated_blocks(model, key: str, off: str) -> list:
    """`model`'s repeated blocks (the classes its _no_split_modules names: an HF model's decoder
    layers) in the order its forward runs them; none is an error naming the setting `key` that needs
    them and its value `off`."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        raise ValueError(f"{type(model).__name__} names no repeated block (_no_split_modules is {sorted(names)}): "
                         f"{key} needs one; set {key}={off}")
    return blocks


def preload_model_code(ctx):
    """Import transformers and the policy's architecture module (seconds of a stage's start-up) ahead
    of time; the base model's config names the architecture every later export shares. Returns that
    config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(ctx.base_model_path())
    AutoModelForCausalLM._model_mapping[type(config)]  # the lookup imports the module
    return config


def has_accelerate() -> bool:
    # transformers needs it for any device_map; without it a model loads on the host and is moved.
    return importlib.util.find_spec("accelerate") is not None


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(token) under softmax(logits / temperature); logits [B, T, V], tokens [B, T] -> [B, T] float32.

    Computed in float32: bf16 log-softmax over a large vocabulary loses the precision that the
    PPO ratio exp(new - old) depends on. The float32 work is done a few rows at a time and only the
    log-normaliser is kept for backward: a full float32 log-softmax of [B, T, V] (8 GB at 4 x 2048
    tokens and a 128k vocabulary) would be held until the backward pass otherwise.
    """
    if logits.requires_grad:
        return _TokenLogprobs.apply(logits, tokens, float(temperature))
    return _chunked_logprobs(logits, tokens, float(temperature))[0]


# float32 elements per chunk of rows (256 MB): large enough to keep the GPU busy, small next to the logits.
_CHUNK_ELEMENTS = 1 << 26


def _row_chunks(logits: torch.Tensor):
    per_row = max(1, logits[0].numel())
    step = max(1, _CHUNK_ELEMENTS // per_row)
    return range(0, logits.shape[0], step), step


def _chunked_logprobs(logits, tokens, temperature):
    out = torch.empty(tokens.shape, dtype=torch.float32, device=logits.device)
    lse = torch.empty(tokens.shape, dtype=torch.float32, device=logits.device)
    starts, step = _row_chunks(logits)
    for i in starts:
        x = logits[i:i + step].float()
        if temperature != 1.0:
            x = x / temperature
        norm = torch.logsumexp(x, dim=-1)
        out[i:i + step] = x.gather(-1, tokens[i:i + step].unsqueeze(-1)).squeeze(-1) - norm
        lse[i:i + step] = norm
    return out, lse


class _TokenLogprobs(torch.autograd.Function):
    """d logp / d logits = (onehot(token) - softmax(logits / T)) / T, recomputed chunk by chunk."""

    @staticmethod
    def forward(ctx, logits, tokens, temperature):
        out, lse = _chunked_logprobs(logits, tokens, temperature)
        ctx.save_for_backward(logits, tokens, lse)
        ctx.temperature = temperature
        return out

    @staticmethod
    def backward(ctx, grad_out):
        logits, tokens, lse = ctx.saved_tensors
        t = ctx.temperature
        grad = torch.empty_like(logits)
        starts, step = _row_chunks(logits)
        for i in starts:
            g = grad_out[i:i + step].float().unsqueeze(-1)
            p = torch.exp(logits[i:i + step].float() / t - lse[i:i + step].unsqueeze(-1))
            chunk = (-p * g).scatter_add_(-1, tokens[i:i + step].unsqueeze(-1), g)
            grad[i:i + step] = chunk / t if t != 1.0 else chunk
        return grad, None, None
