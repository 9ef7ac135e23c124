"""The run ledger: completion markers, stage state files, failure records, input fingerprints, and
the atomic writes they all use. The coordinator, status, tail, report, gather and the stage harness
read and write the run's bookkeeping through this module only (paths.py names the files).

A marker is written last, after every output it lists has been published by atomic rename, so a
marker's presence means its outputs are whole. A stage is skipped only when its marker matches the
current config hash and input fingerprint, and its listed outputs are still there at their sizes.
Torch-free.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

from stages.runtime import pipeline
from stages.runtime.paths import RunPaths, numbered

# Files above this are recorded by size only: hashing a 140 GB checkpoint on every marker would cost
# minutes of allocation time for little safety over the size check.
HASH_LIMIT_BYTES = 64 << 20



def write_text_atomic(path: Path, text: str, mode: int | None = None) -> None:
    write_bytes_atomic(path, text.encode(), mode)


def write_bytes_atomic(path: Path, data: bytes, mode: int | None = None) -> None:
    """`mode`: the file's permissions, set before anything is written (a secret is never readable)."""
    with _replacing(path) as tmp, open(tmp, "wb") as f:
        if mode is not None:
            os.chmod(tmp, mode)
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


@contextlib.contextmanager
def _replacing(path: Path):
    """Yields a temporary name beside `path`, renamed over it when the block ends. An exception (a
    SIGTERM that unwinds the coordinator, say) removes the temporary file: nothing half-written stays."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    try:
        yield tmp
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)


def write_json_atomic(path: Path, obj) -> None:
    write_text_atomic(path, json.dumps(obj, indent=1, sort_keys=True) + "\n")


def read_json(path: Path):
    return json.loads(Path(path).read_text())


def file_record(path: Path) -> dict:
    """Size, and sha256 for files small enough to hash, of one output."""
    path = Path(path)
    size = path.stat().st_size
    rec = {"size": size}
    if size <= HASH_LIMIT_BYTES:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        rec["sha256"] = h.hexdigest()
    return rec


def outputs_record(paths: list[Path], root: Path) -> dict:
    """Records for files and (recursively) directories, keyed by path relative to the run dir."""
    out = {}
    for p in paths:
        p = Path(p)
        files = sorted(x for x in p.rglob("*") if x.is_file()) if p.is_dir() else [p]
        for f in files:
            out[str(f.relative_to(root))] = file_record(f)
    return out


def marker_name(stage: str, rank: int | None = None) -> str:
    return f"{stage}.done" if rank is None else f"{stage}.rank_{rank:05d}.done"


def marker_path(paths: RunPaths, it: int, stage: str, rank: int | None = None) -> Path:
    """Where the marker of `stage` (of one rank, or the stage's own with rank None) is written."""
    return paths.markers(it) / marker_name(stage, rank)


def gpus_free_path(paths: RunPaths, it: int, stage: str) -> Path:
    """The coordinator's note to `stage` of iteration `it`, started early, that the GPU stages before
    it have exited and what it resumes from is published: it may set up on the GPUs before its turn
    (pipeline.Stage.sets_up_early). Not named `stage.*`: it is no trace of the stage having run."""
    return paths.markers(it) / f"gpus_free_for_{stage}.json"


def stage_started(paths: RunPaths, it: int, stage: str) -> bool:
    """Whether `stage` of iteration `it` has left anything in the ledger (a marker, state or record)."""
    return any(paths.markers(it).glob(f"{stage}.*"))


def write_marker(paths: RunPaths, it: int, stage: str, rank: int | None, *, attempt: int, start: float,
                 config_hash: str, inputs: str, outputs: dict, extra: dict | None = None) -> dict:
    marker = {
        "stage": stage,
        "iteration": it,
        "rank": rank,
        "host": socket.gethostname(),
        "attempt": attempt,
        "start": start,
        "end": time.time(),
        "config_hash": config_hash,
        "inputs": inputs,
        "outputs": outputs,
    }
    marker.update(extra or {})
    write_json_atomic(paths.markers(it) / marker_name(stage, rank), marker)
    return marker


def read_marker(paths: RunPaths, it: int, stage: str, rank: int | None = None) -> dict | None:
    try:
        return read_json(marker_path(paths, it, stage, rank))
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None  # unreadable marker = not done; the stage is redone


def rank_markers_present(paths: RunPaths, it: int, stage: str) -> set[int]:
    """Ranks whose per-rank marker exists, from one listing of the marker directory."""
    d = paths.markers(it)
    prefix = f"{stage}.rank_"
    try:
        names = os.listdir(d)
    except FileNotFoundError:
        return set()
    return {int(n[len(prefix):len(prefix) + 5]) for n in names if n.startswith(prefix) and n.endswith(".done")}


def input_fingerprint(paths: RunPaths, it: int, stage: str, base_model: str) -> str:
    """Hash of what `stage` of iteration `it` reads: its upstream stage markers' outputs."""
    h = hashlib.sha256()
    for dep, offset in pipeline.stage(stage).reads:
        dep_it = it + offset
        if dep_it < 0:
            h.update(f"base:{base_model}".encode())
            continue
        m = read_marker(paths, dep_it, dep)
        h.update(f"{dep}@{dep_it}:".encode())
        h.update(json.dumps(m["outputs"] if m else None, sort_keys=True).encode())
    return h.hexdigest()[:16]


def marker_problem(paths: RunPaths, marker: dict | None, config_hash: str, inputs: str) -> str | None:
    """Why a marker does not count as done (None when it does)."""
    if marker is None:
        return "no marker"
    if marker.get("config_hash") != config_hash:
        return "config changed"
    if marker.get("inputs") != inputs:
        return "inputs changed (an upstream stage was redone)"
    return outputs_problem(paths, marker)


def outputs_problem(paths: RunPaths, marker: dict, pruned_ok: bool = True) -> str | None:
    """Why the outputs a marker lists are not all there at their recorded sizes (None when they are).
    pruned_ok: outputs that retention may remove (the marker's `prunable`) may be gone."""
    prunable = tuple(marker.get("prunable", ())) if pruned_ok else ()
    for rel, rec in marker.get("outputs", {}).items():
        p = paths.root / rel
        try:
            size = p.stat().st_size
        except FileNotFoundError:
            if rel.startswith(prunable) and prunable:
                continue  # removed by retention (save.keep_*), which is expected
            return f"output {rel} is missing"
        if size != rec["size"]:
            return f"output {rel} changed size ({rec['size']} -> {size} bytes)"
    return None


def need_problem(paths: RunPaths, it: int, need, rank: int, world: int) -> str | None:
    """Why the outputs a stage needs (a pipeline.Need, for iteration `it` and this `rank`) are not
    there whole; `world`: the ranks of the needed stage, for scope "ranks"."""
    dep_it = it + need.offset
    if need.scope == "ranks":
        missing = sorted(set(range(world)) - rank_markers_present(paths, dep_it, need.stage))
        if missing:
            return (f"the {need.stage} markers of rank(s) {','.join(map(str, missing))} are missing "
                    f"(expected {world} ranks): those ranks did not finish")
        found = [(r, read_marker(paths, dep_it, need.stage, r)) for r in range(world)]
    else:
        r = rank if need.scope == "rank" else None
        found = [(r, read_marker(paths, dep_it, need.stage, r))]
    for r, marker in found:
        name = marker_name(need.stage, r)
        if marker is None:
            return f"its marker {name} is missing or unreadable"
        problem = outputs_problem(paths, marker, pruned_ok=False)
        if problem:
            return f"{problem} (against {name})"
    return None


def clear_stage(paths: RunPaths, it: int, stage: str) -> None:
    """Remove a stage's markers (stage-level first, so a crash midway never leaves it looking done)."""
    marker_path(paths, it, stage).unlink(missing_ok=True)
    for rank in rank_markers_present(paths, it, stage):
        marker_path(paths, it, stage, rank).unlink(missing_ok=True)
    for failed in paths.failure_records(it, stage):
        failed.unlink(missing_ok=True)


def remove_partial_writes(paths: RunPaths, it: int, stage: str) -> list[Path]:
    """Remove the temporary files of a stage's ledger writes that never finished (a rank killed while
    it wrote its failure record or marker): called before an attempt starts, when none of the stage's
    processes is writing."""
    found = sorted(paths.markers(it).glob(f".{stage}.*.tmp.*")) if paths.markers(it).is_dir() else []
    for p in found:
        p.unlink(missing_ok=True)
    return found


def write_jsonl_atomic(path: Path, rows) -> int:
    """Write rows as JSON lines under a temporary name, then rename; returns the row count."""
    n = 0
    with _replacing(path) as tmp, open(tmp, "w") as f:
        for row in rows:
            f.write(json.dumps(row, separators=(",", ":")) + "\n")
            n += 1
        f.flush()
        os.fsync(f.fileno())
    return n


def read_jsonl(path: Path) -> list[dict]:
    rows = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.endswith("\n"):
                raise ValueError(f"{path}:{lineno}: last line is cut short (file truncated)")
            rows.append(json.loads(line))
    return rows


def publish_dir(staging: Path, final: Path) -> None:
    """Rename the complete directory `staging` to `final` (atomic on one filesystem); an older
    `final` (a rerun of the stage) is moved aside first and removed after."""
    old = final.with_name(f".{final.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    staging.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def publish_new_dir(out_dir: Path, fill) -> Path:
    """Publish a new directory: fill(staging) writes it into a staging directory of this process's own
    beside out_dir (two writers at once never share one), which is then renamed to out_dir in one step.
    out_dir must not exist; FileExistsError names it otherwise, also where another writer published
    first. Nothing staged is left behind."""
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} already exists: choose another directory, or remove it first")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        fill(tmp)
        try:
            tmp.rename(out_dir)
        except OSError:
            if out_dir.exists():  # another writer published first
                raise FileExistsError(f"{out_dir} already exists (written by another process at the same time): "
                                      f"choose another directory, or remove it first") from None
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def prune_iterations(paths: RunPaths, parent: Path, keep: int, upto: int) -> list[str]:
    """Remove parent/iter_N folders beyond the newest `keep` of those with N <= `upto` (retention:
    never one newer than the iteration pruning); returns them relative to the run dir."""
    dirs = [parent / f"iter_{i:05d}" for i in numbered(parent, "iter_") if i <= upto]
    removed = []
    for p in dirs[:-keep]:
        shutil.rmtree(p)
        removed.append(str(p.relative_to(paths.root)))
    return removed


# Size of a stage's state file (JSON padded with spaces): room to rewrite it in place on a full disk.
STATE_FILE_BYTES = 1024
# Fields of a rank marker that belong to the rank, not to the stage marker that merges them.
_RANK_FIELDS = ("outputs", "prunable", "stage", "iteration", "rank", "host", "attempt", "start", "end",
                "config_hash", "inputs")


def record_stage_done(paths: RunPaths, it: int, stage: str, ranks: int, *, attempt: int, start: float,
                      config_hash: str, inputs: str, extra: dict | None = None) -> dict:
    """The stage marker, merged from its `ranks` rank markers (outputs of all, the first rank's
    figures, the worst rank's peak memory) and the coordinator's `extra`, written once every rank is
    done; its state file goes."""
    found = [read_marker(paths, it, stage, r) for r in range(ranks)]
    outputs, prunable = {}, []
    for m in found:
        outputs.update(m["outputs"])
        prunable += m.get("prunable", [])
    summary = {k: v for k, v in found[0].items() if k not in _RANK_FIELDS}
    memory = {k: max(m.get("memory", {}).get(k, 0) for m in found) for k in found[0].get("memory", {})}
    marker = write_marker(
        paths, it, stage, None, attempt=attempt, start=start, config_hash=config_hash, inputs=inputs,
        outputs=outputs, extra={**summary, "memory": memory, "world_size": ranks, "attempts": attempt,
                                "hosts": sorted({m["host"] for m in found}), "prunable": sorted(set(prunable)),
                                "duration_s": time.time() - start, **(extra or {})})
    paths.stage_state(it, stage).unlink(missing_ok=True)
    return marker


def write_stage_state(paths: RunPaths, it: int, stage: str, record: dict) -> None:
    """The stage's state file (running, failed), for `syncrl status`. A full disk must not hide a
    failure: the file is padded to a fixed size, so that when a new file cannot be written the old
    one is overwritten in place, in the space it holds. Raises the first OSError when neither works."""
    path = paths.stage_state(it, stage)
    text = json.dumps(record)
    text = text.ljust(max(STATE_FILE_BYTES, len(text)))
    try:
        write_text_atomic(path, text)
        return
    except OSError as e:
        first = e
    try:
        with open(path, "r+") as f:
            f.write(text)
            f.truncate()
    except OSError:
        raise first from None


def read_stage_state(paths: RunPaths, it: int, stage: str) -> dict | None:
    """The stage's state file, or None when there is none (or it is unreadable)."""
    try:
        return read_json(paths.stage_state(it, stage))
    except (FileNotFoundError, ValueError):
        return None


def write_failure_record(paths: RunPaths, it: int, stage: str, rank: int, record: dict) -> None:
    write_json_atomic(paths.failure_record(it, stage, rank), record)


def read_failure_record(paths: RunPaths, it: int, stage: str, rank: int, attempt: int) -> dict | None:
    """What `rank` wrote about its failure in `attempt` (None if it wrote nothing for that attempt)."""
    try:
        record = read_json(paths.failure_record(it, stage, rank))
    except (FileNotFoundError, ValueError):
        return None
    return record if record.get("attempt") == attempt else None
