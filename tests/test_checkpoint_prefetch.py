"""Reading the previous checkpoint ahead (stages/rl/checkpoint_prefetch.py): DeepSpeed's load takes the
files read before train's turn, and the engine it resumes is the one DeepSpeed's own reads give."""

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from stages.rl import checkpoint_prefetch
from stages.rl.tiny_model import create_base_model
from tests.test_train_batching import free_port

ROOT = Path(__file__).resolve().parents[1]


def test_a_resume_from_the_files_read_ahead_is_the_resume_deepspeed_reads(tmp_path):
    # Real DeepSpeed (ZeRO-2, gloo on CPU): two optimizer steps, a checkpoint, then two fresh engines
    # resumed from it, one through the files read ahead; both then take a third step.
    model = create_base_model(tmp_path / "base", "tiny-llama", seed=0)
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "tests.workers.resume_read_ahead", str(model), str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["tensors"] > 20 and result["same"] and result["same_after_a_step"], result
    assert result["figures"]["files"] == result["figures"]["served"] == 2, result


class Loads:
    def __init__(self):
        self.read = []

    def load(self, path, map_location=None):
        self.read.append(Path(path).name)
        return torch.load(path, map_location=map_location, weights_only=True)


def test_a_file_changed_after_it_was_read_is_read_again(tmp_path):
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    torch.save({"w": torch.arange(6.0), "tied": torch.ones(2)}, a)
    torch.save({"w": torch.zeros(3)}, b)
    prefetch = checkpoint_prefetch.Prefetch()
    prefetch.start(lambda: True, lambda: [a, b], lambda: 1 << 30, None)
    prefetch._finish(30)  # read both
    time.sleep(0.01)
    torch.save({"w": torch.full((3,), 7.0)}, b)  # replaced after it was read: a new file
    engine = type("Engine", (), {})()
    engine.checkpoint_engine = inner = Loads()
    with prefetch.serving(engine, timeout_s=30):
        assert torch.equal(engine.checkpoint_engine.load(str(a))["w"], torch.arange(6.0))
        assert torch.equal(engine.checkpoint_engine.load(str(b))["w"], torch.full((3,), 7.0))
        assert engine.checkpoint_engine.load(str(a))["tied"].sum() == 2  # served once: then read
    assert engine.checkpoint_engine is inner and inner.read == ["b.pt", "a.pt"]
    assert prefetch.figures["files"] == 2 and prefetch.figures["served"] == 1


def test_files_over_the_budget_are_left_to_deepspeed(tmp_path):
    small, large = tmp_path / "small.pt", tmp_path / "large.pt"
    torch.save({"w": torch.zeros(10)}, small)
    torch.save({"w": torch.zeros(100_000)}, large)
    prefetch = checkpoint_prefetch.Prefetch()
    prefetch.start(lambda: True, lambda: [large, small], lambda: small.stat().st_size + 1, None)
    prefetch._finish(30)
    assert prefetch.figures["files"] == 1 and prefetch.take(str(small)) is not None and prefetch.take(str(large)) is None


def test_a_checkpoint_not_complete_at_the_turn_is_not_waited_for(tmp_path):
    prefetch = checkpoint_prefetch.Prefetch()
    asked = threading.Event()

    def ready():
        asked.set()
        return None  # never complete

    prefetch.start(ready, lambda: [], lambda: 1 << 30, None)
    assert asked.wait(10)
    prefetch.turn_came()
    t0 = time.time()
    prefetch._finish(30)
    assert time.time() - t0 < 5 and prefetch.figures["files"] == 0
