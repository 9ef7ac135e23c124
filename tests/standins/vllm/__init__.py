"""A stand-in for vLLM's offline API (LLM, SamplingParams), for tests only.

vLLM cannot run on the machines here: CI has no GPU, and its wheels are too large to reach the GPU
machines. This package implements the part of vLLM's documented API that syncrl's vllm backend
calls (stages/rl/vllm_sampler.py), sampling with the HF model underneath, so that the backend's
wiring (arguments, output order, end-of-sequence handling, seeding) runs for real around it. Each
LLM records its constructor arguments, every SamplingParams it received and every result it
returned in CALLS.
"""

from __future__ import annotations

from dataclasses import dataclass, field

CALLS: list[dict] = []


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


class LLM:
    def __init__(self, model: str, tokenizer: str, dtype: str, tensor_parallel_size: int,
                 gpu_memory_utilization: float, seed: int, enable_prefix_caching: bool):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.calls = {"model": model, "tokenizer": tokenizer, "dtype": dtype,
                      "tensor_parallel_size": tensor_parallel_size, "gpu_memory_utilization": gpu_memory_utilization,
                      "seed": seed, "enable_prefix_caching": enable_prefix_caching, "sampling": [], "results": []}
        CALLS.append(self.calls)
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()
        self.eos = AutoTokenizer.from_pretrained(tokenizer).eos_token_id

    def generate(self, prompts: list[dict], sampling_params: SamplingParams, use_tqdm: bool = True):
        import torch

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
        return results
