"""Per-iteration metrics: one line per completed stage in RUN_DIR/metrics.jsonl, and one W&B run per RL run.

The coordinator logs each stage's figures once the stage is done, reading them from the stage's
marker (gather's statistics cover every rank's completions). W&B gets them from this one process,
against an `iteration` axis so every stage's curves line up; the run id is kept in the run dir, so
a requeued or rerun coordinator resumes the same W&B run instead of starting a second one.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid

from stages.runtime.config import RunConfig, to_dict
from stages.runtime.markers import write_text_atomic
from stages.runtime.paths import RunPaths

log = logging.getLogger("syncrl.metrics")

# Marker fields that are bookkeeping, not measurements.
NOT_METRICS = {"iteration", "rank", "start", "end", "attempt", "attempts", "world_size", "config_hash", "inputs", "outputs",
               "prunable", "hosts", "host", "stage", "pruned"}


def stage_metrics(stage: str, marker: dict) -> dict:
    """Numeric figures of a stage marker, flattened to `stage/name` (gather's stats as `rollout/...`)."""
    out = {}

    def add(prefix, d):
        for k, v in d.items():
            if k in NOT_METRICS:
                continue
            if isinstance(v, dict):
                add(f"{prefix}{k}/", v)
            elif isinstance(v, (int, float)) and not isinstance(v, bool):
                out[f"{prefix}{k}"] = v

    add(f"{stage}/", {k: v for k, v in marker.items() if k != "stats"})
    if "stats" in marker:
        add("rollout/", marker["stats"])
    out[f"{stage}/retries"] = marker.get("attempts", 1) - 1
    return out


class MetricsLog:
    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.paths = RunPaths(cfg.run_dir)
        self._wandb = None
        self._wandb_failed = False

    def stage_done(self, it: int, stage: str, marker: dict) -> None:
        metrics = stage_metrics(stage, marker)
        with open(self.paths.metrics, "a") as f:
            f.write(json.dumps({"iteration": it, "stage": stage, "time": time.time(), **metrics}) + "\n")
        run = self._wandb_run()
        if run is not None:
            run.log({"iteration": it, **metrics})

    def close(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def _wandb_run(self):
        if self._wandb is not None or self._wandb_failed or not self.cfg.wandb.enabled:
            return self._wandb
        mode = self._mode()
        if mode == "disabled":
            self._wandb_failed = True
            return None
        try:
            import wandb
        except ImportError:
            log.warning("wandb is not installed: metrics go to %s only", self.paths.metrics)
            self._wandb_failed = True
            return None
        try:
            self._wandb = wandb.init(
                project=self.cfg.wandb.project, entity=self.cfg.wandb.entity or None, id=self.run_id(),
                resume="allow", dir=str(self.paths.root), name=self.paths.root.name, mode=mode,
                config=to_dict(self.cfg), settings=wandb.Settings(console="off", silent=True))
            self._wandb.define_metric("iteration")
            self._wandb.define_metric("*", step_metric="iteration")
        except Exception as e:  # noqa: BLE001 - a W&B outage must not stop training
            log.warning("W&B unavailable (%s): metrics go to %s only", e, self.paths.metrics)
            self._wandb_failed = True
        return self._wandb

    def _mode(self) -> str:
        mode = self.cfg.wandb.mode
        if mode != "auto":
            return mode
        if os.environ.get("WANDB_MODE"):
            return os.environ["WANDB_MODE"]
        return "online" if os.environ.get("WANDB_API_KEY") else "offline"

    def run_id(self) -> str:
        """The W&B run id of this RL run, created once and kept in the run dir."""
        path = self.paths.wandb_run_id
        if not path.is_file():
            write_text_atomic(path, uuid.uuid4().hex[:12] + "\n")
        return path.read_text().strip()
