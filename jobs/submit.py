"""`syncrl submit CONFIG`: submit the coordinator from a login node through submitit.

The job runs the coordinator once on the first node of its allocation; the coordinator issues its
own srun steps. On preemption or near the time limit submitit requeues the job, and the restarted
coordinator resumes from the markers. The config is frozen into the run dir before submission, so
bad input fails here, not after the job has waited in the queue.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import submitit

from stages.runtime.config import RunConfig
from stages.runtime.paths import RunPaths

log = logging.getLogger("syncrl.submit")


class CoordinatorJob(submitit.helpers.Checkpointable):
    """The callable submitit runs in the allocation; checkpoint() (inherited) resubmits it unchanged,
    which is all a requeue needs because the run dir holds the state."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir

    def __call__(self) -> str:
        from jobs.coordinator import run, setup_coordinator_logging
        from stages.runtime.config import ConfigError

        setup_coordinator_logging()
        try:
            code = run(str(RunPaths(self.run_dir).config), [], "srun")
        except ConfigError as e:  # one message, not a traceback, in the job log
            raise RuntimeError(f"syncrl run refused the run: {e}") from None
        if code != 0:
            raise RuntimeError(f"syncrl run exited with {code}: see the job log and {self.run_dir}/logs "
                               f"(syncrl status {self.run_dir})")
        return self.run_dir


def submit(cfg: RunConfig) -> submitit.Job:
    s = cfg.slurm
    # Requeues on time limit are how a week-long run spans many jobs: allow plenty.
    executor = submitit.AutoExecutor(folder=Path(cfg.run_dir) / "submitit" / "%j", cluster="slurm",
                                     slurm_max_num_timeout=1000)
    params = dict(
        name=s.job_name,
        timeout_min=s.time_min,
        nodes=s.submit_nodes,
        tasks_per_node=1,
        slurm_exclusive=True,
        # submitit starts its callable as one srun task per allocated task; one coordinator is
        # wanted, on the first node (the stage steps it launches span all nodes).
        slurm_srun_args=["--nodes=1", "--ntasks=1"],
        slurm_setup=[f"cd {Path.cwd()}", "source slurm/env.sh"] if Path("slurm/env.sh").is_file() else [],
    )
    if s.partition:
        params["slurm_partition"] = s.partition
    if s.account:
        params["slurm_account"] = s.account
    if s.gpus_per_node:
        params["slurm_gpus_per_node"] = s.gpus_per_node
    executor.update_parameters(**params)
    job = executor.submit(CoordinatorJob(cfg.run_dir))
    return job


def print_submitted(job, run_dir: str, out=sys.stdout) -> None:
    print(f"submitted job {job.job_id}; follow it with:\n  syncrl status {run_dir}\n  syncrl tail {run_dir} -f\n"
          f"  job log: {job.paths.stdout}", file=out)
