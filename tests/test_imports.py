"""The torch-free entry points must stay torch-free: they start in well under a second."""

import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "deepspeed", "wandb")


def imported_modules(args, cwd):
    """Module names that `python -X importtime ARGS` imported (importtime writes them to stderr)."""
    proc = subprocess.run([sys.executable, "-X", "importtime", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=60)
    names = set()
    for line in proc.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            names.add(line.rsplit("|", 1)[1].strip().split(".")[0])
    return proc, names


@pytest.mark.parametrize("args", [["-m", "stages.score", "--help"], ["-m", "stages.gather", "--help"]])
def test_cpu_stages_import_no_heavy_library(args, request):
    proc, names = imported_modules(args, request.config.rootpath)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage:" in proc.stdout
    assert not names & set(HEAVY), f"{args} imported {sorted(names & set(HEAVY))}"
    assert "stages" in names  # the check really saw the project's imports


def test_status_imports_no_heavy_library(tmp_path, request):
    from stages.common.config import dump_config, load_config
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(dump_config(load_config(None, [f"run_dir={run}", "iterations=2"])))
    proc, names = imported_modules(["-m", "jobs.cli", "status", str(run)], request.config.rootpath)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "0/10 stages done" in proc.stdout
    assert not names & set(HEAVY), sorted(names & set(HEAVY))
