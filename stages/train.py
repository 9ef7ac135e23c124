"""train: one DeepSpeed process per rank over all nodes; PPO-clip on the gathered train set.

Starts from the previous iteration's model and resumes optimizer state from its DeepSpeed
checkpoint; writes checkpoints/iter_I (with train.local_checkpoint_dir, to each node's own storage,
which the persist stage then copies to checkpoints/iter_I). The process group lives for this step
only: generation and scoring never hold an idle communicator that could time out.

By hand, one process per rank (here 2 on one machine; under SLURM, srun sets the layout):

    torchrun --nproc-per-node 2 -m stages.train --run-dir RUN_DIR --iteration I
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from stages.rl import (cuda_graphs, deferred_checkpoint, flops, grad_norm, packing, rehearsal, step_records,
                      train_checkpoint)
from stages.rl.batches import collate, sequence_logprobs
from stages.rl.loss import ppo_clip_loss
from stages.rl.modeling import (DTYPES, build_policy, compile_layers, device_for, load_policy, preload_model_code,
                                 set_cpu_threads)
from stages.rl.steps import optimizer_steps
from stages.runtime import dist
from stages.runtime.config import ConfigError, deepspeed_derived, zero_stage
from stages.runtime.logs import Phases, Progress
from stages.runtime.markers import read_jsonl, write_jsonl_atomic
from stages.runtime.memory import free_tensors_reached, release_cached_memory
from stages.runtime.stage import StageContext, run_stage, write_failure_record

log = logging.getLogger("syncrl.train")

def main(ctx: StageContext) -> None:
    """PPO-clip update of the policy over this iteration's train set."""
    run = set_up(ctx)
    t1 = time.time()
    history, totals = run_updates(ctx, run.engine, run.ref, run.rows, run.device, run.watchdog, run.norm)
    finish(ctx, run, history, totals, time.time() - t1)


@dataclass
class TrainRun:
    """What set-up builds and the updates and finish use."""
    engine: object
    ref: object
    rows: list
    device: object
    watchdog: dist.ProgressWatchdog
    phases: Phases
    startup_s: float
    hf_ds_config: object  # transformers holds it weakly while a ZeRO-3 model exists: kept for the stage
    ds_config: dict
    checkpointer: train_checkpoint.Checkpointer
    norm: grad_norm.FlatGradNorm | None = None  # tuning.grad_norm: flat


def set_up(ctx: StageContext) -> TrainRun:
    """At the turn: the engine set_up_engine built before it (ctx.set_up, where the GPUs were free
    early) or builds now, then this iteration's train set; each start-up phase timed."""
    phases = Phases(ctx.start)
    run = ctx.set_up if ctx.set_up is not None else set_up_engine(ctx, phases)
    run.phases = phases
    with phases("read_train_set"):
        run.rows = read_train_set(ctx)
    with phases("barrier"):
        dist.barrier(f"iteration {ctx.iteration} engine ready", ctx.cfg.train.timeout_s)
    run.watchdog.beat("train")
    run.startup_s = time.time() - ctx.start  # from the stage's start: DeepSpeed's import included
    log.info("engine ready in %.1fs%s: ZeRO stage %s, world %d, %d train rows", run.startup_s,
             " after the turn (built before it)" if ctx.set_up is not None else "", zero_stage(run.ds_config),
             ctx.world_size, len(run.rows))
    return run


def set_up_before_turn(ctx: StageContext) -> TrainRun:
    """A train process started early, once the GPUs are free (generate's processes have exited and
    the checkpoint it resumes is published): its engine, built while score and gather run. The
    watchdog rests until the turn, which has its own bound (tuning.start_early_wait_s)."""
    phases = Phases(time.time())
    run = set_up_engine(ctx, phases)
    run.watchdog.rest()
    ctx.preload_phases.update({f"set_up {k}": v for k, v in phases.seconds.items()})
    log.info("engine built before the turn in %.1fs", sum(phases.seconds.values()))
    return run


def set_up_engine(ctx: StageContext, phases: Phases) -> TrainRun:
    """Process group, models, DeepSpeed engine and resumed state: all that does not read the train set."""
    cfg, t = ctx.cfg, ctx.cfg.train
    pool = ctx.preloaded  # host memory for a deferred checkpoint's snapshot, prepared before the turn
    if pool is not None:
        # At the turn, or before it once the GPUs are free: either way the previous train's marker,
        # and so the layout the pool waits for, is in.
        pool.turn_came()
    with phases("import_deepspeed"):
        import deepspeed
    with phases("devices"):
        set_cpu_threads()
        device = device_for(ctx.info.local_rank)
        check_graph_device(ctx, device)
        dist.export_torch_env(ctx.info)
        dist.communication_env(ctx.attempt, t.socket_ifname)
        watchdog = dist.ProgressWatchdog(t.timeout_s, lambda msg: write_failure_record(ctx, TimeoutError(msg)))
        backend = dist.pick_backend(t.backend)
    with phases("process_group"):
        dist.init_process_group(ctx.info, backend, t.timeout_s)
        watchdog.beat("load model")
        _skip_cpu_inference_op(deepspeed)
        # DeepSpeed adopts the group we made (our timeout, our rendezvous); ZeRO-3's zero.Init needs it.
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False,
                                   timeout=datetime.timedelta(seconds=t.timeout_s))
    with phases("load_models"):
        ds_config = deepspeed_config(ctx)
        # The frozen reference is a full replica per rank, loaded before the ZeRO-3 context below would
        # partition it too (it runs outside the engine, so it must keep whole weights).
        ref = load_reference(ctx, device) if t.kl_coef > 0 else None
        hf_ds_config = _zero3_init_context(ds_config)
        # The checkpoint resumed below sets every weight: the policy's files are read only where there is none.
        build = build_policy if train_checkpoint.resumes_weights(ctx) else load_policy
        # ZeRO-3 must load on the host (weights are partitioned as they load); below it, straight to the GPU.
        model = build(ctx.policy_path(), cfg.model.dtype, None if hf_ds_config is not None else device,
                      fused_norms=cfg.tuning.fused_rms_norm, fused_layers=cfg.tuning.fused_layers)
        if build is build_policy:
            log.info("the policy built without its weights: the checkpoint it resumes sets them")
        if cfg.model.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        if cfg.tuning.remove_padding:
            for m in (model, ref):
                if m is not None:
                    packing.use_packed_attention(m)
    with phases("deepspeed_initialize"):
        optimizer = None
        if "optimizer" not in ds_config:
            optimizer = torch.optim.AdamW(model.parameters(), lr=t.lr, weight_decay=t.weight_decay)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config,
                                          model_parameters=None if optimizer else model.parameters())
        norm = flat_grad_norm(ctx, engine)
        if t.compile != "eager":
            ref = compile_models(engine, ref, t.compile, zero_stage(ds_config))
    with phases("resume_checkpoint"):
        watchdog.beat("resume optimizer state")
        checkpointer = train_checkpoint.for_run(ctx, ds_config, pool)
        checkpointer.resume(engine)
    return TrainRun(engine, ref, [], device, watchdog, phases, 0.0, hf_ds_config, ds_config, checkpointer, norm)


def finish(ctx: StageContext, run: TrainRun, history: list[dict], totals: dict, train_s: float) -> None:
    """The checkpoint (run.checkpointer: plain, node-local or deferred), the loss curve, the figures
    of all ranks and the marker; a deferred checkpoint is written after the marker."""
    t = ctx.cfg.train
    t2 = time.time()
    run.watchdog.beat("save checkpoint")
    release_cached_memory()
    saved = run.checkpointer.save(run.engine, run.watchdog)
    outputs = saved.outputs
    save_s = time.time() - t2
    if ctx.rank == 0:
        curve = ctx.paths.train_curve(ctx.iteration)
        write_jsonl_atomic(curve, history)
        outputs.append(curve)
    first_micro_batch_s = totals.pop("first_micro_batch_s", 0.0)
    graphs = {"cuda_graphs_s": totals.pop("cuda_graphs_s")} if "cuda_graphs_s" in totals else {}
    host = totals.pop("host")
    totals = _all_reduce_sums(totals, run.device)
    all_tokens = int(totals["tokens"])
    summary = {
        "steps": len(history), "tokens": all_tokens, "positions": int(totals["positions"]),
        "model_flops": totals["flops"], "startup_s": run.startup_s, "startup_phases": run.phases.seconds,
        "train_s": train_s, "checkpoint_s": save_s, "first_micro_batch_s": first_micro_batch_s,
        "update_host_s": host, **graphs,
        "tokens_per_s": all_tokens / train_s if train_s > 0 else 0.0,
        "positions_per_s": totals["positions"] / train_s if train_s > 0 else 0.0,
        **_history_means(history),
        **_mfu(totals["flops"], train_s, ctx.world_size),
    }
    ctx.summarize("trained %d optimizer steps on %d tokens (all ranks) in %.1fs, %.0f tok/s; checkpoint %.1fs%s",
                  summary["steps"], all_tokens, train_s, summary["tokens_per_s"], save_s,
                  deferred_checkpoint.deferral_note(saved.extra.get("deferred_checkpoint"))
                  if saved.written_after_marker else "")
    # What the marker lists is whole on every rank before anyone marks done; a rank that never arrives is named.
    dist.barrier(f"iteration {ctx.iteration} checkpoint saved", t.timeout_s)
    if saved.written_after_marker:
        release_engine(run)
    ctx.write_marker(outputs, extra={**summary, **saved.extra})
    run.checkpointer.after_marker(run.watchdog)
    run.watchdog.stop()


def release_engine(run: TrainRun) -> None:
    """Free the GPU before the marker: the next stages on it start once the marker is in, while this
    process still writes the checkpoint from host memory."""
    run.engine.destroy()
    engine = weakref.ref(run.engine)
    # The flat norm holds the ZeRO optimizer (its fp32 weights and Adam moments): dropped with the engine.
    run.engine = run.ref = run.norm = None
    release_cached_memory()
    freed, walk_s = 0, 0.0
    if engine() is not None and run.device.type != "cpu":
        # It outlived its destroy() (a ZeRO-3 engine does): its GPU tensors are freed by storage. Not on
        # the CPU: the snapshot keeps the engine's host tensors (CPU Adam's state) as they are.
        t0 = time.time()
        freed = free_tensors_reached(engine(), run.device)
        walk_s = time.time() - t0
        release_cached_memory()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        log.info("GPU memory held while the checkpoint is written: %.2f GB allocated, %.2f GB reserved "
                 "(%.2f GB freed by storage, what the engine's references kept, in %.2fs)",
                 torch.cuda.memory_allocated() / 1e9, torch.cuda.memory_reserved() / 1e9, freed / 1e9, walk_s)


# Modules deepspeed.initialize imports on its first call (DeepSpeed 0.19: its optimizer check
# imports the Muon optimizer, which imports torch.compile's Inductor; the engine imports its
# expert-parallel layers): hundreds of modules, imported here before the turn instead of in it.
DEEPSPEED_LAZY_IMPORTS = ("deepspeed.runtime.zero.muon.muon_optimizer", "deepspeed.module_inject.auto_ep_layer",
                          "deepspeed.module_inject.auto_ep")


def preload(ctx: StageContext) -> deferred_checkpoint.HostPool | None:
    """What a train process started early imports before its turn, so that the engine's start-up
    does not; returns the host memory it prepares for a deferred checkpoint's snapshot. It builds
    nothing that needs a process group: no communicator sits idle while generate and score run."""
    import importlib

    # Its parts go in the marker (preload_phases): what to shorten when the preload runs past the turn.
    phases = Phases(time.time())
    with phases("deepspeed"):
        import deepspeed  # noqa: F401 (the import is the point)
    with phases("deepspeed_lazy_modules"):
        for name in DEEPSPEED_LAZY_IMPORTS:
            try:
                importlib.import_module(name)
            except ImportError:  # another DeepSpeed version: initialize imports what it needs itself
                log.debug("preload: %s not in this DeepSpeed", name)
    log.info("preload: deepspeed imported in %.1fs, the modules its initialize imports in %.1fs",
             phases.seconds["deepspeed"], phases.seconds["deepspeed_lazy_modules"])
    # The host memory for the snapshot fills in a thread of its own (seconds, mostly outside the GIL):
    # started first, so that the rehearsal's seconds overlap it and it is done before the turn.
    pool = deferred_checkpoint.prepare_pool(ctx)
    with phases("model_code"):
        config, ds_config = preload_model_code(ctx), deepspeed_config(ctx, warn=False)  # set-up warns
    # The rehearsal only saves time, less than it takes: not once the stage is late, nor once the GPUs
    # are free for the engine's set-up before the turn (which then saves more).
    if ctx.turn_came() or ctx.gpus_free():
        log.info("no rehearsal of a micro-step: %s while preloading",
                 "the turn came" if ctx.turn_came() else "the GPUs came free for the set-up")
        phases.seconds["rehearsal"] = 0.0
    else:
        with phases("rehearsal"):
            rehearse_step(ctx, config, ds_config)
    ctx.preload_phases.update(phases.seconds)
    return pool


def rehearse_step(ctx: StageContext, config, ds_config: dict) -> None:
    """On a GPU, before the turn: a micro-step of a one-layer model of the policy's architecture
    (`config`, the base model's; stages/rl/rehearsal.py), so that the first micro-batch finds its CUDA
    and Triton kernels loaded. It only saves time: a failure is logged, and the first micro-batch
    loads the kernels itself."""
    if not torch.cuda.is_available():
        return
    cfg = ctx.cfg
    device, dtype = device_for(ctx.info.local_rank), DTYPES[cfg.model.dtype]
    skip = rehearsal.skip_reason(config, dtype, ds_config, torch.cuda.get_device_properties(device).total_memory)
    rehearsal.before_turn("a micro-step", "of", "the first micro-batch", skip, lambda: rehearsal.rehearse(
        config, dtype, cfg.tuning, cfg.train, cfg.generate.temperature, device))


def compile_models(engine, ref, backend: str, stage: int):
    """torch.compile the policy and the reference; returns the reference.

    ZeRO 0-2: each decoder layer (compile_layers). ZeRO-3: the whole policy through DeepSpeed's
    engine.compile, which its parameter-gathering hooks inside every layer need."""
    if stage == 3:
        # ZeRO-3's per-layer hooks read an integer layer id; as a static int it forces one recompile
        # per layer until dynamo gives up on the frame.
        torch._dynamo.config.allow_unspec_int_on_nn_module = True
        engine.compile(backend=backend)
        what = "policy"
    else:
        what = f"{compile_layers(engine.module, backend)} policy layers"
    if ref is not None:
        what += f" and {compile_layers(ref, backend)} reference layers"
    log.info("%s compiled with torch.compile backend %s", what, backend)
    return ref


def load_reference(ctx: StageContext, device):
    return load_policy(ctx.base_model_path(), ctx.cfg.model.dtype, device,
                       fused_norms=ctx.cfg.tuning.fused_rms_norm,
                       fused_layers=ctx.cfg.tuning.fused_layers).eval().requires_grad_(False)


def read_train_set(ctx: StageContext) -> list[dict]:
    return read_jsonl(ctx.paths.train_set(ctx.iteration))


def deepspeed_config(ctx: StageContext, warn: bool = True) -> dict:
    """train.deepspeed_config with what the run config decides (batch sizes, lr); `warn`: log each
    value of the file that the run config replaces."""
    t = ctx.cfg.train
    ds = json.loads(Path(t.deepspeed_config).read_text())
    for key, value in deepspeed_derived(t, ctx.world_size).items():
        if warn and key in ds and ds[key] not in ("auto", value):
            log.warning("%s: %s=%s replaced by %s from the run config", t.deepspeed_config, key, ds[key], value)
        ds[key] = value
    if t.local_checkpoint_dir:
        # Each node's first rank writes the model states too, so a node resumes from its own folder.
        ds.setdefault("checkpoint", {})["use_node_local_storage"] = True
    if "optimizer" in ds:
        params = ds["optimizer"].setdefault("params", {})
        params["lr"] = t.lr
        params["weight_decay"] = t.weight_decay
    if ctx.cfg.tuning.grad_norm == "flat":
        ds = grad_norm.deepspeed_settings(ds)
    zero = ds.get("zero_optimization", {})
    if ctx.world_size == 1 and zero.get("stage") in (1, 2) and zero.get("overlap_comm"):
        # One rank has no gradients to exchange, so there is nothing to overlap; ZeRO 1-2's overlap
        # makes the host wait for the GPU before each reduction bucket (docs/benchmarks.md).
        ds["zero_optimization"] = {**zero, "overlap_comm": False}
        if warn:
            log.info("%s: overlap_comm off on a single rank (no gradient exchange to overlap)", t.deepspeed_config)
    return ds


def flat_grad_norm(ctx: StageContext, engine) -> grad_norm.FlatGradNorm | None:
    """With tuning.grad_norm: flat, the norm and clipping that replace DeepSpeed's in its step."""
    t = ctx.cfg.train
    return grad_norm.FlatGradNorm(engine, t.max_grad_norm) if ctx.cfg.tuning.grad_norm == "flat" else None


def _skip_cpu_inference_op(deepspeed) -> None:
    """On CPU, keep DeepSpeed from JIT-building its shared-memory all-reduce op.

    That op serves only inference_all_reduce, which training never calls; building it costs a
    minute of compiling on first use, and a rank killed mid-build leaves a lock that hangs later runs.
    """
    if not torch.cuda.is_available():
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def _zero3_init_context(ds_config: dict):
    """Under ZeRO-3, from_pretrained must see the DeepSpeed config to load weights already sharded."""
    if zero_stage(ds_config) != 3:
        return None
    from transformers.integrations import HfDeepSpeedConfig

    return HfDeepSpeedConfig(ds_config)


def out_of_memory_advice(ctx: StageContext, lengths: list[int], step: int, micro: int, micro_batches: int,
                         error: BaseException) -> str:
    """The message of a micro-batch that ran out of GPU memory: which one, its size, and the settings
    that make micro-batches smaller (completions grow as the policy learns, so a size that fit in
    iteration 0 may not later)."""
    t, tuning = ctx.cfg.train, ctx.cfg.tuning
    rows, positions = len(lengths), sum(lengths)
    budget = tuning.max_tokens_per_micro_batch
    size = (f"tuning.max_tokens_per_micro_batch (now {budget}) lower" if budget
            else f"tuning.max_tokens_per_micro_batch={max(1, positions // 2)} (a token budget) or train.micro_batch_size "
                 f"lower than {t.micro_batch_size}")
    checkpointing = "" if ctx.cfg.model.gradient_checkpointing else "; or model.gradient_checkpointing=true"
    return (f"iteration {ctx.iteration}, rank {ctx.rank}: out of GPU memory in optimizer step {step}, micro-batch "
            f"{micro} of {micro_batches} ({rows} rows, {positions} positions, the longest {max(lengths, default=0)}). "
            f"Set {size}{checkpointing}; or more GPUs with ZeRO-3, which shards the weights and optimizer state "
            f"over them. ({error})")


def run_updates(ctx: StageContext, engine, ref, rows: list[dict], device, watchdog,
                norm: grad_norm.FlatGradNorm | None = None) -> tuple[list[dict], dict]:
    """All epochs of optimizer steps; returns (per-optimizer-step history, this rank's totals).

    Totals: loss tokens, positions (real tokens of every sequence run) and model FLOPs (flops.py).
    """
    t = ctx.cfg.train
    temperature = ctx.cfg.generate.temperature
    shape = flops.model_shape(engine.module)
    history = []
    totals = {"tokens": 0, "positions": 0, "flops": 0.0}
    steps = optimizer_steps(rows, ctx)
    engine.train()
    fixed = graph_layers(ctx, engine, steps, device, totals)
    bar = Progress(sum(len(s.micro_batches) for s in steps), f"train iteration {ctx.iteration}: micro-batches",
                   ctx.rank)
    passes = 3 + (ref is not None)  # forward + backward of the policy, forward of the reference
    # Where the host's time goes (the GPU runs behind it): building and sending batches, forward and
    # backward, the optimizer step, and reading each step's record (where the host waits for the GPU).
    host = dict.fromkeys(("batches_s", "forward_backward_s", "optimizer_step_s", "step_records_s"), 0.0)

    first = time.time()
    for step in steps:
        pending, step_tokens = [], 0
        for i, micro in enumerate(step.micro_batches):
            t0 = time.perf_counter()
            batch = packing.pack(micro, device, fixed) if ctx.cfg.tuning.remove_padding else collate(micro, device)
            if step.normalizer is not None:
                # The boundary is the step's last micro-batch, however many the step has.
                engine.set_gradient_accumulation_boundary(i == len(step.micro_batches) - 1)
            t1 = time.perf_counter()
            try:
                loss, metrics = micro_step(engine, ref, batch, t, temperature, step.normalizer)
                t2 = time.perf_counter()
                engine.step()
            except torch.OutOfMemoryError as e:
                raise torch.OutOfMemoryError(out_of_memory_advice(ctx, batch["lengths"], len(history) + 1, i + 1,
                                                                  len(step.micro_batches), e)) from e
            t3 = time.perf_counter()
            host["batches_s"] += t1 - t0
            host["forward_backward_s"] += t2 - t1
            host["optimizer_step_s"] += t3 - t2
            watchdog.beat()
            totals["flops"] += passes * sum(flops.forward_flops(shape, n) for n in batch["lengths"])
            totals["positions"] += sum(batch["lengths"])
            totals["tokens"] += batch["tokens"]
            step_tokens += batch["tokens"]
            pending.append({"loss": loss.detach(), **metrics})
            bar.update(1)
            if first is not None:
                # The first micro-batch compiles (train.compile) or reads the compile cache: timed
                # apart, once, with one device sync.
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                totals["first_micro_batch_s"], first = time.time() - first, None
        t0 = time.perf_counter()
        record = step_records.step_record(engine, pending, step_tokens, norm)
        history.append(record)
        check_gradient(ctx, record)
        host["step_records_s"] += time.perf_counter() - t0
    bar.close()
    if fixed is not None:
        cuda_graphs.release_layers(engine.module)  # their memory, for the checkpoint's copy
    totals["host"] = host
    return history, totals


def check_graph_device(ctx: StageContext, device) -> None:
    """tuning.train_graphs needs a GPU on every rank: said before anything is loaded."""
    if ctx.cfg.tuning.train_graphs and device.type != "cuda":
        raise ConfigError(f"tuning.train_graphs is on, but rank {ctx.rank} runs on {device}: CUDA graphs need a "
                          "GPU; set tuning.train_graphs=false")


def graph_layers(ctx: StageContext, engine, steps: list, device, totals: dict) -> packing.PackedShape | None:
    """With tuning.train_graphs, capture the policy's layers as CUDA graphs at the one packed shape all
    of this rank's micro-batches fit (stages/rl/cuda_graphs.py); returns that shape (None: no graphs)."""
    if not ctx.cfg.tuning.train_graphs:
        return None
    t0 = time.time()
    micro_batches = [micro for step in steps for micro in step.micro_batches]
    shape = packing.fixed_shape(micro_batches)
    layers = cuda_graphs.capture_layers(engine.module, shape, device)
    totals["cuda_graphs_s"] = time.time() - t0
    real = sum(packing.row_width(r) for micro in micro_batches for r in micro if r)
    log.info("captured CUDA graphs of %d layers in %.1fs for micro-batches of %d positions, up to %d rows of up to "
             "%d (%.0f%% of the positions they run are padding)", layers, totals["cuda_graphs_s"], shape.positions,
             shape.segments - 1, shape.max_length, 100 * (1 - real / (shape.positions * max(1, len(micro_batches)))))
    return shape


def check_gradient(ctx: StageContext, record: dict) -> None:
    """Stop at an optimizer step whose gradient norm is not finite, unless DeepSpeed skipped it.

    configs/ds_zero2_gpu.json turns DeepSpeed's bf16 overflow check off (a per-parameter inf/NaN
    pass and a device sync in every step, much of a small model's step); the
    gradient norm it computes anyway shows the same thing. All ranks see the same all-reduced norm
    and stop together; the marker and checkpoint are not written, so the previous
    iteration's stay as they were."""
    norm = record.get("grad_norm")
    if norm is None or math.isfinite(norm):
        return
    if record.get("skipped"):
        log.warning("optimizer step %d: gradient norm %s, step skipped by DeepSpeed's overflow check",
                    record["step"], norm)
        return
    raise FloatingPointError(
        f"rank {ctx.rank}: optimizer step {record['step']} of iteration {ctx.iteration} has a non-finite "
        f"gradient norm ({norm}) and the weights took it; nothing of this train attempt is kept. Check the "
        f"learning rate (train.lr={ctx.cfg.train.lr}) and the train set, or have DeepSpeed skip such steps: "
        f'"bf16": {{"check_grad_overflow": true}} in {ctx.cfg.train.deepspeed_config}')


def micro_step(engine, ref, batch: dict, t, temperature: float, normalizer: float | None = None):
    """Forward, loss and backward of one micro-batch; the optimizer step is the caller's.

    With a normalizer (the optimizer step's loss tokens on all ranks), the loss is this batch's
    share of the step's token mean, scaled back up by what DeepSpeed divides gradients by: the
    ranks (it averages their gradients) and its gradient-accumulation steps (it scales each loss).
    """
    logp = sequence_logprobs(engine, batch, temperature)
    ref_logp = None
    if ref is not None:
        with torch.no_grad():
            ref_logp = sequence_logprobs(ref, batch, temperature)
    scale = None
    if normalizer is not None:
        scale = normalizer / (engine.dp_world_size * engine.gradient_accumulation_steps())
    loss, metrics = ppo_clip_loss(logp, batch["old_logp"], batch["advantages"], batch["mask"],
                                  t.clip_eps, ref_logp, t.kl_coef, normalizer=scale)
    engine.backward(loss)
    return loss, metrics


def _history_means(history: list[dict]) -> dict:
    """Means over this iteration's optimizer steps, and the last learning rate."""
    out = {}
    for key in ("loss", "kl", "clip_frac", "ratio_mean", "grad_norm"):
        values = [h[key] for h in history if h.get(key) is not None]
        if values:
            out[f"{key}_mean"] = sum(values) / len(values)
    if history and history[-1].get("lr") is not None:
        out["lr"] = history[-1]["lr"]
    return out


def _mfu(model_flops: float, seconds: float, world: int) -> dict:
    if not torch.cuda.is_available() or seconds <= 0:
        return {}
    peak = flops.peak_flops(torch.cuda.get_device_name())
    return {"mfu": model_flops / (seconds * world * peak)} if peak else {}


def _all_reduce_sums(totals: dict, device) -> dict:
    t = torch.tensor(list(totals.values()), dtype=torch.float64, device=device)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(t)
    return dict(zip(totals, t.tolist()))


if __name__ == "__main__":
    # Every rank redoes train together: a half-finished process group cannot be resumed rank by rank.
    run_stage("train", main, per_rank_skip=False, preload=preload, set_up=set_up_before_turn)
