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
    from stages.runtime.config import dump_config, load_config
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(dump_config(load_config(None, [f"run_dir={run}", "iterations=2"])))
    proc, names = imported_modules(["-m", "jobs.cli", "status", str(run)], request.config.rootpath)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "0/12 stages done" in proc.stdout
    assert not names & set(HEAVY), sorted(names & set(HEAVY))


def stages_imports(path):
    """Every `stages...` module a source file imports, at any depth of a function (read from the source,
    so a lazy import inside a rarely taken branch counts too)."""
    import ast

    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names]
    return [n for n in names if n.split(".")[0] == "stages"]


def test_jobs_import_only_the_runtime(request):
    """jobs/ imports stages.runtime and nothing else of stages/ (not the RL library, not a stage). Of the
    heavy libraries, jobs/ loads DeepSpeed only to validate its JSON (check) and wandb only to log."""
    root = request.config.rootpath
    found = {}
    for path in sorted((root / "jobs").glob("*.py")):
        for name in stages_imports(path):
            parts = name.split(".")
            if len(parts) > 1:
                found.setdefault(parts[1], set()).add(path.name)
    assert "runtime" in found  # the scan sees jobs/' real imports
    outside = {m: sorted(files) for m, files in found.items() if m != "runtime"}
    assert not outside, f"jobs/ imports beyond stages.runtime: {outside}"


def test_the_runtime_stands_on_its_own(request):
    """stages/runtime imports no other part of stages/, and no heavy library when its modules load
    (dist imports torch inside the functions that need it)."""
    root = request.config.rootpath
    for path in sorted((root / "stages" / "runtime").glob("*.py")):
        beyond = [n for n in stages_imports(path) if n.split(".")[:2] != ["stages", "runtime"]]
        assert not beyond, f"{path.name} imports {beyond}"
    modules = [p.stem for p in sorted((root / "stages" / "runtime").glob("*.py")) if p.stem != "__init__"]
    code = "import " + ", ".join(f"stages.runtime.{m}" for m in modules)
    proc, names = imported_modules(["-c", code], root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "stages" in names and not names & set(HEAVY), sorted(names & set(HEAVY))
