"""Run configuration: nested dataclasses loaded from YAML plus `key.sub=value` overrides.

Strict on purpose: a typo in a week-long run's config must fail at launch, not silently fall back
to a default. Torch-free, so `syncrl status` and the CPU stages start fast.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from stages.runtime.presets import PRESETS as PRESET_SHAPES

# The built-in base models (model.preset; stages/runtime/presets.py has their dimensions).
PRESETS = tuple(PRESET_SHAPES)
ANSWER_FORMATS = ("gsm8k", "boxed", "plain", "custom")


class ConfigError(ValueError):
    """A config problem, reported as one line naming the key or file and the fix."""


@dataclass
class ModelConfig:
    # An HF model directory. Empty means the built-in tiny preset, created under the run dir by
    # syncrl itself (no model hub is needed).
    path: str = ""
    tokenizer: str = ""  # defaults to `path`
    preset: str = "tiny-llama"
    dtype: str = "float32"  # float32 | bfloat16 | float16
    gradient_checkpointing: bool = False

    def __post_init__(self):
        _choice("model.dtype", self.dtype, ("float32", "bfloat16", "float16"))
        _choice("model.preset", self.preset, PRESETS)


@dataclass
class DataConfig:
    # "synthetic" (built-in arithmetic task), a local JSONL path (one problem per line), or a `datasets`
    # hub name.
    source: str = "synthetic"
    split: str = "train"
    prompts_per_iteration: int = 16
    # The prompt's text; `{question}` is the row's question_field. With chat_template it is the user
    # turn of the conversation, which the tokenizer's own template wraps.
    prompt_template: str = "{question}\n"
    # The fields of a data row that hold the question and the reference answer; the row's other
    # fields travel with it to score.reward_fn.
    question_field: str = "question"
    answer_field: str = "answer"
    # How the reference answer is read, and each completion's answer by the built-in reward:
    # "gsm8k" (a worked solution ending in `#### N`), "boxed" (a solution whose last `\boxed{...}` is
    # the answer, MATH-style), "plain" (the field is the answer itself: "72", "1/2") or "custom"
    # (syncrl does not read it; score.reward_fn does). Every row is checked before the run starts.
    answer_format: str = "gsm8k"
    # Build each prompt with the tokenizer's chat template (an instruct model's conversation format):
    # system_prompt as the system turn where given, prompt_template as the user turn, then the
    # opening of the assistant's turn. Without it, the prompt is prompt_template's text after the
    # special tokens the tokenizer puts first (BOS, where it adds one).
    chat_template: bool = False
    system_prompt: str = ""
    # Synthetic task only: operands are drawn from [0, synthetic_max_operand].
    synthetic_max_operand: int = 4
    synthetic_size: int = 2000

    def __post_init__(self):
        _positive("data.prompts_per_iteration", self.prompts_per_iteration)
        _positive("data.synthetic_max_operand", self.synthetic_max_operand)
        _positive("data.synthetic_size", self.synthetic_size)
        _choice("data.answer_format", self.answer_format, ANSWER_FORMATS)
        for key in ("question_field", "answer_field"):
            if not getattr(self, key):
                raise ConfigError(f"data.{key} is empty: name the data file's field (for example 'question')")
        if self.question_field == self.answer_field:
            raise ConfigError(f"data.question_field and data.answer_field are both {self.question_field!r}: "
                              "name two different fields")
        if self.system_prompt and not self.chat_template:
            raise ConfigError("data.system_prompt is set but data.chat_template is false: a system turn needs "
                              "the tokenizer's chat template; set data.chat_template=true, or put the text in "
                              "data.prompt_template")
        if self.source == "synthetic" and self.answer_format not in ("gsm8k", "custom"):
            raise ConfigError(f"data.answer_format {self.answer_format!r} is for a data file: the synthetic task's "
                              "answers are GSM8K's (`#### N`); leave it 'gsm8k'")
        if "{question}" not in self.prompt_template:
            raise ConfigError(
                "data.prompt_template must contain '{question}' (for example \"Question: {question}\\nAnswer:\")"
            )
        try:
            self.prompt_template.format(question="")
        except (KeyError, IndexError) as e:
            raise ConfigError(f"data.prompt_template {self.prompt_template!r} has a field other than {{question}} "
                              f"({e}); write a literal brace as {{{{ or }}}}") from None
        except ValueError as e:
            raise ConfigError(f"data.prompt_template {self.prompt_template!r}: {e}; write a literal brace as "
                              f"{{{{ or }}}}") from None


@dataclass
class GenerateConfig:
    attempts: int = 8  # samples per prompt (the GRPO group size)
    max_new_tokens: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    # Most sequences (prompts x attempts) decoded at once. 0: as many as fit generate.memory_fraction
    # of the GPU memory free after the model is loaded (the compact cache; on CPU, all of a rank's).
    batch_size: int = 0
    backend: str = "hf"
    # How the HF backend decodes. "compact" (stages/rl/decoding.py): syncrl's own loop over the
    # model's forward; one preallocated KV buffer, finished sequences leave the batch, attention reads
    # only the written prefix, and on GPU each decode step is a replayed CUDA graph. "static" is HF
    # generate() with a preallocated cache (every sequence of a call runs until the longest stops,
    # attending over the whole preallocated length): for architectures compact refuses (sliding-window
    # or hybrid layers). "dynamic" is generate() with a growing cache. (HF's torch.compile of the
    # static cache and transformers' continuous batching were measured and removed: both were several
    # times slower than compact on the reference workload; docs/benchmarks.md.)
    cache: str = "compact"
    # compact: the share of the GPU memory free after the model is loaded that the KV buffer (sized
    # for every sequence reaching max_new_tokens) may take; the rest is left for activations and the
    # old-log-prob pass.
    memory_fraction: float = 0.8
    # GPUs of one node that one generate task spreads the model over, for models too large for one
    # GPU. Tensor parallelism (every GPU works on every step; the heads must divide over them): with
    # backend "vllm", vLLM's; with "hf" and the compact cache, transformers' plan, one process per
    # GPU (stages/rl/tensor_parallel.py). With the static and dynamic caches, transformers'
    # device_map (the layers split across the GPUs, run in turn). 1: one process per GPU, each with
    # the whole model. Generate and score then run tasks_per_node / gpus_per_process tasks per node.
    gpus_per_process: int = 1
    # backend "vllm" (where vLLM is installed): sampling by vLLM's engine, tensor-parallel over
    # gpus_per_process GPUs; the share of each GPU's memory it may take, the rest holding the HF
    # copy of the policy that computes the old log-probs.
    vllm_memory_fraction: float = 0.5
    # backend "vllm": keep one engine per generate rank alive for the whole run (stages/engine.py, a
    # job step beside the stages) instead of starting vLLM in every iteration's generate. Between
    # generate steps it sleeps, its GPU memory freed for train; each generate step has it load the
    # policy of models/iter_{I-1} in place. A dead engine is started again for the next generate.
    # Under SLURM its step shares the GPUs with the stages' steps through srun --overlap, as stages
    # started early do.
    persistent: bool = False
    # persistent: how long a generate step waits for its engine to start and answer (s).
    engine_timeout_s: float = 1800.0

    def __post_init__(self):
        _positive("generate.attempts", self.attempts)
        if not 0 < self.vllm_memory_fraction < 1:
            raise ConfigError(f"generate.vllm_memory_fraction must be in (0, 1) (got {self.vllm_memory_fraction})")
        _positive("generate.gpus_per_process", self.gpus_per_process)
        _positive("generate.max_new_tokens", self.max_new_tokens)
        if self.batch_size < 0:
            raise ConfigError(f"generate.batch_size must be >= 0 (got {self.batch_size}; 0 sizes it from GPU memory)")
        if not 0 < self.memory_fraction < 1:
            raise ConfigError(f"generate.memory_fraction must be in (0, 1) (got {self.memory_fraction})")
        if not self.temperature > 0:
            raise ConfigError(f"generate.temperature must be > 0 (got {self.temperature})")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"generate.top_p must be in (0, 1] (got {self.top_p})")
        _choice("generate.backend", self.backend, ("hf", "vllm"))
        if self.persistent and self.backend != "vllm":
            raise ConfigError(f"generate.persistent needs generate.backend=vllm (got {self.backend}): the HF "
                              "backend loads in seconds; set generate.backend=vllm or generate.persistent=false")
        if not self.engine_timeout_s > 0:
            raise ConfigError(f"generate.engine_timeout_s must be > 0 (got {self.engine_timeout_s})")
        _choice("generate.cache", self.cache, ("compact", "static", "dynamic"))

    def sampler_records_logprobs(self) -> bool:
        """Whether this sampler can record the old log-probs as it draws (tuning.logprobs)."""
        return self.cache == "compact" and self.backend == "hf"


@dataclass
class ScoreConfig:
    correct_reward: float = 1.0
    # Paid when the completion contains a parseable final answer: it gives a from-scratch policy a
    # signal before it is ever right, and shapes it towards answering at all.
    format_reward: float = 0.1
    # Extra when the answer is given in the GSM8K `#### N` form.
    marker_reward: float = 0.0
    # Penalty per completion that hit max_new_tokens without an end-of-sequence token.
    truncation_penalty: float = 0.0
    # A reward of your own, "package.module:function", importable on every node (installed, or on
    # PYTHONPATH). Called as function(completion, row, cfg): the completion's text, the problem's row
    # of the data file (question, answer and every other field) and this section. It returns the
    # reward (a number), or a dict of "reward" and other named numbers or booleans, which reach the
    # scored rows and, as means, gather's stats, metrics.jsonl and W&B ("correct" and "formatted",
    # where given, replace GSM8K's). Empty: GSM8K correctness plus the terms above.
    reward_fn: str = ""

    def __post_init__(self):
        module, sep, name = self.reward_fn.partition(":")
        if self.reward_fn and not (sep and module and name.isidentifier()):
            raise ConfigError(f"score.reward_fn {self.reward_fn!r}: give it as package.module:function")


@dataclass
class GatherConfig:
    advantage: str = "grpo"  # grpo | rloo | none
    normalize_std: bool = True  # GRPO: divide by the group's std
    drop_zero_variance: bool = False  # drop groups whose rewards are all equal (no signal)
    rejection_sampling: bool = False  # keep only completions with reward > group mean

    def __post_init__(self):
        _choice("gather.advantage", self.advantage, ("grpo", "rloo", "none"))


@dataclass
class TrainConfig:
    deepspeed_config: str = "configs/ds_zero2_cpu.json"
    backend: str = "auto"  # auto (nccl on GPU, gloo on CPU) | nccl | gloo
    lr: float = 1e-3
    weight_decay: float = 0.0
    micro_batch_size: int = 16
    gradient_accumulation_steps: int = 1
    epochs: int = 1
    clip_eps: float = 0.2
    kl_coef: float = 0.0  # off by default, as in the original 70B runs
    max_grad_norm: float = 1.0
    timeout_s: int = 600  # process-group init, collectives, and the no-progress watchdog
    socket_ifname: str = ""  # network interface for NCCL and gloo traffic, e.g. "ib0" or "eth0"
    # torch.compile backend for the policy (and reference) forward/backward: "inductor" fuses kernels
    # on GPU (the first micro-batches of each stage pay the compile, and each new sequence width may
    # recompile: it pays off for long train stages); "aot_eager" traces without generating code
    # (checks that a model compiles, cheaply); "eager" does not compile.
    compile: str = "eager"
    # Node-local fast storage for the checkpoint ("" = off: train writes checkpoints/iter_I in the run
    # dir). With a path (/dev/shm/syncrl, a local NVMe disk, $SLURM_TMPDIR: variables are expanded on
    # each node), train writes there, save exports from there, and the persist stage copies it to
    # checkpoints/iter_I while the next iteration runs, off the critical path. ZeRO stage 1, 2 or 3
    # (under ZeRO-3 train also gathers the weights into one file for save: no node holds them whole).
    local_checkpoint_dir: str = ""
    # With local_checkpoint_dir: persist makes the durable copy of every Nth iteration's checkpoint
    # (iterations N-1, 2N-1, ...) and of the run's last; the others stay on the nodes only. A node
    # that loses its copy (replaced, storage cleared) then costs at most the iterations since the
    # last durable copy: the run goes back to it and redoes them.
    durable_every: int = 1

    def __post_init__(self):
        _positive("train.micro_batch_size", self.micro_batch_size)
        _choice("train.compile", self.compile, ("eager", "inductor", "aot_eager"))
        _positive("train.gradient_accumulation_steps", self.gradient_accumulation_steps)
        _positive("train.epochs", self.epochs)
        _positive("train.durable_every", self.durable_every)
        _positive("train.timeout_s", self.timeout_s)
        _choice("train.backend", self.backend, ("auto", "nccl", "gloo"))
        if not self.lr > 0:
            raise ConfigError(f"train.lr must be > 0 (got {self.lr})")
        if not 0 < self.clip_eps < 1:
            raise ConfigError(f"train.clip_eps must be in (0, 1) (got {self.clip_eps})")
        if self.kl_coef < 0:
            raise ConfigError(f"train.kl_coef must be >= 0 (got {self.kl_coef})")


def zero_stage(ds_config: dict) -> int:
    """The ZeRO stage a DeepSpeed config asks for (0 where it names none)."""
    return ds_config.get("zero_optimization", {}).get("stage", 0)


def optimizer_offloaded(ds_config: dict) -> bool:
    """Whether a DeepSpeed config puts the optimizer's state and step on the host (or NVMe)."""
    return (ds_config.get("zero_optimization", {}).get("offload_optimizer") or {}).get("device", "none") != "none"


def deepspeed_derived(t: "TrainConfig", world_size: int) -> dict:
    """The DeepSpeed keys the run config decides (they replace the JSON's): train builds its engine with
    them and `syncrl check` validates the JSON with them."""
    return {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.gradient_accumulation_steps,
        "train_batch_size": t.micro_batch_size * t.gradient_accumulation_steps * world_size,
        "gradient_clipping": t.max_grad_norm,
    }


@dataclass
class SaveConfig:
    keep_checkpoints: int = 1  # DeepSpeed checkpoints kept; the newest is needed to resume the optimizer
    keep_models: int = 0  # HF models kept (0 = all)
    # dtype of the exported HF model: "model" is model.dtype, what generate loads (a bf16 export is
    # half the bytes of fp32; training resumes its fp32 master weights from the DeepSpeed checkpoint).
    export_dtype: str = "model"

    def __post_init__(self):
        _positive("save.keep_checkpoints", self.keep_checkpoints)
        _choice("save.export_dtype", self.export_dtype, ("model", "float32", "bfloat16", "float16"))
        if self.keep_models < 0:
            raise ConfigError(f"save.keep_models must be >= 0 (got {self.keep_models}); 0 keeps all")


@dataclass
class RetryConfig:
    attempts: int = 2  # launches per stage before the run stops
    backoff_s: float = 2.0  # wait before a retry, doubled each time
    max_backoff_s: float = 60.0
    stage_timeout_s: int = 0  # kill a stage attempt after this long (0 = no limit beyond SLURM's)

    def __post_init__(self):
        _positive("retry.attempts", self.attempts)
        if self.backoff_s < 0 or self.stage_timeout_s < 0:
            raise ConfigError("retry.backoff_s and retry.stage_timeout_s must be >= 0")


@dataclass
class SlurmConfig:
    # Ranks per node for generate, score and train (one per GPU on a GPU cluster).
    tasks_per_node: int = 1
    gpus_per_task: int = 0  # srun --gpus-per-task for multi-rank steps (0: leave GPU binding to the site)
    cpus_per_task: int = 0  # srun --cpus-per-task (0: SLURM's default)
    nodes: int = 0  # nodes used by multi-rank steps (0: every node of the allocation)
    srun_args: str = ""  # extra srun arguments for every step, space separated
    # For `syncrl submit` (submitit): the allocation the coordinator's job asks for.
    submit_nodes: int = 2
    gpus_per_node: int = 0
    partition: str = ""
    account: str = ""
    time_min: int = 60
    job_name: str = "syncrl"

    def __post_init__(self):
        _positive("slurm.tasks_per_node", self.tasks_per_node)
        _positive("slurm.time_min", self.time_min)
        _positive("slurm.submit_nodes", self.submit_nodes)
        if self.gpus_per_node < 0 or self.gpus_per_task < 0 or self.cpus_per_task < 0 or self.nodes < 0:
            raise ConfigError("slurm.gpus_per_node, gpus_per_task, cpus_per_task and nodes must be >= 0")


@dataclass
class WandbConfig:
    enabled: bool = True  # also off when the wandb package is missing; metrics.jsonl is always written
    project: str = "syncrl"
    entity: str = ""
    # auto: WANDB_MODE if set, else online when WANDB_API_KEY is set, else offline (sync later with
    # `wandb sync RUN_DIR/wandb`).
    mode: str = "auto"

    def __post_init__(self):
        _choice("wandb.mode", self.mode, ("auto", "online", "offline", "disabled"))


@dataclass
class TuningConfig:
    """Switches of syncrl's speed features and bounds of the coordinator's waits, kept apart from what
    a run computes: each default is what the benchmarks chose (docs/performance.md has each
    feature's gain and its command), and a run needs none of them. Turn a feature off to debug it or
    to measure it; every one computes the same loss and gradient, on or off."""

    # The RMSNorms of Llama, Mistral and Qwen layers run torch's fused kernel (F.rms_norm) in generate
    # and train instead of HF's unfused forward (stages/rl/modeling.py, fuse_rms_norms).
    fused_rms_norm: bool = True
    # Llama, Mistral and Qwen2 attention and MLP on a GPU: q, k and v from one matrix product, gate and
    # up from another, the rotary embedding and SiLU(gate) * up each one Triton kernel a direction
    # (stages/rl/fused_layers.py), for train's update, the whole-sequence log-prob passes and the compact
    # sampler; HF's generate and ZeRO-3 keep HF's forward. Needs Triton (torch's CUDA wheels bring it).
    fused_layers: bool = True
    # The compact sampler replays each decode step as a CUDA graph (on GPU); off, every step launches
    # its kernels.
    decode_graphs: bool = True
    # The compact sampler's decode-step attention as one Triton kernel (stages/rl/fused_kernels.py,
    # decode_attention; on a GPU with Triton, heads of 16-256 as a power of two): it reads each K/V block
    # once for the query heads that share it and keeps the softmax running, where the batched products
    # write and read float32 scores between four kernels.
    decode_kernel: bool = True
    # Where the old log-probs come from. "sampler": the compact sampler records each token's log-prob
    # from the logits it drew it from (no extra pass; they equal a teacher-forced pass within bf16
    # tolerance, tests/test_decoding.py). "recompute": one forward pass over the finished sequences,
    # the one train runs. "auto": sampler for generate.cache=compact, recompute for the others (HF
    # generate and vLLM do not record them).
    logprobs: str = "auto"
    # generate.backend "vllm": run eagerly, without torch.compile and CUDA graphs, which are most of a
    # fresh engine's start.
    vllm_enforce_eager: bool = False
    # Each train micro-batch's rows packed end to end into one sequence, attention within each row
    # (stages/rl/packing.py), so the forward and backward run no padding: the same loss and gradient
    # as right-padded rows, over the real tokens only.
    remove_padding: bool = True
    # Deal each epoch's shuffled rows into micro-batches of near-equal token counts (longest rows
    # first, each to the micro-batch with the fewest tokens so far; stages/rl/steps.py) instead of in
    # shuffled order: every step costs about the same, ranks do not wait for the one with the longest
    # rows, and train_graphs pads little. Which rows share a step then depends on their lengths
    # rather than on the shuffle alone.
    balance_tokens: bool = True
    # 0: each rank's rows of an optimizer step (train.micro_batch_size x gradient_accumulation_steps)
    # run as gradient_accumulation_steps micro-batches of micro_batch_size rows, and the loss is the
    # mean of each micro-batch's token mean. > 0: the same rows are grouped by length into
    # micro-batches whose padded size (rows x longest row) stays within this many positions (a longer
    # row runs alone), every rank running as many as the busiest, and the loss is the token mean over
    # the whole optimizer step on all ranks, whatever the grouping.
    max_tokens_per_micro_batch: int = 0
    # Replay each decoder layer's forward and backward in train as a CUDA graph
    # (stages/rl/cuda_graphs.py): one launch per layer and pass instead of dozens of kernels, for an
    # update bound by the host's dispatch (a small model, short micro-batches). Each train process
    # captures them once, at the largest packed micro-batch of its iteration, to which every
    # micro-batch is then padded. Needs GPUs, remove_padding, train.compile: eager, no gradient
    # checkpointing and ZeRO stage 0-2.
    train_graphs: bool = False
    # Where the gradient norm (and its clipping at train.max_grad_norm) is taken: "deepspeed", one
    # parameter at a time in DeepSpeed's step; "flat", one multi-tensor norm of the flat fp32 gradient
    # partition the step hands its optimizer (stages/rl/grad_norm.py: the same clipping, a fraction of
    # the launches). "flat" needs ZeRO stage 1 or 2 without optimizer offload.
    grad_norm: str = "deepspeed"
    # Write the DeepSpeed checkpoint after train's marker: train copies it to host memory, writes the
    # policy's weights for save, frees the GPU and marks done; its processes then write the checkpoint
    # beside save and the next generate, score and gather (the next train waits for it, and a failed
    # write redoes train; docs/design.md), to the run dir or with train.local_checkpoint_dir to each
    # node's storage. Applies with save.export_dtype the training dtype; otherwise, and for a
    # checkpoint larger than half the node's free host memory, it is written before the marker.
    deferred_checkpoint: bool = True
    # Read DeepSpeed checkpoints (train's resume, save's consolidation) through mmap: straight from the
    # page cache the previous write filled. Turn off on a filesystem whose mmap is slow or unsupported.
    checkpoint_mmap: bool = True
    # Threads that write the DeepSpeed checkpoint's files before train's marker (a plain or node-local
    # checkpoint, or a deferred one's files over the host-memory budget): torch.save's file, its
    # tensors' bytes copied and written in 64 MB chunks by this many threads (stages/rl/serialization.py).
    # 0: torch.save alone, as DeepSpeed calls it.
    checkpoint_write_threads: int = 8
    # Train's resume moves each file's large tensors to the GPU by as many threads, through page-locked
    # buffers, before DeepSpeed copies them into the engine (which copies from pageable memory one
    # tensor at a time); what does not fit the GPU's free memory stays on the host. Not with the
    # optimizer offloaded, nor under ZeRO-3.
    resume_to_gpu: bool = True
    # A stage started early (start_early) waits at most this long (s) for the previous stage's marker.
    start_early_wait_s: int = 21600
    # Train, started early, builds its engine and resumes its checkpoint before its turn, as soon as
    # generate's processes have exited and that checkpoint is published: while score and gather run.
    # At its turn it only reads the train set. Off: it does all of that at its turn.
    set_up_early: bool = True
    # A stage is done once every rank's marker is in; processes still exiting then (closing NCCL
    # groups, CUDA contexts) get this long (s), from when the next stage on the GPUs is due, to be gone.
    exit_grace_s: float = 60.0
    # How long (s) a missing marker is awaited before the stage counts as failed (shared-filesystem lag).
    marker_wait_s: float = 10.0

    def __post_init__(self):
        _choice("tuning.logprobs", self.logprobs, ("auto", "sampler", "recompute"))
        _choice("tuning.grad_norm", self.grad_norm, ("deepspeed", "flat"))
        if self.max_tokens_per_micro_batch < 0:
            raise ConfigError(f"tuning.max_tokens_per_micro_batch must be >= 0 (got {self.max_tokens_per_micro_batch};"
                              " 0 keeps fixed micro-batches of train.micro_batch_size rows)")
        if self.train_graphs and not self.remove_padding:
            raise ConfigError("tuning.train_graphs needs packed micro-batches (one fixed shape to capture): set "
                              "tuning.remove_padding=true, or tuning.train_graphs=false")
        _positive("tuning.start_early_wait_s", self.start_early_wait_s)
        if self.checkpoint_write_threads < 0:
            raise ConfigError(f"tuning.checkpoint_write_threads must be >= 0 (got {self.checkpoint_write_threads}; "
                              "0 writes each file with torch.save alone)")
        if not self.exit_grace_s > 0:
            raise ConfigError(f"tuning.exit_grace_s must be > 0 (got {self.exit_grace_s})")
        if self.marker_wait_s < 0:
            raise ConfigError(f"tuning.marker_wait_s must be >= 0 (got {self.marker_wait_s})")

    def logprobs_from_sampler(self, generate: GenerateConfig) -> bool:
        # "sampler" with a sampler that cannot record them is refused with the run config.
        return self.logprobs != "recompute" and generate.sampler_records_logprobs()


# Keys that moved into `tuning`: a config that still names one is told where it went.
MOVED_KEYS = {
    "model.fused_rms_norm": "tuning.fused_rms_norm", "model.fused_layers": "tuning.fused_layers",
    "generate.cuda_graphs": "tuning.decode_graphs", "generate.logprobs": "tuning.logprobs",
    "generate.vllm_enforce_eager": "tuning.vllm_enforce_eager", "train.remove_padding": "tuning.remove_padding",
    "train.balance_tokens": "tuning.balance_tokens",
    "train.max_tokens_per_micro_batch": "tuning.max_tokens_per_micro_batch",
    "train.graph_layers": "tuning.train_graphs", "train.cuda_graphs": "tuning.train_graphs",
    "train.grad_norm": "tuning.grad_norm", "train.deferred_checkpoint": "tuning.deferred_checkpoint",
    "train.checkpoint_mmap": "tuning.checkpoint_mmap", "start_early_wait_s": "tuning.start_early_wait_s",
    "retry.exit_grace_s": "tuning.exit_grace_s", "retry.marker_wait_s": "tuning.marker_wait_s",
}


@dataclass
class RunConfig:
    run_dir: str = "runs/default"
    iterations: int = 1
    seed: int = 0
    ranks: int = 2  # processes per multi-rank stage when launched locally
    # Start generate, train and save processes while earlier stages still run, so that their imports
    # and model code load meanwhile; each waits (at most start_early_wait_s) for the previous stage's
    # marker before it reads anything (at most tuning.start_early_wait_s). "auto": only where the
    # machine has at least 4 CPU cores per rank, since the early imports compete with the running
    # stage for the cores.
    start_early: str = "auto"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    score: ScoreConfig = field(default_factory=ScoreConfig)
    gather: GatherConfig = field(default_factory=GatherConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    save: SaveConfig = field(default_factory=SaveConfig)
    retry: RetryConfig = field(default_factory=RetryConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    tuning: TuningConfig = field(default_factory=TuningConfig)

    def __post_init__(self):
        _positive("iterations", self.iterations)
        _positive("ranks", self.ranks)
        _choice("start_early", self.start_early, ("auto", "always", "never"))
        tn = self.tuning
        if tn.logprobs == "sampler" and not self.generate.sampler_records_logprobs():
            raise ConfigError(f"tuning.logprobs=sampler needs generate.cache=compact and generate.backend=hf (got "
                              f"cache={self.generate.cache}, backend={self.generate.backend}): set "
                              "tuning.logprobs=recompute")
        if tn.train_graphs and self.train.compile != "eager":
            raise ConfigError(f"tuning.train_graphs captures the eager layers; train.compile is {self.train.compile}: "
                              "set train.compile=eager, or tuning.train_graphs=false")
        if not self.run_dir:
            raise ConfigError("run_dir is empty: set it in the config or as run_dir=PATH")
        if self.data.answer_format == "custom" and not self.score.reward_fn:
            raise ConfigError("data.answer_format is 'custom' (syncrl does not read the answers) but "
                              "score.reward_fn is empty: name the reward function that reads them, or choose "
                              "'gsm8k', 'boxed' or 'plain'")


# Keys that change how a run is executed but not what it computes: changing them on resume is fine.
NON_SEMANTIC_KEYS = ("run_dir", "iterations", "retry", "slurm", "wandb", "start_early", "tuning.start_early_wait_s",
                     "tuning.exit_grace_s", "tuning.marker_wait_s")


def load_config(path: str | Path | None, overrides: typing.Sequence[str] = ()) -> RunConfig:
    """Load a YAML config (or the defaults when path is None) and apply `key.sub=value` overrides."""
    raw: dict = {}
    source = "defaults"
    if path is not None:
        source = str(path)
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {path} not found (or not a file): pass an existing YAML file")
        try:
            raw = yaml.load(read_text_file(p), Loader=_UniqueKeyLoader) or {}
        except DuplicateKey as e:
            raise ConfigError(f"{path}: {e}") from None
        except yaml.YAMLError as e:
            where = getattr(e, "problem_mark", None)
            at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
            raise ConfigError(f"{path}: YAML syntax error{at}: {getattr(e, 'problem', e)}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: top level must be a mapping of keys, got {type(raw).__name__}")
    for item in overrides:
        key, value = _parse_override(item)
        _set_dotted(raw, key, value)
    return from_dict(RunConfig, raw, source=source)


def read_text_file(path: Path) -> str:
    """A text file's contents as UTF-8, or a ConfigError naming the file and the first bad byte."""
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ConfigError(f"{path}: not UTF-8 text: byte 0x{data[e.start]:02x} at offset {e.start} (line {line}); "
                          f"save the file as UTF-8") from None


class DuplicateKey(yaml.YAMLError):
    pass


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (YAML keeps the last silently:
    a second `train:` section would reset the first's settings to their defaults)."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise DuplicateKey(f"key '{key}' appears twice in one section, at lines {seen[key] + 1} and "
                                   f"{key_node.start_mark.line + 1}: keep one")
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def from_dict(cls, raw: dict, source: str = "config", prefix: str = ""):
    """Build dataclass `cls` from a nested dict, rejecting unknown keys and wrong types."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(raw) - set(fields))
    moved = [k for k in unknown if f"{prefix}{k}" in MOVED_KEYS]
    if moved:
        key = f"{prefix}{moved[0]}"
        raise ConfigError(f"{source}: '{key}' is now '{MOVED_KEYS[key]}' (speed features' switches and the "
                          f"coordinator's waits live in the tuning section): write {MOVED_KEYS[key]}")
    if unknown:
        where = f"section '{prefix.rstrip('.')}'" if prefix else "top level"
        raise ConfigError(
            f"{source}: unknown key '{prefix}{unknown[0]}' in {where}; valid keys: {', '.join(sorted(fields))}"
        )
    kwargs = {}
    for name, value in raw.items():
        kwargs[name] = _coerce(hints[name], value, f"{prefix}{name}", source)
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def config_hash(cfg: RunConfig) -> str:
    """Hash of what the run computes; keys in NON_SEMANTIC_KEYS are left out, and so is every key at
    its default value: an option added to syncrl later (with a default that keeps the old behaviour)
    then leaves the markers of runs made before it valid, so upgrading mid-run redoes nothing."""
    defaults = to_dict(RunConfig(run_dir="-"))
    d = _without_defaults(_semantic(to_dict(cfg)), defaults)
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def _without_defaults(d: dict, defaults: dict) -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and isinstance(defaults.get(k), dict):
            sub = _without_defaults(v, defaults[k])
            if sub:
                out[k] = sub
        elif k not in defaults or v != defaults[k]:
            out[k] = v
    return out


def _semantic(d: dict, prefix: str = "") -> dict:
    """`d` without the keys of NON_SEMANTIC_KEYS (whole sections, or dotted keys within one)."""
    return {k: _semantic(v, f"{prefix}{k}.") if isinstance(v, dict) else v for k, v in d.items()
            if f"{prefix}{k}" not in NON_SEMANTIC_KEYS}


def config_diff(old: dict, new: dict, prefix: str = "") -> list[str]:
    """Lines `key: old -> new` for every semantic key that differs."""
    lines = []
    for key in sorted(set(old) | set(new)):
        if f"{prefix}{key}" in NON_SEMANTIC_KEYS:
            continue
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            lines += config_diff(a, b, f"{prefix}{key}.")
        elif a != b:
            lines.append(f"{prefix}{key}: {a!r} -> {b!r}")
    return lines


def dump_config(cfg: RunConfig) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def _parse_override(item: str) -> tuple[str, object]:
    if "=" not in item:
        raise ConfigError(f"override '{item}' has no '=': write key=value, for example iterations=2")
    key, text = item.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override '{item}' has an empty key: write key=value, for example iterations=2")
    try:
        # YAML scalars give the natural types: 2 -> int, 1e-3 -> float, true -> bool.
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        value = text
    return key, value


def _set_dotted(raw: dict, key: str, value) -> None:
    node = raw
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {key}: '{part}' is a value, not a section")
        node = child
    node[parts[-1]] = value


def _coerce(hint, value, key: str, source: str):
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: '{key}' is a section; give it keys, not {value!r}")
        return from_dict(hint, value, source, prefix=f"{key}.")
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{source}: '{key}' must be true or false, got {value!r}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{source}: '{key}' must be an integer, got {value!r}")
    if hint is float:
        if isinstance(value, str):
            try:
                value = float(value)  # YAML reads "1e-3" (no dot) as a string
            except ValueError:
                pass
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(float(value)):
                raise ConfigError(f"{source}: '{key}' must be a finite number, got {value!r}")
            return float(value)
        raise ConfigError(f"{source}: '{key}' must be a number, got {value!r}")
    if hint is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{source}: '{key}' must be a string, got {value!r}")
    return value


def _positive(key: str, value) -> None:
    if value <= 0:
        raise ConfigError(f"{key} must be > 0 (got {value})")
    if key in UPPER_BOUNDS and value > UPPER_BOUNDS[key]:
        raise ConfigError(f"{key} must be at most {UPPER_BOUNDS[key]:,} (got {value:,})")


# Sizes past which a value is a typo, not a plan: each would have syncrl do work or hold memory in
# proportion to it before any stage ran.
UPPER_BOUNDS = {"iterations": 1_000_000, "ranks": 100_000, "generate.attempts": 10_000,
                "generate.max_new_tokens": 1_000_000, "data.prompts_per_iteration": 100_000_000,
                "data.synthetic_size": 100_000_000, "train.epochs": 10_000}


def _choice(key: str, value, allowed) -> None:
    if value not in allowed:
        raise ConfigError(f"{key} must be one of {', '.join(allowed)} (got {value!r})")
