"""save: consolidate this iteration's DeepSpeed checkpoint on CPU into an HF model under models/iter_I.

When train writes its checkpoint after its marker (train.deferred_checkpoint), the weights come from
the policy file train wrote before it (its module's, in the training dtype: the fp32 master weights
as the optimizer step rounded them); the next save removes it.

With node-local checkpoints (train.local_checkpoint_dir) the weights come from the model states of
this node's copy (ZeRO 1 and 2 keep them whole there, in the training dtype), or of the durable
copy once the persist stage has made it.

No process group: one task reads the ZeRO shards from disk. The export is verified to load, then
published by atomic rename, so generate never sees a half-written model. Old checkpoints are pruned
per save.keep_checkpoints.

By hand:

    python -m stages.save --run-dir RUN_DIR --iteration I
"""

from __future__ import annotations

import logging
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from stages.rl.modeling import DTYPES, load_policy, load_tokenizer, preload_model_code
from stages.rl.serialization import checkpoint_io
from stages.runtime import local_checkpoints, markers
from stages.runtime.stage import MissingInput, StageContext, run_stage

log = logging.getLogger("syncrl.save")


def main(ctx: StageContext) -> None:
    """Export the trained policy as an HF model and prune old checkpoints."""
    paths, it = ctx.paths, ctx.iteration
    tag = paths.checkpoint_tag(it)
    # Deleting a checkpoint of several GB takes seconds and only needs this iteration's checkpoint to be
    # complete (train's marker says so): it runs beside the export instead of after it.
    with ThreadPoolExecutor(1, thread_name_prefix="prune") as pool:
        pruning = pool.submit(prune_checkpoints, ctx)
        seconds, target = export_and_publish(ctx, tag)
        pruned = pruning.result()
    pruned += prune_models(ctx) + prune_policies(ctx)
    if pruned:
        log.info("pruned %s", ", ".join(pruned))
    size = sum(f.stat().st_size for f in target.rglob("*") if f.is_file())
    ctx.summarize("published %s (%.1f MB): consolidate %.1fs, export %.1fs (%.2f GB/s), verify %.1fs", target,
                  size / 1e6, seconds["consolidate_s"], seconds["export_s"],
                  size / 1e9 / max(seconds["export_s"], 1e-9), seconds["verify_s"])
    ctx.write_marker([target], extra={"bytes": size, **seconds, "pruned": pruned,
                                       "prunable": [f"models/{target.name}/"]})


def export_and_publish(ctx: StageContext, tag: str) -> tuple[dict, Path]:
    """Consolidate, export, verify and publish models/iter_I; returns the seconds of each, and its path."""
    paths, it = ctx.paths, ctx.iteration
    t0 = time.time()
    with checkpoint_io(ctx.cfg.train.checkpoint_mmap):
        state = read_weights(ctx, tag)
    consolidate_s = time.time() - t0
    target = paths.model(it)
    tmp = target.with_name(f".{target.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # left by an interrupted earlier attempt
    dtype = ctx.cfg.model.dtype if ctx.cfg.save.export_dtype == "model" else ctx.cfg.save.export_dtype
    t1 = time.time()
    weights = {k: v.to(DTYPES[dtype]) for k, v in state.items()}  # cast once: written, then compared
    del state
    try:
        export(ctx.policy_path(), weights, dtype, tmp, ctx)
        export_s = time.time() - t1
        verify(tmp, weights, dtype)
        verify_s = time.time() - t1 - export_s
    except BaseException:
        # A full disk or a bad export leaves nothing half-written behind; what was published stays.
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    markers.publish_dir(tmp, target)
    return {"consolidate_s": consolidate_s, "export_s": export_s, "verify_s": verify_s}, target


def preload(ctx) -> None:
    """What a save process imports before it can start (for a process started early)."""
    import deepspeed.utils.zero_to_fp32  # noqa: F401 (the import is the point)

    preload_model_code(ctx)


def read_weights(ctx: StageContext, tag: str) -> dict:
    """The trained weights: the policy file train wrote before its marker when it writes its
    checkpoint after it; else consolidated from the ZeRO shards in the run dir, or, when train wrote
    node-local checkpoints, the model states of this node's copy (else of the persisted one)."""
    policy = ctx.paths.train_policy(ctx.iteration)
    if local_checkpoints.deferred(ctx.paths, ctx.iteration) and policy.is_file():
        from safetensors.torch import load_file

        log.info("reading the weights from %s (train writes its checkpoint after its marker)", policy)
        return load_file(policy)
    recorded = local_checkpoints.recorded(ctx.paths, ctx.iteration)
    if not recorded:
        problem = local_checkpoints.deferred_problem(ctx.paths, ctx.iteration)
        if problem:
            raise MissingInput(f"iteration {ctx.iteration}: {policy} is gone (removed by a later save) and the "
                               f"checkpoint is not there whole ({problem}): redo train: syncrl rerun "
                               f"{ctx.paths.root} --iteration {ctx.iteration} --stage train")
        return consolidate(ctx.paths.checkpoints, tag)
    here = local_checkpoints.this_node(ctx.cfg.train.local_checkpoint_dir, ctx.paths)
    problems = []
    for folder in ([here / tag] if here else []) + [ctx.paths.checkpoints / tag]:
        problem = local_checkpoints.problem(folder, recorded["id"])
        if problem is None:
            log.info("reading the weights from %s", folder / local_checkpoints.MODEL_STATES)
            return module_weights(folder / local_checkpoints.MODEL_STATES)
        problems.append(problem)
    raise MissingInput(f"iteration {ctx.iteration}: no copy of train's checkpoint is there whole ({'; '.join(problems)}): "
                       f"redo train: syncrl rerun {ctx.paths.root} --iteration {ctx.iteration} --stage train")


def module_weights(model_states: Path) -> dict:
    """The module's own weights from a DeepSpeed model-states file (ZeRO 1 and 2: whole, in the
    training dtype: the fp32 master weights rounded as the optimizer step rounded them)."""
    return torch.load(model_states, map_location="cpu", weights_only=False)["module"]


def consolidate(checkpoint_dir: Path, tag: str) -> dict:
    """fp32 weights gathered from every rank's ZeRO shard files, on CPU."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(checkpoint_dir), tag=tag)


def export(policy: Path, weights: dict, dtype: str, out: Path, ctx: StageContext) -> None:
    """The policy's architecture with the consolidated weights (already in `dtype`), written as an HF model.

    The model is built on the meta device and takes the weights by reference: nothing is initialised
    or read from the previous export.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(policy)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype])
    missing, unexpected = model.load_state_dict(weights, strict=False, assign=True)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise RuntimeError(f"checkpoint does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.tie_weights()
    model.save_pretrained(out, safe_serialization=True)
    load_tokenizer(ctx.tokenizer_path()).save_pretrained(out)


def verify(out: Path, weights: dict, dtype: str) -> None:
    """Reload the export and compare every tensor with the consolidated weights (in the export dtype)."""
    reloaded = load_policy(out, dtype).state_dict()
    for name, tensor in weights.items():
        if name in reloaded and not torch.equal(reloaded[name], tensor):
            raise RuntimeError(f"exported model at {out} differs from the checkpoint at {name}")


def prune_checkpoints(ctx: StageContext) -> list[str]:
    """Remove DeepSpeed checkpoints beyond save.keep_checkpoints; never one newer than this iteration.
    A checkpoint train writes after its marker may not be there yet: train prunes once it is."""
    if local_checkpoints.deferred(ctx.paths, ctx.iteration):
        return []
    return markers.prune_iterations(ctx.paths, ctx.paths.checkpoints, ctx.cfg.save.keep_checkpoints, ctx.iteration)


def prune_policies(ctx: StageContext) -> list[str]:
    """Train's copies of the policy's weights (train.deferred_checkpoint) of earlier iterations: each
    is as large as its export. This iteration's stays until the next save (persist and a rerun of
    this save may read train's outputs)."""
    removed = []
    for it in range(ctx.iteration):
        policy = ctx.paths.train_policy(it)
        if policy.is_file():
            policy.unlink()
            removed.append(str(policy.relative_to(ctx.paths.root)))
    return removed


def prune_models(ctx: StageContext) -> list[str]:
    """Remove exported models beyond save.keep_models (0 keeps all), counting this iteration's, once published."""
    if not ctx.cfg.save.keep_models:
        return []
    return markers.prune_iterations(ctx.paths, ctx.paths.models, ctx.cfg.save.keep_models, ctx.iteration)


if __name__ == "__main__":
    run_stage("save", main, preload=preload)
