"""generate.backend: vllm: sampling through vLLM's offline engine, where vLLM is installed.

The engine loads the export the HF path would load (models/iter_{I-1}, or the base model) and
spreads it over generate.gpus_per_process GPUs by tensor parallelism. It returns token ids only:
the old log-probs still come from the policy's own forward pass (stages/rl/batches.py), the
pass train runs, so a difference between vLLM's kernels and train's cannot move the PPO ratio away
from 1. That pass needs the HF model beside the engine: generate.vllm_memory_fraction leaves it room.

The engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0 unless the user's environment
says otherwise): one process per rank to watch and to kill, and vLLM's own log records of its
start-up (weights, torch.compile, CUDA graphs) reach the handler below, which turns them into the
marker's start-up figures. Its compile cache lives under the run dir (RunPaths.vllm_cache), one per
generate rank, shared by the run's iterations (whether vLLM 0.26 then skips compiling is not
measured yet: docs/benchmarks.md).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from pathlib import Path

log = logging.getLogger("syncrl.generate")

# vLLM's own start-up log lines (vllm 0.26) -> the figure each gives, in seconds.
STARTUP_LINES = {
    "weights_s": re.compile(r"Model loading took \S+ GiB(?: memory)? and ([\d.]+) seconds"),
    "compile_s": re.compile(r"torch\.compile took ([\d.]+) s in total"),
    "graph_capture_s": re.compile(r"Graph capturing finished in ([\d.]+) secs"),
    "init_engine_s": re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s"),
}


class StartupFigures(logging.Handler):
    """Collects the start-up figures vLLM logs (STARTUP_LINES) while it is attached."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.figures: dict[str, float] = {}

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except Exception:  # a record that cannot format is no figure
            return
        for key, pattern in STARTUP_LINES.items():
            if m := pattern.search(message):
                self.figures[key] = float(m[1])


def vllm_args(model_path: Path, tokenizer_path: Path, dtype: str, g, seed: int, sleep_mode: bool) -> dict:
    """LLM(...)'s arguments for this run's generate settings."""
    args = dict(model=str(model_path), tokenizer=str(tokenizer_path), dtype=dtype,
                tensor_parallel_size=g.gpus_per_process, gpu_memory_utilization=g.vllm_memory_fraction,
                seed=seed % 2**32,  # the engine seeds numpy with it, which takes 32 bits (requests' seeds take 64)
                enable_prefix_caching=True, enforce_eager=g.vllm_enforce_eager)
    if g.batch_size:
        args["max_num_seqs"] = g.batch_size
    if sleep_mode:
        args["enable_sleep_mode"] = True
    return args


def compile_cache(cache_dir: Path, model_path: Path, args: dict) -> Path:
    """The torch.compile cache of this architecture and these settings under `cache_dir`.

    vLLM's own cache key counts the model's path, which is new in every iteration (models/iter_I);
    what it compiles depends only on the architecture (config.json) and the engine's settings, so
    this key leaves the path out and every iteration of a run looks in the same place.
    """
    import vllm

    settings = {k: v for k, v in args.items() if k not in ("model", "tokenizer", "seed")}
    architecture = json.loads((Path(model_path) / "config.json").read_text())
    for bookkeeping in ("_name_or_path", "transformers_version"):
        architecture.pop(bookkeeping, None)
    key = json.dumps([vllm.__version__, architecture, settings], sort_keys=True)
    return Path(cache_dir) / hashlib.sha256(key.encode()).hexdigest()[:16]


class VllmSampler:
    def __init__(self, model_path: Path, tokenizer_path: Path, dtype: str, g, seed: int,
                 cache_dir: Path | None = None, sleep_mode: bool = False):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        # FlashInfer's top-p/top-k kernels are compiled on first use where its wheel ships none
        # prebuilt (flashinfer-python alone): the engine's warm-up then waits minutes for nvcc. The
        # sampling here (a temperature, at most top-p) needs none of them.
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
        try:
            from vllm import LLM, SamplingParams
        except ImportError as e:
            raise RuntimeError(
                f"generate.backend is vllm, but vllm cannot be imported here ({e}): install it where generate "
                "runs (pip install vllm), or set generate.backend=hf") from e
        self._sampling_params = SamplingParams
        self.model_path = Path(model_path)
        args = vllm_args(model_path, tokenizer_path, dtype, g, seed, sleep_mode)
        if cache_dir is not None:
            args["compilation_config"] = {"cache_dir": str(compile_cache(cache_dir, model_path, args))}
        figures = StartupFigures()
        vllm_log = logging.getLogger("vllm")
        level = vllm_log.level
        vllm_log.addHandler(figures)
        if not level or level > logging.INFO:  # its start-up lines are INFO records
            vllm_log.setLevel(logging.INFO)
        t0 = time.time()
        try:
            self.llm = LLM(**args)
        finally:
            vllm_log.removeHandler(figures)
            vllm_log.setLevel(level)
        self.startup = {"engine_start_s": time.time() - t0, **figures.figures}
        log.info("vLLM engine on %d GPU(s) per process, %.0f%% of each GPU's memory, started in %.1fs (%s)",
                 g.gpus_per_process, 100 * g.vllm_memory_fraction, self.startup["engine_start_s"],
                 ", ".join(f"{k} {v:.1f}" for k, v in figures.figures.items()) or "vLLM logged no start-up figures")

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

    def figures(self) -> dict:
        """For the generate marker: the engine's start-up, as timed here and as vLLM logged it."""
        return dict(self.startup)

    # A long-lived engine (stages/engine.py) sleeps between iterations, so that train has the GPU
    # memory, and loads each iteration's weights in place.
    def sleep(self) -> float:
        """Free the engine's GPU memory (weights and KV cache: the next weights replace them)."""
        t0 = time.time()
        self.llm.sleep(level=2)
        return time.time() - t0

    def load(self, model_path: Path) -> float:
        """Load `model_path`'s weights in place while awake; seconds taken."""
        t0 = time.time()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(model_path)})
        self.llm.reset_prefix_cache()  # its entries were computed with the previous weights
        self.model_path = Path(model_path)
        return time.time() - t0

    def wake_up(self, model_path: Path) -> dict:
        """Reallocate, load `model_path`'s weights in place, then the KV cache; seconds of each."""
        t0 = time.time()
        self.llm.wake_up(tags=["weights"])
        t1 = time.time()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(model_path)})
        self.model_path = Path(model_path)
        t2 = time.time()
        # Sleeping cleared the prefix cache, whose entries the previous weights computed.
        self.llm.wake_up(tags=["kv_cache"])
        return {"wake_weights_s": t1 - t0, "reload_s": t2 - t1, "wake_cache_s": time.time() - t2}
