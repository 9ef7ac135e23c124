"""The long-lived generation engines of generate.persistent, as the coordinator keeps them.

One job step (stages/engine.py, one task per generate rank) runs from the first generate that needs
it to the end of the run. Before every generate attempt, and before an early-started generate's
turn, the coordinator checks that the step is still running and starts a new one when it is not: a
dead engine costs the attempt it was serving, never the run. A generate attempt that failed gets
new engines for the next, so that a hung one cannot fail it again. Torch-free.
"""

from __future__ import annotations

import logging

from stages.runtime.paths import RunPaths

log = logging.getLogger("syncrl.coordinator")


class Engines:
    def __init__(self, cfg, launcher, paths: RunPaths):
        self.enabled = cfg.generate.backend == "vllm" and cfg.generate.persistent
        self.launcher = launcher
        self.paths = paths
        self.step = None
        self.started_at, self.attempt = None, 0

    def ensure(self, it: int, fresh: bool = False) -> None:
        """The engines are running (started now, with iteration `it`'s policy, if they were not, or
        if `fresh`)."""
        if not self.enabled or (self.step is not None and self.step.running() and not fresh):
            return
        if self.step is not None and fresh:
            log.info("iteration %d generation engines: replacing them after the failed attempt", it)
            self.stop()
        elif self.step is not None:
            result = self.step.wait(1)
            log.warning("the generation engines started at iteration %d have exited (exit codes %s): starting "
                        "them again; their logs: %s", self.started_at, sorted(set(result.returncodes.values())),
                        self.paths.logs(self.started_at, "engine", self.attempt))
        self._forget_addresses()
        self.attempt = self.paths.attempts_so_far(it, "engine") + 1
        self.step, self.started_at = self.launcher.start(self.paths, it, "engine", self.attempt), it
        log.info("iteration %d generation engines starting (attempt %d on %d task(s)); they serve every generate "
                 "from now on", it, self.attempt, self.launcher.ntasks("engine"))

    def stop(self) -> None:
        if self.step is not None:
            self.step.cancel()
            self.step = None
            self._forget_addresses()

    def _forget_addresses(self) -> None:
        """An address left by an engine that is gone must not be mistaken for its successor's."""
        if self.paths.engines.is_dir():
            for f in self.paths.engines.iterdir():
                f.unlink(missing_ok=True)
