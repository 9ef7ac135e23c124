"""generate.backend: vllm: sampling through vLLM's offline engine, where vLLM is installed.

The engine loads the export the HF path would load (models/iter_{I-1}, or the base model) and
spreads it over generate.gpus_per_process GPUs by tensor parallelism. It returns token ids only:
the old log-probs still come from the policy's own forward pass (stages/rl/batches.py), the
pass train runs, so a difference between vLLM's kernels and train's cannot move the PPO ratio away
from 1. That pass needs the HF model beside the engine: generate.vllm_memory_fraction leaves it room.
"""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger("syncrl.generate")


class VllmSampler:
    def __init__(self, model_path: Path, tokenizer_path: Path, dtype: str, gpus: int, memory_fraction: float,
                 seed: int):
        try:
            from vllm import LLM, SamplingParams
        except ImportError as e:
            raise RuntimeError(
                f"generate.backend is vllm, but vllm cannot be imported here ({e}): install it where generate "
                "runs (pip install vllm), or set generate.backend=hf") from e
        self._sampling_params = SamplingParams
        self.llm = LLM(model=str(model_path), tokenizer=str(tokenizer_path), dtype=dtype, tensor_parallel_size=gpus,
                       gpu_memory_utilization=memory_fraction, seed=seed, enable_prefix_caching=True)
        log.info("vLLM engine on %d GPU(s) per process, %.0f%% of each GPU's memory", gpus, 100 * memory_fraction)

    def sample(self, prompt_ids: list[list[int]], g, eos_token_id: int, seed: int) -> list[list[int]]:
        """Completion ids per sequence, in prompt order, `g.attempts` consecutive sequences per prompt."""
        params = self._sampling_params(n=g.attempts, temperature=g.temperature, top_p=g.top_p,
                                       max_tokens=g.max_new_tokens, seed=seed)
        requests = self.llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
        if len(requests) != len(prompt_ids):
            raise RuntimeError(f"vLLM returned {len(requests)} results for {len(prompt_ids)} prompts")
        completions = []
        for request in requests:
            if len(request.outputs) != g.attempts:
                raise RuntimeError(f"vLLM returned {len(request.outputs)} samples for a prompt, not {g.attempts}")
            for out in sorted(request.outputs, key=lambda o: o.index):
                ids = list(out.token_ids)
                # A sequence that stopped at end-of-sequence ends with that token, whether or not the
                # engine lists it: the policy must learn to stop, so train scores it.
                if out.finish_reason == "stop" and eos_token_id not in ids:
                    ids.append(eos_token_id)
                completions.append(ids)
        return completions
