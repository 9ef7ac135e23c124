"""A stand-in for vLLM's offline API (LLM, SamplingParams), for tests only.

vLLM cannot run on the machines here: CI has no GPU, and its wheels are too large to reach the GPU
machines. This package implements the part of vLLM's API that syncrl's vllm backend calls
(stages/rl/vllm_sampler.py and the long-lived engine, stages/engine.py), sampling with the HF model
underneath, so that the backend's wiring (arguments, output order, end-of-sequence handling,
seeding, sleeping and reloading weights) runs for real around it. Each LLM records its constructor
arguments, every SamplingParams it received, every result it returned and its sleep, wake-up and
reload calls in CALLS.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

CALLS: list[dict] = []
__version__ = "0.0-standin"


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 16
    seed: int | None = None


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    finish_reason: str  # "stop" (end-of-sequence) or "length"


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)


# LLM(...)'s keyword arguments that syncrl may pass (vLLM 0.26 takes them all); any other is an error.
KNOWN_ARGS = {"model", "tokenizer", "dtype", "tensor_parallel_size", "gpu_memory_utilization", "seed",
              "enable_prefix_caching", "enforce_eager", "max_num_seqs", "enable_sleep_mode", "compilation_config"}


class LLM:
    def __init__(self, **kwargs):
        import logging

        unknown = set(kwargs) - KNOWN_ARGS
        if unknown:
            raise TypeError(f"LLM() got unexpected keyword arguments {sorted(unknown)}")
        if not 0 <= kwargs["seed"] < 2**32:  # as vLLM 0.26's worker, which seeds numpy with it
            raise ValueError("Seed must be between 0 and 2**32 - 1")
        self.calls = {**kwargs, "sampling": [], "results": [], "events": []}
        CALLS.append(self.calls)
        self._load(kwargs["model"])
        from transformers import AutoTokenizer

        self.eos = AutoTokenizer.from_pretrained(kwargs["tokenizer"]).eos_token_id
        self.asleep: set[str] = set()
        # The line vLLM logs once its weights are in, which the backend reads its start-up figure from.
        logging.getLogger("vllm.standin").info("Model loading took 0.01 GiB memory and 0.250000 seconds")

    def _load(self, path: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, self.calls["dtype"])).eval()

    def sleep(self, level: int = 1, mode: str = "abort"):
        if not self.calls.get("enable_sleep_mode"):
            raise RuntimeError("sleep mode is not enabled (LLM(enable_sleep_mode=True))")
        self.calls["events"].append(("sleep", level))
        self.asleep = {"weights", "kv_cache"}
        if level == 2:
            self.model = None  # level 2 discards the weights: only a reload brings them back

    def wake_up(self, tags: list[str] | None = None):
        self.calls["events"].append(("wake_up", tuple(tags or ())))
        self.asleep -= set(tags or ("weights", "kv_cache"))

    def collective_rpc(self, method: str, timeout=None, args: tuple = (), kwargs: dict | None = None):
        if method != "reload_weights":
            raise NotImplementedError(f"the stand-in has no worker method {method!r}")
        if "weights" in self.asleep:
            raise RuntimeError("reload_weights while the weights' memory is asleep")
        self.calls["events"].append(("reload_weights", (kwargs or {})["weights_path"]))
        self._load((kwargs or {})["weights_path"])
        return [None]

    def reset_prefix_cache(self) -> bool:
        self.calls["events"].append(("reset_prefix_cache",))
        return True

    def generate(self, prompts: list[dict], sampling_params: SamplingParams, use_tqdm: bool = True):
        import torch

        if self.asleep or self.model is None:
            raise RuntimeError(f"generate() while asleep ({sorted(self.asleep)} not woken up)")
        hang = os.environ.get("VLLM_STANDIN_HANG_ONCE")
        if hang and _claim(hang):  # fault injection for the tests: the one engine that removes the file hangs
            time.sleep(3600)
        if sampling_params.seed is not None and not -2**63 <= sampling_params.seed < 2**63:
            raise ValueError("a request's seed is kept as a 64-bit integer")  # vLLM 0.26's V2 model runner
        self.calls["sampling"].append(sampling_params)
        gen = torch.Generator().manual_seed(sampling_params.seed)
        results = []
        for prompt in prompts:
            ids = prompt["prompt_token_ids"]
            request = RequestOutput(ids)
            for i in range(sampling_params.n):
                tokens, reason = list(ids), "length"
                with torch.no_grad():
                    for _ in range(sampling_params.max_tokens):
                        logits = self.model(torch.tensor([tokens])).logits[0, -1].float()
                        token = int(torch.multinomial(torch.softmax(logits / sampling_params.temperature, -1), 1,
                                                      generator=gen))
                        tokens.append(token)
                        if token == self.eos:
                            reason = "stop"
                            break
                completion = tokens[len(ids):]
                # Engines differ in whether a stopped sequence's ids end with the end-of-sequence token:
                # leave it out every other time, so that the backend meets both.
                if reason == "stop" and i % 2 == 0:
                    completion = completion[:-1]
                request.outputs.append(CompletionOutput(i, completion, reason))
            request.outputs.reverse()  # the backend must not rely on the order of a request's samples
            results.append(request)
        self.calls["results"].append(results)
        exit_after = os.environ.get("VLLM_STANDIN_EXIT_AFTER_S")
        if exit_after:  # fault injection for the tests: the process dies a moment after answering
            threading.Timer(float(exit_after), os._exit, (3,)).start()
        return results


def _claim(path: str) -> bool:
    """Remove `path`; True for the one caller that did. Engines of several ranks may see it at once:
    checking that it exists, then removing it, let two of them through, and the second's removal
    failed its request instead of hanging (tests/test_engine.py then saw the other error)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True
