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


# stages/common's torch-free runtime (the run contract, the harness, the env table); the rest of
# stages/common is the RL library (models, batches, loss, samplers), which only stage processes load.
RUNTIME = {"config", "paths", "pipeline", "markers", "dist", "logs", "stage", "retry", "data", "memory"}


def test_jobs_import_only_the_runtime(request):
    """Every import of stages/ in jobs/, at any depth of a function, names a runtime module (read from
    the source, so a lazy import inside a rarely taken branch counts too). Of the heavy libraries,
    jobs/ loads DeepSpeed only to validate its JSON (check) and wandb only to log (metrics)."""
    import ast

    root = request.config.rootpath
    found = {}
    for path in sorted((root / "jobs").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                parts = name.split(".")
                if parts[:2] == ["stages", "common"] and len(parts) > 2:
                    found.setdefault(parts[2], set()).add(path.name)
                elif parts[0] == "stages" and len(parts) > 1 and parts[1] != "common":
                    found.setdefault(f"stages.{parts[1]}", set()).add(path.name)
    assert "config" in found and "markers" in found  # the scan sees jobs/' real imports
    outside = {m: sorted(files) for m, files in found.items() if m not in RUNTIME}
    assert not outside, f"jobs/ imports beyond the runtime: {outside}"
