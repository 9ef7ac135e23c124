"""The local two-node SLURM cluster (slurm/local_cluster.sh) works for real: placement on both nodes,
a cross-node torch.distributed (gloo) job launched the way syncrl launches training, and scancel.

Needs the ``slurm_cluster`` fixture from tests/slurm_fixture.py (starts the cluster if needed).
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.slurm_fixture import job_state, pid_gone, run, wait_for


def write_script(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


@pytest.mark.slurm
def test_srun_places_one_task_on_each_node(slurm_cluster):
    proc = run(["srun", "--nodes=2", "--ntasks-per-node=1", "--time=1", "hostname"], timeout=60)
    assert sorted(proc.stdout.split()) == sorted(slurm_cluster.nodes)


ALLREDUCE_PY = """\
import datetime, os, socket
import torch
import torch.distributed as dist

rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
dist.init_process_group(
    "gloo",
    init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
    rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60),
)
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
print(f"RESULT rank={rank} world={world} host={socket.gethostname()} sum={t.item()}", flush=True)
dist.destroy_process_group()
"""


@pytest.mark.slurm
def test_sbatch_gloo_allreduce_across_both_nodes(slurm_cluster, tmp_path):
    (tmp_path / "allreduce.py").write_text(ALLREDUCE_PY)
    out_dir = tmp_path / "out"
    out_dir.mkdir()  # --output directories must exist before the job starts, or output is lost silently
    # sys.executable: the interpreter running the tests is the one known to have torch
    # (/usr/bin/python3 may not); sbatch exports the environment, so srun inherits it.
    script = write_script(tmp_path / "allreduce.sbatch", f"""\
#!/bin/bash
set -euo pipefail
hosts=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))
export MASTER_ADDR=${{hosts[0]}}
export MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))
export OMP_NUM_THREADS=1
srun --kill-on-bad-exit=1 {shlex.quote(sys.executable)} {shlex.quote(str(tmp_path / "allreduce.py"))}
""")
    t0 = time.monotonic()
    proc = run(
        ["sbatch", "--wait", "--parsable", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1",
         "--time=5", "--job-name=syncrl-test-allreduce", f"--chdir={tmp_path}",
         f"--output={out_dir}/job-%j.out", str(script)],
        timeout=240, check=False,
    )
    elapsed = time.monotonic() - t0
    job_id = proc.stdout.strip().split(";")[0]
    outputs = "\n".join(p.read_text() for p in sorted(out_dir.glob("job-*.out")))
    assert proc.returncode == 0, f"job {job_id} failed (rc={proc.returncode}):\n{proc.stderr}\n{outputs}"

    results = {}
    for line in outputs.splitlines():
        if line.startswith("RESULT "):
            fields = dict(kv.split("=", 1) for kv in line.split()[1:])
            results[int(fields["rank"])] = fields
    assert sorted(results) == [0, 1], outputs
    for fields in results.values():
        assert fields["world"] == "2"
        assert float(fields["sum"]) == 3.0  # 1 + 2
    assert {f["host"] for f in results.values()} == set(slurm_cluster.nodes), outputs
    assert results[0]["host"] == "n1"  # rank 0 runs on the first host, where MASTER_ADDR points
    print(f"sbatch --wait gloo all_reduce job: {elapsed:.2f}s")


@pytest.mark.slurm
def test_scancel_kills_a_running_step(slurm_cluster, tmp_path):
    marks = tmp_path / "marks"
    marks.mkdir()
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    # Each task records its PID (exec keeps it for `sleep`) atomically, then sleeps far past the test.
    script = write_script(tmp_path / "sleeper.sbatch", f"""\
#!/bin/bash
set -u
DIR={shlex.quote(str(marks))}
srun --nodes=2 --ntasks=2 --ntasks-per-node=1 bash -c \\
  'hostname > "$1/host.$SLURM_PROCID"; echo $$ > "$1/pid.$SLURM_PROCID.tmp"; mv "$1/pid.$SLURM_PROCID.tmp" "$1/pid.$SLURM_PROCID"; exec sleep 600' _ "$DIR"
echo "srun-rc=$?" > "$DIR/after-step"
""")
    proc = run(
        ["sbatch", "--parsable", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--time=5",
         "--job-name=syncrl-test-scancel", f"--chdir={tmp_path}", f"--output={out_dir}/job-%j.out",
         str(script)],
        timeout=30,
    )
    job_id = proc.stdout.strip().split(";")[0]
    try:
        wait_for(lambda: all((marks / f"pid.{r}").exists() for r in (0, 1)), 60, "both tasks to start")
        pids = [int((marks / f"pid.{r}").read_text()) for r in (0, 1)]
        hosts = sorted((marks / f"host.{r}").read_text().strip() for r in (0, 1))
        assert hosts == sorted(slurm_cluster.nodes)
        assert not any(pid_gone(p) for p in pids)
        steps = run(["squeue", "-h", "-s", "-j", job_id, "-o", "%i"], timeout=15).stdout.split()
        assert f"{job_id}.0" in steps, steps

        t0 = time.monotonic()
        run(["scancel", f"{job_id}.0"], timeout=15)
        wait_for(lambda: all(pid_gone(p) for p in pids), 30, f"tasks {pids} to die after scancel")
        kill_s = time.monotonic() - t0

        # Only the step was cancelled: the batch script carries on and the job completes.
        after = wait_for(lambda: (marks / "after-step").exists() and (marks / "after-step").read_text(),
                         30, "the batch script to continue after the step")
        assert after.strip() != "srun-rc=0", after
        wait_for(lambda: job_state(job_id) == "COMPLETED", 30, f"job {job_id} to complete")
        print(f"scancel step -> tasks gone on both nodes in {kill_s:.2f}s")
    finally:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=15)
