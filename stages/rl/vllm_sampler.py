"""generate.backend: vllm: sampling through vLLM's offline engine, where vLLM is installed.

The engine loads the export the HF path would load (models/iter_{I-1}, or the base model) and
spreads it over generate.gpus_per_process GPUs by tensor parallelism. It returns token ids only:
the old log-probs still come from the policy's own forward pass (stages/rl/batches.py), the
pass train runs, so a difference between vLLM's kernels and train's cannot move the PPO ratio away
from 1. That pass needs the HF model beside the engine: generate.vllm_memory_fraction leaves it room.

The engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0 unless the user's environment
says otherwise): one process per rank to watch and to kill, and vLLM's own log records of its
start-up (weights, torch.compile, CUDA graphs) reach the handler below, which turns them into the
marker's start-up figures. Its caches (VLLM_CACHE_ROOT) live under the run dir, one folder per
generate rank (RunPaths.vllm_cache). vLLM keys its torch.compile artifacts on the model's path among
other things, and every iteration's export has a path of its own: the engine is given a link in that
folder instead, the same path in every iteration, pointing at this iteration's export, so that the
artifacts of the run's first engine serve the later ones (not yet measured: docs/benchmarks.md).
"""

from __future__ import annotations

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


def vllm_args(model_path: Path, tokenizer_path: Path, dtype: str, g, seed: int, sleep_mode: bool,
              enforce_eager: bool = False) -> dict:
    """LLM(...)'s arguments for this run's generate settings (enforce_eager: tuning.vllm_enforce_eager)."""
    args = dict(model=str(model_path), tokenizer=str(tokenizer_path), dtype=dtype,
                tensor_parallel_size=g.gpus_per_process, gpu_memory_utilization=g.vllm_memory_fraction,
                seed=seed % 2**32,  # the engine seeds numpy with it, which takes 32 bits (requests' seeds take 64)
                enable_prefix_caching=True, enforce_eager=enforce_eager)
    if g.batch_size:
        args["max_num_seqs"] = g.batch_size
    if sleep_mode:
        args["enable_sleep_mode"] = True
    return args


def stable_link(link: Path, target: Path) -> Path:
    """`link`, made to point at `target` (replaced in one rename: a reader never finds it missing)."""
    link.parent.mkdir(parents=True, exist_ok=True)
    tmp = link.with_name(f".{link.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    os.symlink(Path(target).resolve(), tmp)
    os.replace(tmp, link)
    return link


class VllmSampler:
    def __init__(self, model_path: Path, tokenizer_path: Path, dtype: str, g, seed: int,
                 cache_dir: Path | None = None, sleep_mode: bool = False, enforce_eager: bool = False):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        # FlashInfer's top-p/top-k kernels are compiled on first use where its wheel ships none
        # prebuilt (flashinfer-python alone): the engine's warm-up then waits minutes for nvcc. The
        # sampling here (a temperature, at most top-p) needs none of them.
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
        if cache_dir is not None:  # before vLLM reads it
            os.environ.setdefault("VLLM_CACHE_ROOT", str(cache_dir))
        try:
            from vllm import LLM, SamplingParams
        except ImportError as e:
            raise RuntimeError(
                f"generate.backend is vllm, but vllm cannot be imported here ({e}): install it where generate "
                "runs (pip install vllm), or set generate.backend=hf") from e
        self._sampling_params = SamplingParams
        self.model_path = Path(model_path)  # the weights it holds (or held, asleep)
        self.asleep = False
        engine_model = stable_link(Path(cache_dir) / "policy", model_path) if cache_dir is not None else model_path
        args = vllm_args(engine_model, tokenizer_path, dtype, g, seed, sleep_mode, enforce_eager)
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
        self.asleep = True
        return time.time() - t0

    def load(self, model_path: Path) -> float:
        """Load `model_path`'s weights in place while awake; seconds taken."""
        t0 = time.time()
        self._reload(model_path)
        self.llm.reset_prefix_cache()  # its entries were computed with the previous weights
        return time.time() - t0

    def wake_up(self, model_path: Path) -> dict:
        """Reallocate, load `model_path`'s weights in place, then the KV cache; seconds of each."""
        t0 = time.time()
        self.llm.wake_up(tags=["weights"])
        t1 = time.time()
        self._reload(model_path)
        t2 = time.time()
        # Sleeping cleared the prefix cache, whose entries the previous weights computed.
        self.llm.wake_up(tags=["kv_cache"])
        self.asleep = False
        return {"wake_weights_s": t1 - t0, "reload_s": t2 - t1, "wake_cache_s": time.time() - t2}

    def _reload(self, model_path: Path) -> None:
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(model_path)})
        self.model_path = Path(model_path)
