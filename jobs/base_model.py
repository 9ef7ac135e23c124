"""The built-in base model for runs without model.path, written by a child process
(`python -m stages.rl.tiny_model`) so that the coordinator and the CLI never import torch.

With SYNCRL_PRESET_CACHE set to a directory, each (preset, seed, dtype) is written there once and
copied into the runs that ask for it: a test suite or a series of smoke runs then pays the child's
imports once, not once per run. The cache is keyed by those three alone: clear it after upgrading
torch or transformers, whose initialisation may change."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import filelock

from stages.runtime import markers
from stages.runtime.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]
# A few seconds for the built-in presets; the bound is for a filesystem that stalls.
TIMEOUT_S = 900
CACHE_ENV = "SYNCRL_PRESET_CACHE"


def create_base_model(out_dir, preset: str, seed: int, dtype: str = "float32") -> Path:
    """Write the `preset` base model to out_dir (which must not exist), from SYNCRL_PRESET_CACHE where set."""
    cache = os.environ.get(CACHE_ENV)
    if not cache:
        return write_base_model(out_dir, preset, seed, dtype)
    entry = Path(cache) / f"{preset}-seed{seed}-{dtype}"
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        with filelock.FileLock(f"{entry}.lock", timeout=TIMEOUT_S):
            if not entry.is_dir():
                write_base_model(entry, preset, seed, dtype)
    except filelock.Timeout:
        raise RuntimeError(f"waited over {TIMEOUT_S}s for another process writing {entry}; is it stuck? "
                           f"Remove {entry}.lock once no syncrl process runs, or unset {CACHE_ENV}") from None
    except OSError as e:
        raise ConfigError(f"{CACHE_ENV}={cache}: cannot use it as the preset cache ({e}); "
                          f"point it at a writable directory or unset it") from None
    try:
        # A copy, not links: a run that damages its base model leaves the cache as it was.
        return markers.publish_new_dir(Path(out_dir), lambda tmp: shutil.copytree(entry, tmp, dirs_exist_ok=True))
    except FileExistsError as e:
        raise ConfigError(str(e)) from None


def write_base_model(out_dir, preset: str, seed: int, dtype: str = "float32") -> Path:
    cmd = [sys.executable, "-m", "stages.rl.tiny_model", str(out_dir), "--preset", preset, "--seed", str(seed),
           "--dtype", dtype]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"writing the {preset} base model to {out_dir} took over {TIMEOUT_S}s; "
                           f"is its filesystem responding?") from None
    lines = proc.stderr.strip().splitlines()
    if proc.returncode == 2 and lines:  # refused: the directory exists, or an unknown preset
        raise ConfigError(lines[-1].removeprefix("python -m stages.rl.tiny_model: error: "))
    if proc.returncode != 0:
        tail = "\n".join(lines[-15:])
        raise RuntimeError(f"writing the {preset} base model to {out_dir} failed (exit {proc.returncode}):\n{tail}")
    return Path(out_dir)
