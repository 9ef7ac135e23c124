"""The built-in base model for runs without model.path, written by a child process
(`python -m stages.rl.tiny_model`) so that the coordinator and the CLI never import torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from stages.runtime.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]
# A few seconds for the built-in presets; the bound is for a filesystem that stalls.
TIMEOUT_S = 900


def create_base_model(out_dir, preset: str, seed: int, dtype: str = "float32") -> Path:
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
