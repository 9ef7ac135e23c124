"""`syncrl check CONFIG [key=value ...]`: find every problem before any allocation time is spent.

Each problem is one line naming the key or file and the fix. `syncrl run` and `syncrl submit` run
these checks first and stop with exit status 2 when any is found.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import io
import json
import os
import shutil
import subprocess
from pathlib import Path

from jobs.launchers import group_problem, launcher_kind
from stages.runtime.config import (ConfigError, RunConfig, config_diff, config_hash, deepspeed_derived, load_config,
                                  optimizer_offloaded, to_dict, zero_stage)
from stages.runtime import footprint, memory, reward_plugin
from stages.runtime.data import CHAT_TEMPLATE_FIX, read_jsonl_problems
from stages.runtime.dist import allocation
from stages.runtime.paths import RunPaths
from stages.runtime.presets import PRESETS

PROJECT_ROOT = Path(__file__).resolve().parents[1]


def check(cfg: RunConfig, launcher: str = "auto", env: dict | None = None) -> list[str]:
    """Problems with a loaded config (file paths may still be relative). Empty list: good to go."""
    env = os.environ if env is None else env
    problems: list[str] = []
    problems += _check_run_dir(cfg)
    problems += _check_model(cfg)
    problems += _check_chat_template(cfg)
    problems += _check_data(cfg)
    problems += _check_reward_fn(cfg)
    problems += _check_deepspeed(cfg)
    problems += _check_sizes(cfg, world_size(cfg, launcher, env))
    problems += _check_resources(cfg, launcher, env)
    problems += _check_generate_spread(cfg, launcher, env)
    problems += _check_generate_engine(cfg)
    return problems


def check_warnings(cfg: RunConfig, launcher: str = "auto", env: dict | None = None) -> list[str]:
    """What may stop or slow the run later without being wrong now, one line each, for a config
    check() passes: the disk space the run will hold against what its filesystems have free (an
    estimate: other users write there too), and on a GPU node of the run a deferred checkpoint too
    large for the host memory its snapshot may take."""
    env = os.environ if env is None else env
    cfg = copy.deepcopy(cfg)
    resolve_paths(cfg)
    # A node's own storage (train.local_checkpoint_dir) is seen only on a node of the run: this
    # machine with the local launcher, or inside the allocation (the coordinator's node).
    alloc = _allocation_nodes(env)
    nodes = 1 if launcher_kind(launcher, env) == "local" else (_run_nodes(cfg, alloc) if alloc else None)
    warnings = space_warnings(cfg, nodes)
    if nodes is not None and _local_gpu_count() > 0:  # the snapshot copies GPU memory: nothing to hold elsewhere
        warnings += snapshot_warnings(cfg, world_size(cfg, launcher, env), nodes, memory.available_host_bytes())
    return warnings


def snapshot_warnings(cfg: RunConfig, world: int, nodes: int, available: int) -> list[str]:
    """Rank 0's snapshot of the deferred checkpoint against its host-memory budget on this node
    (stages/runtime/footprint.py): what is over it, train writes before its marker."""
    params = footprint.parameters(cfg.model.path, cfg.model.preset)
    path = resolve(cfg.train.deepspeed_config)
    if params is None or path is None:
        return []
    ds = json.loads(path.read_text())
    short = footprint.snapshot_shortfall(cfg, params, world, nodes, zero_stage(ds), optimizer_offloaded(ds), available)
    if short is None:
        return []
    where = ("checkpoints/ (or train.local_checkpoint_dir) on a disk with room for them rather than in tmpfs, "
             "or " if short.in_memory else "")
    return [f"about {_gb(short.snapshot - short.budget)} of train's checkpoint will be written before its marker every "
            f"iteration, on the critical path: rank 0's snapshot of it ({_gb(short.snapshot)}) is over the host memory "
            f"it may take ({_gb(short.budget)}: "
            f"{memory.HOST_MEMORY_SHARE:.0%} of this node's {_gb(available)} available, less the kept checkpoints "
            f"in tmpfs, per rank{', halved as the checkpoints are in tmpfs' if short.in_memory else ''}); "
            f"{where}nodes with about {_gb(short.available_needed)} of available host memory take it off"]


def space_warnings(cfg: RunConfig, nodes: int | None = None) -> list[str]:
    """The checkpoints, exported models and base model the run will hold at its peak, and with
    `nodes` a node's share of the node-local checkpoints (stages/runtime/footprint.py), against each
    filesystem's free space plus what the run already holds there."""
    params = footprint.parameters(cfg.model.path, cfg.model.preset)
    if params is None:
        return []
    fp = footprint.footprint(cfg, params, nodes)
    try:
        short = footprint.shortfalls(cfg, fp)
    except OSError:  # a filesystem that will not say its free space: nothing to estimate against
        return []
    out = []
    for folder, need, have, parts in short:
        what = {"checkpoints": f"checkpoints, {fp.checkpoints_held} of {_gb(fp.checkpoint)} (save.keep_checkpoints="
                               f"{cfg.save.keep_checkpoints} and the one being written)",
                "models": f"exported models, {fp.models_held} of {_gb(fp.model)} (save.keep_models={cfg.save.keep_models}"
                          + (" keeps every iteration's)" if not cfg.save.keep_models else ")"),
                "base model": "the base model",
                footprint.NODE_LOCAL: "this node's share of the node-local checkpoints, the last and the one "
                                          "being written (train.local_checkpoint_dir)"}
        listed = "; ".join(f"{what[name]}: {_gb(size)}" for name, size in parts)
        settings, names = [], dict(parts)
        if "models" in names and fp.models_held > 1:
            room = (have - need + names["models"]) // fp.model
            if room >= 1:
                settings.append(f"save.keep_models={min(int(room), fp.models_held - 1)}")
        if "checkpoints" in names and cfg.save.keep_checkpoints > 1:
            settings.append("save.keep_checkpoints=1")
        places = [] if set(names) == {footprint.NODE_LOCAL} else \
            ["use a run_dir (or a link for checkpoints/ or models/) on a filesystem with more room"]
        if footprint.NODE_LOCAL in names:
            places.append("point train.local_checkpoint_dir at node storage with more room (or unset it: the "
                          "checkpoints then go to the run dir)")
        fix = (f"set {' or '.join(settings)}, or " if settings else "") + ", or ".join(places)
        size = f"{params / 1e9:.1f}B" if params >= 1e8 else f"{params / 1e6:.2f}M"
        out.append(f"{folder}: the run will hold about {_gb(need)} there ({listed}) for {size} parameters, "
                   f"and {_gb(have)} is free (counting what the run holds there already): {fix}")
    return out


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def _check_reward_fn(cfg: RunConfig) -> list[str]:
    """score.reward_fn imports here, as score will import it (with the run's working directory on
    the path): a missing module or name is found before any allocation time is spent."""
    if not cfg.score.reward_fn:
        return []
    try:
        reward_plugin.load(cfg.score.reward_fn)
    except ConfigError as e:
        return [str(e)]
    return []


def _check_generate_engine(cfg: RunConfig) -> list[str]:
    """The packages generate.backend needs, looked up without importing them."""
    g = cfg.generate
    if g.backend == "vllm" and importlib.util.find_spec("vllm") is None:
        return ["generate.backend is vllm, but vllm is not installed here: pip install vllm where generate "
                "runs, or set generate.backend=hf"]
    return []


def _check_generate_spread(cfg: RunConfig, launcher: str, env) -> list[str]:
    gpp = cfg.generate.gpus_per_process
    if gpp == 1:
        return []
    problems = []
    name, n = ("ranks", cfg.ranks) if launcher_kind(launcher, env) == "local" else \
        ("slurm.tasks_per_node", cfg.slurm.tasks_per_node)
    if gpp > n:
        # group_problem's fix (raise the count to gpp) would ask for GPUs a node may not have.
        problems.append(f"generate.gpus_per_process ({gpp}) exceeds {name} ({n}), the GPUs of one node: a generate "
                        f"process spreads the model over its own node's GPUs only (vLLM's tensor parallelism or "
                        f"HF's layer split); set generate.gpus_per_process to a divisor of {n}, or {name} to {gpp} on "
                        f"nodes with {gpp} GPUs")
    elif n % gpp:
        problems.append(group_problem(name, n, gpp))
    g = cfg.generate
    compact = g.backend == "hf" and g.cache == "compact"
    if g.backend == "vllm" or compact:
        problems += tensor_parallel_problems(cfg, gpp, "vLLM's" if g.backend == "vllm" else "transformers'")
    if not compact and importlib.util.find_spec("accelerate") is None:
        # The HF copy of the policy (the sampler with the static and dynamic caches; the old log-probs with vllm).
        problems.append(f"generate.gpus_per_process ({gpp}) splits the HF model with transformers' device_map, "
                        "which needs the accelerate package: pip install accelerate")
    return problems


def tensor_parallel_problems(cfg: RunConfig, tp: int, library: str = "vLLM's") -> list[str]:
    """vLLM, or transformers' plan under the compact sampler, shards each layer's attention heads over
    the process's GPUs (generate.gpus_per_process of them): the query heads must divide evenly, and
    the K/V heads too. vLLM also takes fewer K/V heads than GPUs where they divide the GPUs (each
    then copied to several); transformers' plan does not. Checked where the model's config can be
    read without loading it (the preset's dimensions, or model.path's config.json)."""
    heads = model_dimensions(cfg)
    if heads is None:
        return []
    q, kv = heads
    fix = f"set generate.gpus_per_process to a divisor of {q}{'' if kv == q else f' and of {kv}'} (1 runs one GPU)"
    if q % tp:
        return [f"generate.gpus_per_process ({tp}) splits the model's {q} attention heads (num_attention_heads) over "
                f"{tp} GPUs with {library} tensor parallelism, and {q} is not a multiple of {tp}: {fix}"]
    if kv % tp == 0 or (library == "vLLM's" and tp % kv == 0):
        return []
    how = "can be neither split over nor copied evenly to" if library == "vLLM's" else "do not split evenly over"
    return [f"generate.gpus_per_process ({tp}): the model's {kv} K/V heads (num_key_value_heads) {how} {tp} GPUs "
            f"by {library} tensor parallelism: {fix}"]


def model_dimensions(cfg: RunConfig) -> tuple[int, int] | None:
    """(query heads, K/V heads) of the run's model, from the preset or model.path's config.json;
    None where that cannot be read here (another check names a missing model)."""
    if cfg.model.path:
        try:
            config = json.loads((Path(cfg.model.path).expanduser() / "config.json").read_text())
        except (OSError, ValueError):
            return None
        config = config.get("text_config", config)  # a multimodal model's language half
    else:
        config = PRESETS.get(cfg.model.preset, {})
    q = config.get("num_attention_heads")
    if not isinstance(q, int) or q < 1:
        return None
    kv = config.get("num_key_value_heads") or q
    return q, kv


def check_files(config_path: str | None, overrides=(), launcher: str = "auto") -> tuple[list[str], list[str]]:
    """Load and check: (problems, warnings). A config that does not load is itself the (single)
    problem; warnings are looked for only in a config without problems."""
    try:
        cfg = load_config(config_path, overrides)
    except ConfigError as e:
        return [str(e)], []
    problems = check(cfg, launcher)
    return problems, ([] if problems else check_warnings(cfg, launcher))


def resolve(value: str) -> Path | None:
    """A relative path is looked up in the working directory, then in the project's checkout."""
    p = Path(value).expanduser()
    if p.is_absolute():
        return p if p.exists() else None
    for base in (Path.cwd(), PROJECT_ROOT):
        if (base / p).exists():
            return (base / p).resolve()
    return None


def world_size(cfg: RunConfig, launcher: str, env) -> int:
    """Ranks of a multi-rank stage, as the launcher will start them."""
    if launcher_kind(launcher, env) == "local":
        return cfg.ranks
    alloc = _allocation_nodes(env) or cfg.slurm.submit_nodes  # outside one: what `syncrl submit` asks for
    return _run_nodes(cfg, alloc) * cfg.slurm.tasks_per_node


def _run_nodes(cfg: RunConfig, alloc: int) -> int:
    """Nodes the multi-rank stages use of an allocation of `alloc` (slurm.nodes, 0: all of them)."""
    return min(cfg.slurm.nodes or alloc, alloc)


def _allocation_nodes(env) -> int | None:
    """Nodes of the SLURM allocation this runs in; None outside one."""
    if not allocation("job_id", env):
        return None
    return int(allocation("num_nodes", env) or 1)


def _check_run_dir(cfg: RunConfig) -> list[str]:
    root = Path(cfg.run_dir).expanduser()
    if root.exists() and not root.is_dir():
        return [f"run_dir {root} is a file, not a directory: choose another run_dir"]
    parent = next((p for p in [root, *root.parents] if p.exists()), None)
    if parent is not None and not os.access(parent, os.W_OK):
        return [f"run_dir {root}: {parent} is not writable: choose a run_dir you can write to"]
    new = copy.deepcopy(cfg)
    try:
        resolve_paths(new)
    except ConfigError:
        return []  # the missing path is reported by its own check
    problem = frozen_config_problem(new)
    return [problem] if problem else []


def frozen_config_problem(cfg: RunConfig) -> str | None:
    """Why `cfg` (its paths resolved) may not run in its run dir: the config frozen there at the run's
    start does not load, or differs in a setting that changes results. None for a new run."""
    frozen = RunPaths(cfg.run_dir).config
    if not frozen.is_file():
        return None
    try:
        old = load_config(frozen)
    except ConfigError as e:
        return f"{frozen} (the run's frozen config) does not load: {e}; restore it or use a new run_dir"
    if config_hash(old) != config_hash(cfg):
        diff = "; ".join(config_diff(to_dict(old), to_dict(cfg)))
        return (f"run_dir {cfg.run_dir} holds a run started with a different config ({diff}): resume with the "
                f"same settings, or start a new run with another run_dir")
    return None


def resolve_paths(cfg: RunConfig) -> None:
    """Make cfg's file paths absolute in place, so stages find them whatever their working directory."""
    cfg.run_dir = str(Path(cfg.run_dir).expanduser().resolve())
    for section, key in (("train", "deepspeed_config"), ("model", "path"), ("model", "tokenizer"),
                         ("data", "source")):
        obj = getattr(cfg, section)
        value = getattr(obj, key)
        if not value or value == "synthetic":
            continue
        path = resolve(value)
        if path is not None:
            setattr(obj, key, str(path))
        elif section != "data" or _looks_like_path(value):  # a data source may be a hub name
            raise ConfigError(f"{section}.{key}: {value} not found (looked in {Path.cwd()} and {PROJECT_ROOT})")


def _looks_like_path(value: str) -> bool:
    # Hub names look like "owner/name"; anything else with a slash, a suffix or a leading . / ~ is a path.
    return value.endswith((".jsonl", ".json")) or value.startswith(("/", ".", "~")) or value.count("/") > 1


def _check_model(cfg: RunConfig) -> list[str]:
    m = cfg.model
    if not m.path:
        return []
    problems = []
    path = resolve(m.path)
    if path is None:
        return [f"model.path {m.path} not found: give a Hugging Face model directory (config.json + weights) "
                f"on a filesystem every node sees, or leave it empty for the built-in preset"]
    if not (path / "config.json").is_file():
        problems.append(f"model.path {path} has no config.json: it is not a Hugging Face model directory")
    elif not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        problems.append(f"model.path {path} has no *.safetensors or *.bin weights")
    tok = resolve(m.tokenizer) if m.tokenizer else path
    if m.tokenizer and tok is None:
        problems.append(f"model.tokenizer {m.tokenizer} not found: give the tokenizer directory, or leave it "
                        "empty to use model.path")
    elif tok is not None and not ((tok / "tokenizer.json").is_file() or (tok / "tokenizer_config.json").is_file()):
        problems.append(f"{'model.tokenizer' if m.tokenizer else 'model.path'} {tok} has no tokenizer.json or "
                        "tokenizer_config.json: set model.tokenizer to the tokenizer's directory")
    return problems


def _check_chat_template(cfg: RunConfig) -> list[str]:
    """data.chat_template needs a tokenizer that has one, found where transformers keeps it (in
    tokenizer_config.json, or a chat_template.jinja / .json file beside it), without loading it."""
    if not cfg.data.chat_template:
        return []
    fix = CHAT_TEMPLATE_FIX
    m = cfg.model
    if not m.path and not m.tokenizer:
        return [f"data.chat_template is true but the built-in preset's character tokenizer has no chat template: {fix}"]
    tok = resolve(m.tokenizer or m.path)
    if tok is None:
        return []  # _check_model names the missing directory
    if (tok / "chat_template.jinja").is_file() or (tok / "chat_template.json").is_file():
        return []
    try:
        config = json.loads((tok / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        config = {}
    if isinstance(config, dict) and config.get("chat_template"):
        return []
    return [f"data.chat_template is true but the tokenizer in {tok} has no chat template (none in "
            f"tokenizer_config.json, no chat_template.jinja): {fix}"]


def _check_data(cfg: RunConfig) -> list[str]:
    src = cfg.data.source
    if src == "synthetic":
        return []
    path = resolve(src)
    if path is None:
        if _looks_like_path(src):
            return [f"data.source {src} not found: give a JSONL file, a hub name, or 'synthetic'"]
        return []  # a hub name: checked when the stage loads it
    if not os.access(path, os.R_OK):
        return [f"data.source {path} is not readable: fix its permissions"]
    try:
        problems = read_jsonl_problems(path, cfg.data)
    except ConfigError as e:
        return [f"data.source: {e}"]
    if len(problems) < cfg.data.prompts_per_iteration:
        return [f"data.source {path} has {len(problems)} problems, fewer than data.prompts_per_iteration "
                f"({cfg.data.prompts_per_iteration}): problems would repeat within an iteration; lower it"]
    return []


def _check_deepspeed(cfg: RunConfig) -> list[str]:
    key = "train.deepspeed_config"
    path = resolve(cfg.train.deepspeed_config)
    if path is None:
        return [f"{key} {cfg.train.deepspeed_config} not found: give a DeepSpeed JSON (see configs/ds_*.json)"]
    try:
        ds = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        return [f"{key} {path}: not valid JSON at line {e.lineno}, column {e.colno}: {e.msg}"]
    except OSError as e:
        return [f"{key} {path}: cannot be read ({e.strerror}): fix its permissions"]
    if not isinstance(ds, dict):
        return [f"{key} {path}: the top level must be a JSON object"]
    problems = []
    stage = zero_stage(ds)
    if stage not in (1, 2, 3):
        problems.append(f"{key} {path}: zero_optimization.stage is {stage}; syncrl's save stage consolidates "
                        "ZeRO shards, so use stage 1, 2 or 3")
    if cfg.train.local_checkpoint_dir:
        problems += local_checkpoint_problems(cfg, stage, path)
    elif cfg.train.durable_every > 1:
        problems.append(f"train.durable_every is {cfg.train.durable_every} but train.local_checkpoint_dir is not set: "
                        "without node-local checkpoints every checkpoint is written to the run dir; set "
                        "train.local_checkpoint_dir, or train.durable_every=1")
    problems += precision_problems(ds, cfg, path)
    if cfg.tuning.train_graphs:
        problems += cuda_graph_problems(cfg, stage, path)
    if cfg.tuning.grad_norm == "flat":
        problems += flat_grad_norm_problems(ds, stage, path)
    problems += [f"{key} {path}: {p}" for p in deepspeed_key_problems(ds, cfg)]
    return problems


def precision_problems(ds: dict, cfg: RunConfig, ds_path: Path) -> list[str]:
    """With bf16 or fp16 on, DeepSpeed casts the model to that dtype and trains it there (its fp32
    copy is the optimizer's): the weights train writes, which save exports and generate samples
    from, are in it. A model.dtype that differs would fail only at save, after an iteration's work."""
    for key, dtype in (("bf16", "bfloat16"), ("bfloat16", "bfloat16"), ("fp16", "float16")):
        section = ds.get(key)
        if isinstance(section, dict) and section.get("enabled") is True and cfg.model.dtype != dtype:
            return [f"train.deepspeed_config {ds_path}: {key}.enabled is true, so DeepSpeed trains the model in "
                    f"{dtype}, but model.dtype is {cfg.model.dtype}: set model.dtype: {dtype}, or turn {key} off "
                    f"in the DeepSpeed config to train in {cfg.model.dtype}"]
    return []


def local_checkpoint_problems(cfg: RunConfig, zero_stage: int, ds_path: Path) -> list[str]:
    """Node-local checkpoints need save to export the weights as train holds them (one node's model
    states under ZeRO 1-2, the policy file train gathers under ZeRO-3), in the training dtype."""
    problems = []
    export = cfg.save.export_dtype
    if export not in ("model", cfg.model.dtype):
        problems.append(f"train.local_checkpoint_dir is set, so save exports the weights in the training dtype "
                        f"(model.dtype {cfg.model.dtype}), not save.export_dtype {export}: set save.export_dtype: model")
    base = os.path.expandvars(cfg.train.local_checkpoint_dir)
    if "$" not in base and not os.path.isabs(os.path.expanduser(base)):
        problems.append(f"train.local_checkpoint_dir {cfg.train.local_checkpoint_dir!r} must be an absolute path "
                        "on each node (/dev/shm/syncrl, a local disk, or $SLURM_TMPDIR)")
    return problems


def cuda_graph_problems(cfg: RunConfig, zero_stage: int, ds_path: Path) -> list[str]:
    """A captured layer reads its weights at fixed addresses and runs as one piece."""
    problems = []
    if zero_stage == 3:
        problems.append(f"tuning.train_graphs is on but {ds_path} uses ZeRO stage 3, which gathers each layer's weights "
                        "while it runs: use ZeRO stage 1 or 2, or set tuning.train_graphs=false")
    if cfg.model.gradient_checkpointing:
        problems.append("tuning.train_graphs is on with model.gradient_checkpointing, which reruns each layer's forward "
                        "in its backward: set one of them to false")
    return problems


def flat_grad_norm_problems(ds: dict, zero_stage: int, ds_path: Path) -> list[str]:
    """tuning.grad_norm: flat takes the norm inside ZeRO 1-2's step, on the partition held on the device."""
    offload = optimizer_offloaded(ds)
    if zero_stage in (1, 2) and not offload:
        return []
    return [f"tuning.grad_norm is flat, which takes the norm in ZeRO stage 1 or 2's step without optimizer offload; "
            f"{ds_path} has stage {zero_stage}{' with offload_optimizer' if offload else ''}: "
            "set tuning.grad_norm=deepspeed"]


def deepspeed_key_problems(ds: dict, cfg: RunConfig) -> list[str]:
    """Keys DeepSpeed's own config classes reject, or never read (DeepSpeed ignores unknown top-level keys)."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        from deepspeed.runtime.config import DeepSpeedConfig

    # World size 1: outside a process group DeepSpeed checks train_batch_size against one rank.
    full = {**ds, **deepspeed_derived(cfg.train, world_size=1)}
    tracked = _TrackingDict(full)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            DeepSpeedConfig(tracked)
    except Exception as e:  # DeepSpeed raises pydantic ValidationErrors and plain asserts
        first = str(e).strip().splitlines()
        detail = " ".join(line.strip() for line in first[:3])
        return [f"DeepSpeed rejects this config: {detail}"]
    unknown = sorted(set(ds) - tracked.seen)
    return [f"key '{k}' is not a DeepSpeed setting (DeepSpeed would silently ignore it): remove or fix it"
            for k in unknown]


class _TrackingDict(dict):
    """Records which top-level keys DeepSpeed's config parser looks at."""

    def __init__(self, *args):
        super().__init__(*args)
        self.seen: set = set()

    def get(self, key, *default):
        self.seen.add(key)
        return super().get(key, *default)

    def __getitem__(self, key):
        self.seen.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.seen.add(key)
        return super().__contains__(key)


def _check_sizes(cfg: RunConfig, world: int) -> list[str]:
    problems = []
    d, g = cfg.data, cfg.generate
    if d.prompts_per_iteration % world:
        lo = max(world, d.prompts_per_iteration // world * world)
        problems.append(f"data.prompts_per_iteration ({d.prompts_per_iteration}) is not divisible by the {world} "
                        f"ranks: shards would be uneven; use {lo} or {lo + world}")
    if g.batch_size % g.attempts:
        problems.append(f"generate.batch_size ({g.batch_size}) is not a multiple of generate.attempts "
                        f"({g.attempts}): each generate call samples whole groups; use "
                        f"{max(g.attempts, g.batch_size // g.attempts * g.attempts)}")
    return problems


def _check_resources(cfg: RunConfig, launcher: str, env) -> list[str]:
    s = cfg.slurm
    kind, nodes = launcher_kind(launcher, env), _allocation_nodes(env)
    if kind == "srun" and nodes is not None:
        problems = []
        if s.nodes > nodes:
            problems.append(f"slurm.nodes ({s.nodes}) exceeds the allocation's {nodes} nodes: "
                            f"sbatch --nodes={s.nodes}, or lower slurm.nodes")
        cpus = first_int(allocation("cpus_on_node", env))
        need = s.tasks_per_node * max(s.cpus_per_task, 1)
        if cpus and need > cpus:
            problems.append(f"slurm.tasks_per_node x cpus_per_task ({need}) exceeds the {cpus} CPUs per node of "
                            "this allocation: lower them or ask for bigger nodes")
        gpus = first_int(allocation("gpus_on_node", env))
        if gpus is not None and s.gpus_per_task * s.tasks_per_node > gpus:
            problems.append(f"slurm.tasks_per_node x gpus_per_task ({s.gpus_per_task * s.tasks_per_node}) exceeds "
                            f"the {gpus} GPUs per node of this allocation")
        return problems
    if kind == "srun":
        return []  # submitted from outside an allocation: checked again when the job starts
    gpus = _local_gpu_count()
    if gpus and cfg.ranks > gpus:
        return [f"ranks ({cfg.ranks}) exceeds the {gpus} GPUs of this machine: set ranks={gpus}"]
    return []


def first_int(value) -> int | None:
    """The leading integer of a SLURM count such as `48(x2)` or `4,4`; None if there is none."""
    try:
        return int(str(value).split("(")[0].split(",")[0])
    except (TypeError, ValueError):
        return None


def _local_gpu_count() -> int:
    if not shutil.which("nvidia-smi"):
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in out.splitlines())
