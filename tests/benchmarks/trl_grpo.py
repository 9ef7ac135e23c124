"""Benchmark: TRL's GRPOTrainer on syncrl's GPU workload, so syncrl's iteration time can be given as a ratio.

The workload is read from the same config as syncrl's own GPU benchmark (configs/gpu_small.yaml, see
tests/benchmarks/gpu_pipeline.py): the built-in small-llama preset (bf16), the synthetic arithmetic
prompts of each iteration in syncrl's order, `generate.attempts` samples per prompt with the same
sampling settings and static KV cache, syncrl's own reward (stages.score.reward_fields), PPO-clip with
no KL term and a token-mean loss, constant lr and AdamW betas from the DeepSpeed JSON, ZeRO-2 through
the HF Trainer. One iteration = prompts x attempts completions = that many / (micro-batch x ranks)
optimizer steps; TRL generates once per iteration (steps_per_generation) and generates each rank's
share in one HF generate call, as syncrl's generate stage does with batch_size 512.

Prints the wall time of each iteration (from the end of one iteration's last optimizer step to the
end of the next one's: generation, reward, TRL's old-log-prob pass and the updates), the start-up
(process start to the first step: imports, model load, DeepSpeed init) and, last, one line
`TRL_RESULT {json}` (also written to OUT/trl_result.json).

    # 2 GPUs (one rank each), the gpu_small workload:
    python -m torch.distributed.run --nproc-per-node 2 tests/benchmarks/trl_grpo.py --iterations 3 --out DIR
    # CPU smoke test (gloo, 2 processes):
    python -m torch.distributed.run --nproc-per-node 2 tests/benchmarks/trl_grpo.py --cpu --no-deepspeed \\
        --preset tiny-llama --prompts 8 --new-tokens 8 --micro-batch 4 --iterations 2 --out DIR
    # any other config key, as for `syncrl run`: ... trl_grpo.py --out DIR train.lr=1e-6 generate.cache=dynamic
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from importlib import metadata
from pathlib import Path

import psutil
from transformers import TrainerCallback

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from stages.runtime.config import ConfigError, load_config  # noqa: E402 (needs ROOT on the path)
from stages.runtime.data import iteration_prompts, load_problems  # noqa: E402
from stages.score import reward_fields  # noqa: E402

# Measured from the process's creation, not from this line, so interpreter start-up and imports count
# as they do in the start-up of syncrl's stage processes.
PROCESS_START = psutil.Process().create_time()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--config", default=str(ROOT / "configs" / "gpu_small.yaml"))
    parser.add_argument("--out", default=str(ROOT / "runs" / "trl_grpo"),
                        help="base model, TRL output and trl_result.json (the same path on every rank)")
    parser.add_argument("--preset", help="model.preset (default: the config's)")
    parser.add_argument("--prompts", type=int, help="data.prompts_per_iteration")
    parser.add_argument("--new-tokens", type=int, help="generate.max_new_tokens")
    parser.add_argument("--micro-batch", type=int, help="train.micro_batch_size (per rank)")
    parser.add_argument("--no-deepspeed", action="store_true", help="plain DDP instead of ZeRO-2")
    parser.add_argument("--cpu", action="store_true", help="run on CPU over gloo (implied without CUDA)")
    parser.add_argument("--save", action="store_true",
                        help="save a checkpoint every iteration (syncrl's iterations include checkpoint and export)")
    parser.add_argument("overrides", nargs="*", help="config key=value, as for syncrl run")
    args = parser.parse_args()

    shortcuts = {"model.preset": args.preset, "data.prompts_per_iteration": args.prompts,
                 "generate.max_new_tokens": args.new_tokens, "train.micro_batch_size": args.micro_batch}
    overrides = [f"{k}={v}" for k, v in shortcuts.items() if v is not None] + args.overrides
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as e:
        parser.error(str(e))
    result = run(cfg, args)
    if result is not None:
        print("TRL_RESULT " + json.dumps(result), flush=True)
    return 0


def run(cfg, args) -> dict | None:
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    cpu = args.cpu or not torch.cuda.is_available()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    out = Path(args.out).resolve()
    steps = steps_per_iteration(cfg, world)  # optimizer steps per pass, as syncrl's train stage counts them
    iteration_steps = steps * cfg.train.epochs
    bf16 = cfg.model.dtype == "bfloat16" and not cpu
    use_ds = not args.no_deepspeed
    ds_config, betas, eps = deepspeed_dict(cfg.train.deepspeed_config)
    trl_cache = None if cfg.generate.cache == "dynamic" else "static"
    if cfg.gather.advantage != "grpo":
        raise SystemExit(f"gather.advantage={cfg.gather.advantage}: TRL's GRPOTrainer has only GRPO advantages")

    grpo_args = GRPOConfig(
        output_dir=str(out / "trl"),
        seed=cfg.seed,
        use_cpu=cpu,
        ddp_backend="gloo" if cpu else None,
        ddp_find_unused_parameters=False,  # every parameter gets a gradient; the search costs a graph walk per step
        deepspeed=ds_config if use_ds else None,
        bf16=bf16,
        # Under ZeRO-2 the weights are loaded in bf16 and DeepSpeed keeps fp32 master copies, as syncrl's
        # train stage does; plain DDP keeps fp32 weights and autocasts instead.
        model_init_kwargs={"dtype": cfg.model.dtype if (use_ds and bf16) else "float32"},
        gradient_checkpointing=cfg.model.gradient_checkpointing,  # TRL's default is on; gpu_small has it off
        # Batching: each optimizer step takes micro_batch x grad accumulation completions per rank; one
        # generation round serves a whole iteration (TRL counts steps_per_generation in micro-batches),
        # each rank samples its share in one generate call, and train.epochs passes go over it.
        per_device_train_batch_size=cfg.train.micro_batch_size,
        gradient_accumulation_steps=cfg.train.gradient_accumulation_steps,
        steps_per_generation=steps * cfg.train.gradient_accumulation_steps,
        num_generations=cfg.generate.attempts,
        num_iterations=cfg.train.epochs,
        max_steps=iteration_steps * args.iterations,
        # syncrl's prompts come in its own per-iteration order (the dataset is built in that order).
        shuffle_dataset=False,
        # Sampling as in stages/generate.py (top_k 0 = off); TRL's HF path with its static cache
        # stands in for syncrl's compact one, which TRL does not have.
        max_completion_length=cfg.generate.max_new_tokens,
        temperature=cfg.generate.temperature,
        top_p=cfg.generate.top_p,
        top_k=0,
        cache_implementation=trl_cache,
        # The update: PPO-clip, no reference model, group-normalised advantages, and the mean over a
        # micro-batch's completion tokens (syncrl's ppo_clip_loss is a token mean per micro-batch).
        beta=cfg.train.kl_coef,
        epsilon=cfg.train.clip_eps,
        scale_rewards="group" if cfg.gather.normalize_std else "none",
        loss_type="bnpo",
        learning_rate=cfg.train.lr,
        lr_scheduler_type="constant",  # HF's default is linear decay; syncrl has no schedule
        warmup_steps=0,
        weight_decay=cfg.train.weight_decay,
        adam_beta1=betas[0],
        adam_beta2=betas[1],
        adam_epsilon=eps,
        max_grad_norm=cfg.train.max_grad_norm,
        # One log line per iteration (it gathers metrics across ranks), nothing else on the side.
        logging_steps=iteration_steps,
        disable_tqdm=True,
        report_to="none",
        save_strategy="steps" if args.save else "no",
        save_steps=iteration_steps,
        save_total_limit=1,
    )

    model_dir = out / f"base_{cfg.model.preset}_seed{cfg.seed}"
    with grpo_args.main_process_first(desc="base model"):
        if not model_dir.is_dir():
            from stages.rl.tiny_model import create_base_model
            create_base_model(model_dir, cfg.model.preset, cfg.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")

    problems = load_problems(cfg.data, cfg.seed)
    rows = [{"prompt": item["prompt"], "answer": item["answer"]}
            for it in range(args.iterations) for item in iteration_prompts(cfg.data, problems, cfg.seed, it)]
    timer = IterationTimer(iteration_steps, sync=None if cpu else torch.cuda.synchronize, until_saved=args.save)
    trainer = GRPOTrainer(
        model=str(model_dir),
        reward_funcs=syncrl_reward(cfg.score, tokenizer.eos_token_id),
        args=grpo_args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        callbacks=[timer],
    )
    if trainer.is_world_process_zero():
        print(f"TRL GRPO on {world} rank(s) ({'cpu' if cpu else torch.cuda.get_device_name()}), "
              f"{'ZeRO-2 ' + ('bf16' if bf16 else 'fp32') if use_ds else 'DDP'}: {cfg.model.preset}, "
              f"{cfg.data.prompts_per_iteration} prompts x {cfg.generate.attempts} = "
              f"{cfg.data.prompts_per_iteration * cfg.generate.attempts} completions per iteration, "
              f"{iteration_steps} optimizer steps of {cfg.train.micro_batch_size} x "
              f"{cfg.train.gradient_accumulation_steps} per rank, "
              f"{cfg.generate.max_new_tokens} new tokens max, cache {trl_cache or 'dynamic'} "
              f"(syncrl: {cfg.generate.cache})", flush=True)
    trainer.train()

    if not trainer.is_world_process_zero():
        return None
    times = timer.iteration_s
    result = {
        "iterations_s": times,
        "mean_after_first_s": statistics.fmean(times[1:]) if len(times) > 1 else None,
        "startup_s": timer.first_step_t - PROCESS_START,
        "total_s": time.time() - PROCESS_START,
        "per_iteration": timer.logs,
        "world_size": world,
        "device": "cpu" if cpu else torch.cuda.get_device_name(),
        "deepspeed": use_ds,
        "bf16": bf16,
        "preset": cfg.model.preset,
        "prompts_per_iteration": cfg.data.prompts_per_iteration,
        "completions_per_iteration": cfg.data.prompts_per_iteration * cfg.generate.attempts,
        "steps_per_iteration": iteration_steps,
        "max_new_tokens": cfg.generate.max_new_tokens,
        "cache": trl_cache or "dynamic",
        "syncrl_cache": cfg.generate.cache,
        "save": args.save,
        "versions": {name: package_version(name)
                     for name in ("trl", "transformers", "torch", "deepspeed", "accelerate", "datasets")},
    }
    if not cpu:
        result["peak_gib_rank0"] = {"allocated": torch.cuda.max_memory_allocated() / 2**30,
                                    "reserved": torch.cuda.max_memory_reserved() / 2**30}
    print(f"startup {result['startup_s']:.1f}s; iterations " + ", ".join(f"{t:.1f}s" for t in times)
          + (f"; mean after the first {result['mean_after_first_s']:.1f}s" if len(times) > 1 else ""), flush=True)
    (out / "trl_result.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


# --- the pieces ------------------------------------------------------------------------------------


def steps_per_iteration(cfg, world: int) -> int:
    completions = cfg.data.prompts_per_iteration * cfg.generate.attempts
    per_step = cfg.train.micro_batch_size * cfg.train.gradient_accumulation_steps * world
    if completions % per_step:
        raise SystemExit(f"{completions} completions per iteration (data.prompts_per_iteration x generate.attempts) "
                         f"do not split into optimizer steps of {per_step} (micro-batch x grad accumulation x "
                         f"{world} ranks): change --prompts or --micro-batch")
    return completions // per_step


def deepspeed_dict(path: str) -> tuple[dict, tuple[float, float], float]:
    """syncrl's DeepSpeed JSON as the HF Trainer takes it, and the AdamW betas and eps it holds.

    syncrl's train stage fills the batch keys, clipping, lr and weight decay from the run config; the
    HF Trainer fills them from its own arguments, but only where the value is "auto" (any other value
    that disagrees with its arguments is refused). The betas stay in the JSON and are returned so the
    Trainer's arguments agree with them (and the plain-DDP path uses the same).
    """
    ds = json.loads((ROOT / path).read_text())  # ROOT / an absolute path is that path
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size",
                "gradient_clipping"):
        ds[key] = "auto"
    ds.setdefault("bf16", {})["enabled"] = "auto"
    params = ds.get("optimizer", {}).get("params", {})
    if "optimizer" in ds:
        params.update(lr="auto", weight_decay="auto")
    betas = tuple(params.get("betas", (0.9, 0.999)))
    return ds, betas, params.get("eps", 1e-8)


def syncrl_reward(score_cfg, eos_id: int):
    """syncrl's score stage as a TRL reward function: one float per completion."""
    def syncrl_reward(completions, completion_ids, answer, **_):
        # TRL's completion_ids keep the end-of-sequence token, so its absence means truncation,
        # exactly as in stages/generate.py.
        return [reward_fields(text, ref, eos_id not in ids, score_cfg)["reward"]
                for text, ids, ref in zip(completions, completion_ids, answer, strict=True)]
    return syncrl_reward


def package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


class IterationTimer(TrainerCallback):
    """Wall time per iteration (every `steps` optimizer steps) and TRL's per-iteration log figures.

    An iteration ends at the end of its last optimizer step (or, with checkpoints on, once that
    step's checkpoint is written); the next generation round starts right after, so consecutive ends
    bracket exactly one round of generate, reward, `steps` updates (and checkpoint).
    """

    KEYS = ("reward", "reward_std", "completions/mean_length", "completions/clipped_ratio", "loss")

    def __init__(self, steps: int, sync=None, until_saved: bool = False):
        self.steps, self.sync, self.until_saved = steps, sync, until_saved
        self.first_step_t = None
        self.last_t = None
        self.iteration_s: list[float] = []
        self.logs: list[dict] = []

    def on_step_begin(self, args, state, control, **kwargs):
        if self.first_step_t is None:
            self.first_step_t = self.last_t = time.time()

    def on_step_end(self, args, state, control, **kwargs):
        if not self.until_saved:
            self._iteration_end(state)

    def on_save(self, args, state, control, **kwargs):
        if self.until_saved:
            self._iteration_end(state)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "reward" in logs:
            self.logs.append({"step": state.global_step, **{k: logs[k] for k in self.KEYS if k in logs}})

    def _iteration_end(self, state):
        if state.global_step % self.steps:
            return
        if self.sync is not None:
            self.sync()  # the updates are queued on the GPU; count them in this iteration
        now = time.time()
        self.iteration_s.append(now - self.last_t)
        self.last_t = now
        if state.is_world_process_zero:
            print(f"iteration {len(self.iteration_s) - 1}: {self.iteration_s[-1]:.2f}s "
                  f"(steps {state.global_step - self.steps + 1}-{state.global_step})", flush=True)


if __name__ == "__main__":
    sys.exit(main())
