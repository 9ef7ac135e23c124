"""Node-local checkpoints (train.local_checkpoint_dir): where a node's copy lives, the record that
names the train attempt which wrote it, and which of its files the node carries to the durable copy.
The same record names the attempt of a checkpoint written after train's marker (deferred).

With the setting on, train writes each iteration's DeepSpeed checkpoint to fast storage on every
node (a node holds its own ranks' shards, and its first rank writes the model states as well)
instead of the shared run dir, and the persist stage copies the nodes' files to checkpoints/iter_I
while the next iteration's stages run. Resume and save read a node's copy when its record names
the train attempt whose marker they trust, and the durable copy otherwise. Torch-free.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from stages.runtime import markers, paced_writes
from stages.runtime.dist import node_name
from stages.runtime.paths import RunPaths, numbered

# Written into a checkpoint folder before it is published: which train attempt wrote it and its files.
RECORD = "syncrl-checkpoint.json"
# The file of the model's own weights (ZeRO 1 and 2 keep them whole in it; every node has one).
MODEL_STATES = "mp_rank_00_model_states.pt"


def root(local_dir: str, paths: RunPaths, node: str) -> Path | None:
    """This node's folder of the run's local checkpoints, or None when train.local_checkpoint_dir is off.

    Keyed by the run dir, so that two runs on one node never share it, and by the node's name, so
    that nodes of the test cluster (one host) never read each other's files.
    """
    if not local_dir:
        return None
    base = Path(os.path.expanduser(os.path.expandvars(local_dir)))
    key = hashlib.sha256(str(paths.root).encode()).hexdigest()[:12]
    return base / f"syncrl-{paths.root.name}-{key}" / node


def this_node(local_dir: str, paths: RunPaths) -> Path | None:
    """root() for the node this process runs on."""
    return root(local_dir, paths, node_name())


def recorded(paths: RunPaths, it: int) -> dict | None:
    """What train of iteration `it` recorded of its node-local checkpoint ({"id", "dir"}), or None
    when it wrote the run dir's checkpoints/ (or has no marker)."""
    return (markers.read_marker(paths, it, "train") or {}).get("local_checkpoint")


def nothing_to_persist(paths: RunPaths, it: int) -> str:
    """Persist's summary for an iteration whose train wrote the run dir's checkpoint itself."""
    return f"nothing to persist: train wrote checkpoints/{paths.checkpoint_tag(it)} to the run dir"


def deferred(paths: RunPaths, it: int) -> dict | None:
    """What train of iteration `it` recorded of a checkpoint it wrote after its marker
    (tuning.deferred_checkpoint: {"id", ...}), or None when it wrote it before (or has no marker)."""
    return (markers.read_marker(paths, it, "train") or {}).get("deferred_checkpoint")


def wrote_policy(paths: RunPaths, it: int) -> bool:
    """Whether train of iteration `it` wrote the policy's weights file for save (paths.train_policy):
    before a checkpoint written after its marker, and under ZeRO-3 with node-local checkpoints."""
    return bool(deferred(paths, it) or (recorded(paths, it) or {}).get("policy"))


def deferred_problem(paths: RunPaths, it: int) -> str | None:
    """Why the checkpoint train of iteration `it` wrote after its marker is not whole, as that
    attempt's: in checkpoints/, or with node-local checkpoints on every node by the nodes' notes
    (None when it is, or when train wrote it before its marker)."""
    recorded = deferred(paths, it)
    if recorded is None:
        return None
    if "nodes" not in recorded:
        return problem(paths.checkpoints / paths.checkpoint_tag(it), recorded["id"])
    notes = [markers.read_json(note) for note in paths.stage_dir(it, "train").glob("local_copy_written.*.json")]
    written = sorted(note["node"] for note in notes if note.get("id") == recorded["id"])
    if len(written) >= recorded["nodes"]:
        return None
    return (f"{recorded['nodes'] - len(written)} of {recorded['nodes']} node(s) have not written their node-local "
            f"copy of iteration {it}'s checkpoint (written: {', '.join(written) or 'none'})")


def note_written(paths: RunPaths, it: int, checkpoint_id: str) -> None:
    """This node's note that its node-local copy of iteration `it`'s checkpoint, written after
    train's marker, is whole (deferred_problem counts them)."""
    node = node_name()
    markers.write_json_atomic(paths.local_copy_written(it, node), {"id": checkpoint_id, "node": node})


def durable(it: int, every: int, iterations: int) -> bool:
    """Whether persist makes the durable copy of iteration `it`'s checkpoint (train.durable_every):
    every `every`th iteration's, and the run's last (a later job may run on other nodes)."""
    return (it + 1) % every == 0 or it == iterations - 1


def last_durable(paths: RunPaths, before: int) -> int:
    """The latest iteration before `before` whose checkpoint is in the run dir whole, or -1."""
    for it in sorted(numbered(paths.checkpoints, "iter_"), reverse=True):
        if it < before and read_record(paths.checkpoints / paths.checkpoint_tag(it)) is not None:
            return it
    return -1


class CheckpointGone(FileNotFoundError):
    """The checkpoint train resumes from is on no storage this rank can read: not on its node (the
    node was replaced or its storage cleared) and without a durable copy (train.durable_every). The
    coordinator, seeing it named in the rank's failure record, goes back to the iteration after
    the last durable copy (last_durable)."""


def write_record(folder: Path, checkpoint_id: str, iteration: int, node: str, run_dir: Path) -> dict:
    """Record the checkpoint's files (name and size) and the train attempt's id inside `folder`."""
    files = {f.name: f.stat().st_size for f in sorted(folder.iterdir()) if f.is_file() and f.name != RECORD}
    record = {"id": checkpoint_id, "iteration": iteration, "node": node, "run_dir": str(run_dir), "files": files}
    markers.write_json_atomic(folder / RECORD, record)
    return record


def read_record(folder: Path) -> dict | None:
    try:
        return markers.read_json(folder / RECORD)
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError, UnicodeDecodeError):
        return None


def problem(folder: Path, checkpoint_id: str) -> str | None:
    """Why `folder` cannot stand for the checkpoint train recorded as `checkpoint_id` (None when it can)."""
    record = read_record(folder)
    if record is None:
        return f"{folder} holds no complete checkpoint"
    if record.get("id") != checkpoint_id:
        return f"{folder} was written by another train attempt ({record.get('id')}, not {checkpoint_id})"
    for name, size in record["files"].items():
        try:
            if (folder / name).stat().st_size != size:
                return f"{folder / name} changed size"
        except FileNotFoundError:
            return f"{folder / name} is missing"
    return None


def carried_by(node_index: int, name: str) -> bool:
    """Whether the node at `node_index` carries file `name` into the durable copy: each node its
    ranks' shards (DeepSpeed's zero_pp_rank_* files), the first node the files every node holds."""
    return node_index == 0 or "zero_pp_rank_" in name


def missing_shards(names, ranks: int) -> list[int]:
    """Train ranks (of `ranks`) none of whose shard files is among `names`."""
    return [r for r in range(ranks) if not any(f"zero_pp_rank_{r}_" in n for n in names)]


def copy_durably(src: Path, dst: Path) -> None:
    """Copy one file onto its storage (the durable copy must survive the node), paced: the
    iteration's stages run beside the copy (stages/runtime/paced_writes.py)."""
    paced_writes.copy_paced(src, dst)


def prune(folder_root: Path, keep: int) -> list[str]:
    """Remove this node's local checkpoints of iterations other than `keep` (and staging left by a
    dead attempt)."""
    removed = []
    if not folder_root.is_dir():
        return removed
    for i in numbered(folder_root, "iter_"):
        if i != keep:
            shutil.rmtree(folder_root / f"iter_{i:05d}", ignore_errors=True)
            removed.append(f"iter_{i:05d}")
    for p in folder_root.glob(".iter_*"):
        shutil.rmtree(p, ignore_errors=True)
    return removed
