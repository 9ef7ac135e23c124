"""save: consolidate this iteration's DeepSpeed checkpoint on CPU into an HF model under models/iter_I.

When train writes its checkpoint after its marker (tuning.deferred_checkpoint), the export's weights
file is the policy file train wrote before it (its module's, in the training dtype: the fp32 master
weights as the optimizer step rounded them), linked in under a second name once its header matches
the architecture; the next save removes train's name for it.

With node-local checkpoints (train.local_checkpoint_dir) the weights come from the model states of
this node's copy (ZeRO 1 and 2 keep them whole there, in the training dtype), or of the durable
copy once the persist stage has made it; under ZeRO-3, from the policy file train gathered them
into (no node's copy holds them whole).

No process group: one task reads the ZeRO shards from disk. The export is verified (reloaded and
compared; linked, its header checked), then published by atomic rename, so generate never sees a
half-written model. Old checkpoints are pruned per save.keep_checkpoints.

By hand:

    python -m stages.save --run-dir RUN_DIR --iteration I
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from stages.rl.modeling import DTYPES, load_policy, load_tokenizer, preload_model_code
from stages.rl.serialization import checkpoint_io
from stages.runtime import footprint, local_checkpoints, markers, safetensors_header
from stages.runtime.stage import MissingInput, StageContext, run_stage

log = logging.getLogger("syncrl.save")

# What transformers names an export's single weights file, and safetensors' names of the dtypes.
SAFE_WEIGHTS_NAME = "model.safetensors"
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


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
    if seconds["export"] == "linked":
        ctx.summarize("published %s (%.1f MB): train's policy file linked in, %.1fs; its layout %s, %.1fs",
                      target, size / 1e6, seconds["export_s"], seconds["layout"], seconds["verify_s"])
    else:
        ctx.summarize("published %s (%.1f MB): consolidate %.1fs, export %.1fs (%.2f GB/s), verify %.1fs", target,
                      size / 1e6, seconds["consolidate_s"], seconds["export_s"],
                      size / 1e9 / max(seconds["export_s"], 1e-9), seconds["verify_s"])
    ctx.write_marker([target], extra={"bytes": size, **seconds, "pruned": pruned,
                                       "prunable": [f"models/{target.name}/"]})


def export_and_publish(ctx: StageContext, tag: str) -> tuple[dict, Path]:
    """Export, verify and publish models/iter_I; returns the seconds of each part, and its path."""
    target = ctx.paths.model(ctx.iteration)
    tmp = target.with_name(f".{target.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # left by an interrupted earlier attempt
    dtype = ctx.cfg.model.dtype if ctx.cfg.save.export_dtype == "model" else ctx.cfg.save.export_dtype
    try:
        seconds = link_policy(ctx, dtype, tmp) or write_export(ctx, tag, dtype, tmp)
    except BaseException:
        # A full disk or a bad export leaves nothing half-written behind; what was published stays.
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    markers.publish_dir(tmp, target)
    return seconds, target


def write_export(ctx: StageContext, tag: str, dtype: str, tmp: Path) -> dict:
    """The weights read (or consolidated), written as an HF model into `tmp`, and read back."""
    t0 = time.time()
    with checkpoint_io(ctx.cfg.tuning.checkpoint_mmap):
        state = read_weights(ctx, tag)
    consolidate_s = time.time() - t0
    return {"consolidate_s": consolidate_s, **write_weights(state, ctx.policy_path(), dtype, tmp, ctx.tokenizer_path())}


def write_weights(state: dict, policy: Path, dtype: str, out: Path, tokenizer: Path) -> dict:
    """`state` in `dtype`, written as an HF model of the policy's architecture, then reloaded and compared."""
    t0 = time.time()
    weights = {k: v.to(DTYPES[dtype]) for k, v in state.items()}  # cast once: written, then compared
    del state
    export(policy, weights, dtype, out, tokenizer)
    export_s = time.time() - t0
    verify(out, weights, dtype)
    return {"export": "written", "export_s": export_s, "verify_s": time.time() - t0 - export_s}


def link_policy(ctx: StageContext, dtype: str, tmp: Path) -> dict | None:
    """The export made of the policy file train wrote before its marker (link_export); None where
    train wrote none."""
    policy = ctx.paths.train_policy(ctx.iteration)
    if not (local_checkpoints.wrote_policy(ctx.paths, ctx.iteration) and policy.is_file()):
        return None
    seconds = link_export(policy, ctx.policy_path(), dtype, tmp, ctx.tokenizer_path(), previous_export=ctx.iteration > 0)
    if seconds is not None:
        log.info("exported by linking %s, the weights train wrote for save", policy)
    return seconds


def link_export(weights_file: Path, policy: Path, dtype: str, out: Path, tokenizer: Path,
                previous_export: bool = False) -> dict | None:
    """An HF model of the policy's architecture in `out` whose weights file is `weights_file`, linked
    in, once its safetensors header names each of the architecture's weights with its shape and
    dtype (check_layout); None if transformers stores this architecture's weights under other
    names than the module's (what `weights_file` has).

    train's policy file already holds the export's bytes (the module's weights in the training dtype,
    tied ones once): writing them again and reading them back would hold the next generate up for
    no new byte.

    `previous_export`: `policy` is the previous iteration's export, which save made and checked.
    Where `weights_file` has its weights file's layout exactly, the check would find what it found
    then: the export takes that export's other files, and the architecture is not built (building
    it imports transformers' model code, most of a save process's start-up where none was preloaded).
    """
    t0 = time.time()
    model = None
    if not (previous_export and same_layout(weights_file, policy / SAFE_WEIGHTS_NAME)):
        model = meta_model(policy, dtype)
        if renames_weights(model):
            return None
        check_layout(weights_file, model)
    verify_s = time.time() - t0
    out.mkdir(parents=True)
    try:
        os.link(weights_file, out / SAFE_WEIGHTS_NAME)
    except OSError:  # no hard links on this filesystem (or across two): a copy
        shutil.copyfile(weights_file, out / SAFE_WEIGHTS_NAME)
    if model is None:
        for f in policy.iterdir():
            if f.is_file() and f.name != SAFE_WEIGHTS_NAME:
                shutil.copyfile(f, out / f.name)
    else:
        write_model_files(model, out, tokenizer)
    return {"export": "linked", "consolidate_s": 0.0, "export_s": time.time() - t0 - verify_s, "verify_s": verify_s,
            "layout": "as the previous export" if model is None else "checked against the architecture"}


def same_layout(a: Path, b: Path) -> bool:
    """Whether two safetensors files hold tensors of the same names, dtypes and shapes."""
    found = safetensors_header.layout(a)
    return found is not None and found == safetensors_header.layout(b)


def meta_model(policy: Path, dtype: str):
    """The policy's architecture on the meta device (no memory, nothing initialised), in `dtype`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(policy)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype])


def renames_weights(model) -> bool:
    """Whether transformers saves this architecture's weights under other names or layouts than the
    module's own (its conversion mappings): the policy file has the module's."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # a transformers without conversion mappings
        return False
    state = model.state_dict()
    return revert_weight_conversion(model, state) is not state


def check_layout(weights_file: Path, model) -> None:
    """Raise unless `weights_file` holds each of the model's weights (a tied one at most once) under its
    name, shape and dtype, and nothing else. Reads the safetensors header only."""
    expected = {k: (SAFETENSORS_DTYPES.get(t.dtype, str(t.dtype)), tuple(t.shape))
                for k, t in model.state_dict().items()}
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    found = safetensors_header.layout(weights_file)
    if found is None:
        raise RuntimeError(f"{weights_file} is missing or not a safetensors file; redo train")
    missing = sorted(set(expected) - set(found) - tied)
    unexpected = sorted(set(found) - set(expected))
    wrong = sorted(f"{k}: {found[k]} where the model has {expected[k]}" for k in set(found) & set(expected)
                   if found[k] != expected[k])
    if missing or unexpected or wrong:
        raise RuntimeError(f"{weights_file} does not match the model ({type(model).__name__}): missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]}, shape or dtype {wrong[:5]}; redo train")


def write_model_files(model, out: Path, tokenizer: Path) -> None:
    """The config, generation config and tokenizer files of an export, as save_pretrained writes them."""
    model.config.dtype = str(model.dtype).removeprefix("torch.")
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(out)
    if model.can_generate():
        model.generation_config.save_pretrained(out)
    load_tokenizer(tokenizer).save_pretrained(out)


def preload(ctx) -> None:
    """What a save process imports before it can start (for a process started early). DeepSpeed only
    where save may consolidate its checkpoint: with the checkpoint after train's marker it links
    train's policy file in, and importing DeepSpeed beside the next train's and generate's own
    imports made a save started early late for its turn."""
    if footprint.why_not_deferred(ctx.cfg) is not None:
        import deepspeed.utils.zero_to_fp32  # noqa: F401 (the import is the point)
    preload_model_code(ctx)


def read_weights(ctx: StageContext, tag: str) -> dict:
    """The trained weights: the policy file train wrote before its marker when it writes its
    checkpoint after it; else consolidated from the ZeRO shards in the run dir, or, when train wrote
    node-local checkpoints, the model states of this node's copy (else of the persisted one)."""
    policy = ctx.paths.train_policy(ctx.iteration)
    if local_checkpoints.wrote_policy(ctx.paths, ctx.iteration) and policy.is_file():
        from safetensors.torch import load_file

        log.info("reading the weights from %s, the weights train wrote for save", policy)
        return load_file(policy)
    recorded = local_checkpoints.recorded(ctx.paths, ctx.iteration)
    if not recorded:
        problem = local_checkpoints.deferred_problem(ctx.paths, ctx.iteration)
        if problem:
            raise MissingInput(f"iteration {ctx.iteration}: {policy} is gone (removed by a later save) and the "
                               f"checkpoint is not there whole ({problem}): redo train: syncrl rerun "
                               f"{ctx.paths.root} --iteration {ctx.iteration} --stage train")
        return consolidate(ctx.paths.checkpoints, tag)
    if recorded.get("policy"):
        # ZeRO-3: no node's copy holds the whole weights; train's policy file was the only one.
        raise MissingInput(f"iteration {ctx.iteration}: {policy}, the weights train wrote for save, is gone: redo "
                           f"train: syncrl rerun {ctx.paths.root} --iteration {ctx.iteration} --stage train")
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


def export(policy: Path, weights: dict, dtype: str, out: Path, tokenizer: Path) -> None:
    """The policy's architecture with the consolidated weights (already in `dtype`), written as an HF model.

    The model is built on the meta device and takes the weights by reference: nothing is initialised
    or read from the previous export.
    """
    model = meta_model(policy, dtype)
    missing, unexpected = model.load_state_dict(weights, strict=False, assign=True)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise RuntimeError(f"checkpoint does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.tie_weights()
    model.save_pretrained(out, safe_serialization=True)
    load_tokenizer(tokenizer).save_pretrained(out)


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
    """Train's copies of the policy's weights (tuning.deferred_checkpoint) of earlier iterations: each
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
