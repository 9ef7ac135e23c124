"""What a run will hold on disk, and what a rank's deferred checkpoint will hold in host memory, from
the model's size alone, before it starts (`syncrl check`).

Per iteration train writes a DeepSpeed checkpoint and save exports an HF model; save.keep_checkpoints
and save.keep_models say how many of each stay, and a new checkpoint is written beside the kept ones
before the oldest goes. Torch-free: the parameters come from the preset's dimensions or from the
safetensors headers under model.path.
"""

from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from stages.runtime import local_checkpoints, memory, safetensors_header
from stages.runtime.paths import RunPaths
from stages.runtime.presets import PRESETS, VOCAB_SIZE

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Adam's two moments in fp32, per parameter, in every ZeRO stage's checkpoint.
ADAM_MOMENT_BYTES = 8
# An fp32 master copy beside 16-bit weights (fp32 training updates the weights themselves).
MASTER_BYTES = 4


def parameters(model_path: str, preset: str) -> int | None:
    """The run's base model's parameters: summed from the safetensors headers under `model_path`,
    else from the built-in `preset`'s dimensions; None where neither can be read here."""
    if model_path:
        files = sorted(Path(model_path).expanduser().glob("*.safetensors"))
        layouts = [safetensors_header.layout(f) for f in files]
        if not files or any(lay is None for lay in layouts):
            return None
        return sum(math.prod(shape) for lay in layouts for _, shape in lay.values())
    dims = PRESETS.get(preset)
    return None if dims is None else llama_parameters(dims, VOCAB_SIZE)


def llama_parameters(dims: dict, vocab: int, tied: bool = True) -> int:
    """A Llama decoder's parameters (no biases): per layer the q and o projections, k and v at the
    K/V heads' width, the gated MLP's three matrices and two norms; the embedding (and the output
    head where untied) and the final norm."""
    d, layers, inter = dims["hidden_size"], dims["num_hidden_layers"], dims["intermediate_size"]
    heads = dims["num_attention_heads"]
    kv = dims.get("num_key_value_heads") or heads
    kv_width = kv * (d // heads)
    block = 2 * d * d + 2 * d * kv_width + 3 * d * inter + 2 * d
    return layers * block + vocab * d * (1 if tied else 2) + d


# The part a node's share of train.local_checkpoint_dir's checkpoints is listed under.
NODE_LOCAL = "node-local checkpoints"


@dataclass
class Footprint:
    """Bytes the run holds at its peak, by what holds them; parts() names the folder each is written
    in, so that a part on another filesystem (checkpoints/ a link to node memory) counts against its own."""
    checkpoint: int  # one DeepSpeed checkpoint (every rank's files)
    checkpoints_held: int  # the kept ones and the one being written
    model: int  # one exported model
    models_held: int
    base: int  # the built-in base model, written into the run dir (0 with model.path)
    node_local: int = 0  # this node's share of train.local_checkpoint_dir's checkpoints (0: not counted)
    node_local_dir: Path | None = None

    def parts(self, root: Path) -> list[tuple[str, int, Path]]:
        return [("checkpoints", self.checkpoint * self.checkpoints_held, root / "checkpoints"),
                ("models", self.model * self.models_held, root / "models"),
                ("base model", self.base, root / "base_model"),
                (NODE_LOCAL, self.node_local, self.node_local_dir or root)]


def footprint(cfg, params: int, nodes: int | None = None) -> Footprint:
    """`nodes`: how many nodes share train.local_checkpoint_dir's checkpoints, where this process can
    see a node's storage (on a node of the run); None: not counted."""
    train_bytes = DTYPE_BYTES[cfg.model.dtype]
    export = cfg.save.export_dtype
    master = MASTER_BYTES if train_bytes < 4 else 0
    models = cfg.save.keep_models or cfg.iterations
    checkpoint = params * (train_bytes + master + ADAM_MOMENT_BYTES)
    local = bool(cfg.train.local_checkpoint_dir and nodes)
    return Footprint(checkpoint=checkpoint,
                     checkpoints_held=min(cfg.save.keep_checkpoints, cfg.iterations) + 1,
                     model=params * DTYPE_BYTES[cfg.model.dtype if export == "model" else export],
                     models_held=min(models, cfg.iterations),
                     base=0 if cfg.model.path else params * train_bytes,
                     # A node keeps its share of the last checkpoint and writes the next one beside it.
                     node_local=2 * checkpoint // nodes if local else 0,
                     node_local_dir=local_checkpoints.this_node(cfg.train.local_checkpoint_dir,
                                                                RunPaths(cfg.run_dir)) if local else None)


def filesystem_of(path: Path) -> Path:
    """The nearest folder that exists at or above `path` (a link followed): where its files would go."""
    path = Path(path).expanduser().absolute()
    return next(p for p in [path, *path.parents] if p.exists())


def held_bytes(folder: Path) -> int:
    """Bytes of the files under `folder`, each hard-linked file once (save links train's weights)."""
    seen, total = set(), 0
    for dirpath, _, names in os.walk(folder):
        for name in names:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


def shortfalls(cfg, fp: Footprint) -> list[tuple[Path, int, int, list[tuple[str, int]]]]:
    """For each filesystem the run writes to whose free space (plus what the run already holds
    there, which pruning replaces) is below what the run will hold there: (the folder, bytes needed,
    bytes it can have, the parts and their bytes)."""
    root = Path(cfg.run_dir).expanduser()
    groups: dict[int, list] = {}
    for name, size, folder in fp.parts(root):
        if size:
            existing = filesystem_of(folder)
            groups.setdefault(os.stat(existing).st_dev, []).append((name, size, folder, existing))
    out = []
    for parts in groups.values():
        need = sum(size for _, size, _, _ in parts)
        existing = parts[0][3]
        have = shutil.disk_usage(existing).free + sum(held_bytes(folder) for _, _, folder, _ in parts
                                                      if folder.is_dir())
        if need > have:
            out.append((existing, need, have, [(name, size) for name, size, _, _ in parts]))
    return out


def why_not_deferred(cfg) -> str | None:
    """Why train must write this run's checkpoint before its marker (None: it may defer it,
    stages/rl/deferred_checkpoint.py)."""
    if not cfg.tuning.deferred_checkpoint:
        return "tuning.deferred_checkpoint is off"
    if cfg.save.export_dtype not in ("model", cfg.model.dtype):
        return (f"save.export_dtype is {cfg.save.export_dtype}, not the training dtype {cfg.model.dtype}: save "
                f"exports the fp32 master weights, which only the checkpoint holds")
    return None


@dataclass
class SnapshotShortfall:
    """Rank 0's snapshot of a deferred checkpoint against its host-memory budget, on a node of the run."""
    snapshot: int  # bytes: the model states (ZeRO 1-2) and this rank's optimizer partition
    budget: int
    in_memory: bool  # the checkpoint folder is in tmpfs: each file written there takes memory too
    available_needed: int  # the node's available memory at which the snapshot would fit


def snapshot_shortfall(cfg, params: int, world: int, nodes: int, zero_stage: int, offload: bool,
                       available: int) -> SnapshotShortfall | None:
    """Where a deferred checkpoint's largest snapshot (rank 0's) will not fit its host-memory budget,
    so that train writes it before its marker every iteration: on the critical path. `available`: the
    node's available memory now; the run's kept checkpoints come out of it where they are in tmpfs.
    None where it fits, or nothing is deferred (why_not_deferred), or the optimizer state already
    lives in host memory (`offload`: a snapshot then copies nothing)."""
    if why_not_deferred(cfg) or offload:
        return None
    fp = footprint(cfg, params)
    folder = Path(cfg.train.local_checkpoint_dir) if cfg.train.local_checkpoint_dir else \
        Path(cfg.run_dir).expanduser() / "checkpoints"
    in_memory = memory.memory_backed(filesystem_of(folder))
    train_bytes = DTYPE_BYTES[cfg.model.dtype]
    optimizer = fp.checkpoint - params * train_bytes  # master weights and moments, partitioned over the ranks
    snapshot = optimizer // max(1, world) + (params * train_bytes if zero_stage < 3 else 0)
    ranks_per_node = max(1, world // max(1, nodes))
    kept = fp.checkpoint * min(cfg.save.keep_checkpoints, cfg.iterations) // max(1, nodes) if in_memory else 0
    budget = memory.snapshot_budget_bytes(max(0, available - kept), ranks_per_node, in_memory)
    if snapshot <= budget:
        return None
    needed = int(snapshot * (2 if in_memory else 1) * ranks_per_node / memory.HOST_MEMORY_SHARE) + kept
    return SnapshotShortfall(snapshot=snapshot, budget=budget, in_memory=in_memory, available_needed=needed)
