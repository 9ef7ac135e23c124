"""The CLI's edges on a finished run dir: out-of-range arguments are refused up front with exit 2 and
one line naming what exists; folders a user left in the run dir are ignored. The session's tiny
run (tests/conftest.py: tiny model, 2 ranks, 2 iterations) serves every case."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from jobs.base_model import CACHE_ENV
from stages.runtime.config import ConfigError
from tests.conftest import TINY_RUN
from tests.test_e2e_local import SMALL, syncrl

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run_dir(tiny_run):
    """The session's finished 2-iteration run (tests/conftest.py): these cases read it, or a copy."""
    return tiny_run.dir


def refused(proc, *needles):
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    for n in needles:
        assert n in proc.stderr, proc.stderr


@pytest.mark.parametrize("iteration", ["-1", "5"])
def test_rerun_of_an_iteration_the_run_does_not_have_is_refused(run_dir, iteration):
    before = sorted(p.name for p in run_dir.iterdir())
    refused(syncrl("rerun", str(run_dir), "--iteration", iteration, "--stage", "score"),
            f"--iteration {iteration}", "iterations 0-1")
    assert sorted(p.name for p in run_dir.iterdir()) == before  # no iter_-0001/, no attempt launched
    assert not (run_dir / "logs" / "iter_00000" / "score" / "attempt_2").exists()


@pytest.mark.parametrize("args,needle", [(["--rank", "99"], "rank(s) 0, 1"), (["--attempt", "9"], "attempt(s) 1"),
                                          (["--node", "zz"], "node(s)")])
def test_tail_of_a_rank_node_or_attempt_that_does_not_exist_is_an_error(run_dir, args, needle):
    proc = syncrl("tail", str(run_dir), "--iteration", "0", "--stage", "train", *args)
    refused(proc, needle)
    assert proc.stdout == ""  # no header for logs it will not show
    assert syncrl("tail", str(run_dir), "--iteration", "0", "--stage", "train", "--rank", "1").returncode == 0


def test_folders_that_are_not_syncrls_are_ignored(run_dir, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    shutil.copytree(copy / "iter_00000", copy / "iter_00000.bak")
    shutil.copytree(copy / "logs" / "iter_00000", copy / "logs" / "iter_00000.old")
    (copy / "logs" / "iter_00000" / "train" / "attempt_1.keep").mkdir()
    status = syncrl("status", str(copy))
    assert status.returncode == 0 and "Traceback" not in status.stderr, status.stderr
    assert "12/12 stages done" in status.stdout  # the .bak and .old folders are not iterations
    tail = syncrl("tail", str(copy))
    assert tail.returncode == 0 and "Traceback" not in tail.stderr, tail.stderr
    report = syncrl("report", str(copy), "--out", str(tmp_path / "report"))
    assert report.returncode == 0 and "Traceback" not in report.stderr, report.stderr


def test_a_second_coordinator_changes_nothing(tmp_path, tiny_run):
    import filelock

    run = tmp_path / "run"
    shutil.copytree(tiny_run.dir, run)  # a finished run dir
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != ".coordinator.lock"}
    with filelock.FileLock(run / ".coordinator.lock", timeout=0):  # as a running coordinator holds it
        second = syncrl("run", TINY_RUN[0], f"run_dir={run}", "iterations=6", *TINY_RUN[2:])
    refused(second, "another coordinator is running", "nothing was changed")
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != ".coordinator.lock"} == before


def test_two_coordinators_started_at_once_on_a_fresh_dir(tmp_path):
    run = tmp_path / "fresh"
    cmd = [sys.executable, "-m", "jobs.cli", "run", "configs/local_tiny.yaml", f"run_dir={run}", "iterations=1", *SMALL]
    procs = [subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = [(p.wait(timeout=600), p.stderr.read()) for p in procs]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 2], results
    loser = next(err for code, err in results if code == 2)
    assert "another coordinator is running" in loser and "Traceback" not in loser
    assert not [p for p in run.rglob("*") if ".tmp" in p.name]


@pytest.mark.parametrize("cached", [False, True], ids=["written", "from-the-preset-cache"])
def test_init_model_onto_an_existing_dir_or_twice_at_once(tmp_path, cached):
    out = tmp_path / "m"
    env = {k: v for k, v in os.environ.items() if k != CACHE_ENV}  # the suite's own cache (conftest) aside
    if cached:
        env[CACHE_ENV] = str(tmp_path / "cache")
    cmd = [sys.executable, "-m", "jobs.cli", "init-model", str(out)]
    procs = [subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for _ in range(2)]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    assert sorted(code for code, _ in results) == [0, 2], results
    assert all("Traceback" not in err for _, err in results)
    refused(syncrl("init-model", str(out)), "already exists")
    # No staging directory left, in the output's directory or the cache.
    assert sorted(p.name for p in tmp_path.iterdir()) == (["cache", "m"] if cached else ["m"])
    if cached:
        assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["tiny-llama-seed0-float32",
                                                                          "tiny-llama-seed0-float32.lock"]


def test_the_preset_cache_writes_a_preset_once_and_gives_each_run_a_copy_of_its_own(tmp_path, monkeypatch):
    from jobs.base_model import create_base_model

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    a = create_base_model(tmp_path / "a", "tiny-llama", 0)
    entry = tmp_path / "cache" / "tiny-llama-seed0-float32"
    (entry / "note.txt").write_text("from the cache")  # only a copy of the cached entry carries this file
    b = create_base_model(tmp_path / "b", "tiny-llama", 0)
    assert (b / "note.txt").read_text() == "from the cache"
    weights = (a / "model.safetensors").read_bytes()
    assert (b / "model.safetensors").read_bytes() == weights == (entry / "model.safetensors").read_bytes()
    (b / "model.safetensors").write_bytes(b"damaged")  # a run that damages its base model...
    assert (entry / "model.safetensors").read_bytes() == weights  # ...leaves the cache as it was
    with pytest.raises(ConfigError, match="already exists"):
        create_base_model(b, "tiny-llama", 0)
    monkeypatch.setenv(CACHE_ENV, str(a / "config.json"))  # a file, not a directory
    with pytest.raises(ConfigError, match=f"{CACHE_ENV}=.*config.json: cannot use it as the preset cache"):
        create_base_model(tmp_path / "c", "tiny-llama", 0)
    assert not (tmp_path / "c").exists()


def test_status_needs_no_write_access_and_names_a_corrupt_marker(run_dir, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    marker = copy / "iter_00000" / "markers" / "score.done"
    marker.write_bytes(marker.read_bytes()[:40])  # cut short
    ro = tmp_path / "ro"
    ro.mkdir()
    if subprocess.run(["mount", "--bind", "-o", "ro", str(copy), str(ro)], capture_output=True).returncode != 0:
        pytest.skip("cannot bind-mount read-only here")
    try:
        assert not os.access(ro, os.W_OK) or subprocess.run(["touch", str(ro / "x")]).returncode != 0
        status = syncrl("status", str(ro))
        assert status.returncode == 0 and "Traceback" not in status.stderr, status.stderr
        assert "score    corrupt" in status.stdout and "not valid JSON" in status.stdout, status.stdout
        assert syncrl("tail", str(ro), "--iteration", "0", "--stage", "score").returncode == 0
    finally:
        subprocess.run(["umount", str(ro)], capture_output=True)
