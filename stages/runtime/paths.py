"""The run directory's layout: the only channel between stages, so every path is named here once."""

from __future__ import annotations

import os
import re
from pathlib import Path

from stages.runtime.pipeline import MULTI_RANK_STAGES, STAGES  # noqa: F401 (re-exported: the layout's stage names)


class RunPaths:
    def __init__(self, run_dir: str | os.PathLike):
        self.root = Path(run_dir).resolve()

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def lock(self) -> Path:
        return self.root / ".coordinator.lock"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def models(self) -> Path:
        return self.root / "models"

    @property
    def base_model(self) -> Path:
        return self.models / "base"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def wandb_run_id(self) -> Path:
        """The W&B run's id, so that a requeued coordinator resumes the same W&B run."""
        return self.root / "wandb_run_id"

    def report(self, out: Path | None = None) -> tuple[Path, Path]:
        """`syncrl report`'s figure and table, in the run dir unless `out` is given."""
        folder = Path(out) if out is not None else self.root
        return folder / "report.png", folder / "report.md"

    def iteration(self, it: int) -> Path:
        return self.root / f"iter_{it:05d}"

    def stage_dir(self, it: int, stage: str) -> Path:
        return self.iteration(it) / stage

    def markers(self, it: int) -> Path:
        return self.iteration(it) / "markers"

    def shard(self, it: int, stage: str, rank: int) -> Path:
        return self.stage_dir(it, stage) / f"rank_{rank:05d}.jsonl"

    def train_set(self, it: int) -> Path:
        """Gather's output: the rows train learns from, with their advantages."""
        return self.stage_dir(it, "gather") / "train.jsonl"

    def gather_stats(self, it: int) -> Path:
        return self.stage_dir(it, "gather") / "stats.json"

    def train_curve(self, it: int) -> Path:
        """Train's loss curve: one line per optimizer step."""
        return self.stage_dir(it, "train") / "metrics.jsonl"

    def model(self, it: int) -> Path:
        return self.models / f"iter_{it:05d}"

    def checkpoint_tag(self, it: int) -> str:
        return f"iter_{it:05d}"

    def checkpoint_staging_tag(self, it: int) -> str:
        """Where train writes iteration `it`'s checkpoint before publishing it under checkpoint_tag."""
        return f".{self.checkpoint_tag(it)}.tmp"

    def persist_staging(self, it: int, checkpoint_id: str) -> Path:
        """Where the persist stage gathers the nodes' files of iteration `it` before publishing them."""
        return self.checkpoints / f".{self.checkpoint_tag(it)}.persist-{checkpoint_id}.tmp"

    def snapshot_layout(self, it: int, rank: int) -> Path:
        """The shapes and dtypes of the checkpoint state one rank's train copied to host memory
        (tuning.deferred_checkpoint): the next train prepares host memory laid out so beforehand."""
        return self.stage_dir(it, "train") / f"snapshot_layout.rank_{rank:05d}.json"

    def train_policy(self, it: int) -> Path:
        """The policy's weights as train wrote them for save (tuning.deferred_checkpoint: the
        checkpoint reaches the disk after train's marker); save removes it once it has exported."""
        return self.stage_dir(it, "train") / "policy.safetensors"

    def deferred_checkpoint_record(self, it: int) -> Path:
        """Train's record of the attempt whose checkpoint is written after its marker (its id)."""
        return self.stage_dir(it, "train") / "deferred_checkpoint.json"

    def local_copy_written(self, it: int, node: str) -> Path:
        """A node's note that it wrote its node-local copy of iteration `it`'s checkpoint after train's
        marker (the coordinator, which cannot see the nodes' storage, waits for every node's)."""
        return self.stage_dir(it, "train") / f"local_copy_written.{node}.json"

    def local_checkpoint_record(self, it: int) -> Path:
        """Train's record of a node-local checkpoint (its attempt's id): an output of train, so that
        save and persist see a redone train as changed input even when its loss curve is the same."""
        return self.stage_dir(it, "train") / "local_checkpoint.json"

    def vllm_cache(self, rank: int) -> Path:
        """generate rank `rank`'s vLLM caches (its VLLM_CACHE_ROOT) and the link its engine loads each
        export through, kept across iterations (stages/rl/vllm_sampler.py)."""
        return self.root / "cache" / "vllm" / f"rank_{rank:05d}"

    @property
    def engines(self) -> Path:
        """Where long-lived generation engines (generate.persistent) say where they listen."""
        return self.root / "engines"

    def engine_address(self, rank: int) -> Path:
        return self.engines / f"rank_{rank:05d}.json"

    def stage_state(self, it: int, stage: str) -> Path:
        """The coordinator's record of a stage in flight or failed (state, attempt, ranks, hosts)."""
        return self.markers(it) / f"{stage}.state.json"

    def failure_record(self, it: int, stage: str, rank: int) -> Path:
        """What a failed rank wrote about its failure, for the coordinator's summary."""
        return self.markers(it) / f"{stage}.rank_{rank:05d}.failed"

    def failure_records(self, it: int, stage: str) -> list[Path]:
        return sorted(self.markers(it).glob(f"{stage}.rank_*.failed"))

    def logs(self, it: int, stage: str, attempt: int) -> Path:
        return self.root / "logs" / f"iter_{it:05d}" / stage / f"attempt_{attempt}"

    def rank_log(self, it: int, stage: str, attempt: int, rank: int) -> Path:
        return self.logs(it, stage, attempt) / f"rank_{rank:05d}.log"

    def attempts_so_far(self, it: int, stage: str) -> int:
        """Highest attempt number with a log folder (0 if the stage never started)."""
        return max(self.attempts(it, stage), default=0)

    def attempts(self, it: int, stage: str) -> list[int]:
        """Attempt numbers with a log folder, in order."""
        return numbered(self.root / "logs" / f"iter_{it:05d}" / stage, "attempt_")

    def iterations_present(self) -> list[int]:
        return numbered(self.root, "iter_")


def numbered(parent: Path, prefix: str, digits: str = r"\d+") -> list[int]:
    """N of each PREFIX<N> folder in `parent`, sorted. Anything else a user left there (iter_00003.bak,
    a copy, a file) is not syncrl's and is ignored."""
    pattern = re.compile(re.escape(prefix) + f"({digits})")
    if not parent.is_dir():
        return []
    return sorted(int(m[1]) for p in parent.iterdir() if (m := pattern.fullmatch(p.name)) and p.is_dir())
