"""Checkpoint I/O settings (stages/rl/serialization.py) and save's retention of checkpoints and models."""

import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from stages.rl import serialization
from stages.rl.serialization import checkpoint_io
from tests.devices import DEVICES
from stages.runtime.paths import RunPaths
from stages.save import prune_checkpoints, prune_models


def crcs(path: Path) -> list[int]:
    return [i.CRC for i in zipfile.ZipFile(path).infolist() if "/data/" in i.filename]


def mapped(path: Path) -> bool:
    return str(path.resolve()) in Path("/proc/self/maps").read_text()


def test_written_without_crc_and_read_through_mmap(tmp_path):
    state = {"exp_avg": torch.arange(4096, dtype=torch.float32), "step": torch.tensor(3)}
    plain, fast = tmp_path / "plain.pt", tmp_path / "fast.pt"
    torch.save(state, plain)
    from torch.utils.serialization import config

    with checkpoint_io(mmap=True):
        assert config.save.use_pinned_memory_for_d2h  # takes effect on a GPU only
        torch.save(state, fast)
        back = torch.load(fast, weights_only=True)
        assert mapped(fast)
    assert all(c != 0 for c in crcs(plain)) and all(c == 0 for c in crcs(fast))
    assert all(torch.equal(back[k], v) for k, v in state.items())
    del back
    # Outside the block torch's own defaults are back: a CRC on write, a plain read.
    assert not config.save.use_pinned_memory_for_d2h
    again = tmp_path / "again.pt"
    torch.save(state, again)
    assert all(c != 0 for c in crcs(again))
    loaded = torch.load(again, weights_only=True)
    assert not mapped(again) and torch.equal(loaded["exp_avg"], state["exp_avg"])


def test_mmap_off_reads_into_memory(tmp_path):
    path = tmp_path / "c.pt"
    with checkpoint_io(mmap=False):
        torch.save({"w": torch.ones(1024)}, path)
        loaded = torch.load(path, weights_only=True)
    assert not mapped(path) and all(c == 0 for c in crcs(path)) and loaded["w"].sum() == 1024


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.shape, a.stride(), a.device.type) == (b.dtype, b.shape, b.stride(), "cpu") and \
            torch.equal(a.cpu(), b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("device", DEVICES)
def test_threaded_writes_give_torch_saves_file(tmp_path, monkeypatch, device):
    """parallel_save's file loads as torch.save's does: every dtype, views sharing a storage, an empty
    tensor, a transposed one, nested containers; tensors cut into chunks that several threads write."""
    monkeypatch.setattr(serialization, "CHUNK_BYTES", 1000)  # chunks that end mid-element, as 64 MB ones may
    g = torch.Generator().manual_seed(0)
    flat = torch.randn(3001, generator=g)
    state = {"flat": flat, "view": flat[7:20], "half": torch.randn(257, generator=g).to(torch.bfloat16),
             "step": torch.tensor(3), "empty": torch.empty(0), "t": torch.randn(40, 30, generator=g).t(),
             "groups": [{"ids": torch.arange(1000), "lr": 1e-6}], "name": "adam"}
    state = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    (tmp_path / "threads").mkdir()
    (tmp_path / "torch").mkdir()
    path = tmp_path / "threads" / "state.pt"
    with checkpoint_io(mmap=False):
        assert serialization.parallel_save(state, str(path), threads=3)
        torch.save(state, tmp_path / "torch" / "state.pt")
    back = torch.load(path, weights_only=False, map_location="cpu")
    assert same(state, back)
    assert back["view"].untyped_storage().data_ptr() == back["flat"].untyped_storage().data_ptr()
    # Byte for byte the file torch.save writes under the same name and settings.
    assert path.read_bytes() == (tmp_path / "torch" / "state.pt").read_bytes()


def test_a_failed_threaded_write_is_raised(tmp_path, monkeypatch):
    monkeypatch.setattr(serialization, "CHUNK_BYTES", 64)

    def refuse(fd, data, offset):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(serialization.os, "pwrite", refuse)
    with pytest.raises(OSError, match="No space left"):
        serialization.parallel_save({"w": torch.ones(1000)}, str(tmp_path / "w.pt"), threads=2)


def test_threaded_writes_wrap_deepspeeds_torch_engine_for_the_write_only():
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    engine = SimpleNamespace(checkpoint_engine=TorchCheckpointEngine())
    engine.checkpoint_engine.zipfile_serialization = True
    inner = engine.checkpoint_engine
    with serialization.threaded_writes(engine, "checkpoint_engine", 4):
        assert isinstance(engine.checkpoint_engine, serialization.ThreadedWrites)
        assert engine.checkpoint_engine.load == inner.load  # all but save is the engine's
    assert engine.checkpoint_engine is inner
    with serialization.threaded_writes(engine, "checkpoint_engine", 0):  # 0: torch.save alone
        assert engine.checkpoint_engine is inner
    inner.zipfile_serialization = False  # the legacy format is torch.save's alone
    with serialization.threaded_writes(engine, "checkpoint_engine", 4):
        assert engine.checkpoint_engine is inner


def test_staged_loads_leave_a_cpu_engine_alone_and_keep_the_loaded_states_shape():
    """The copies to the GPU need CUDA (tests/test_gpu.py); what runs here: no wrapping off CUDA or with
    no threads, and the state rebuilt around the moved tensors keeps its containers and the rest."""
    from collections import OrderedDict

    engine = SimpleNamespace(checkpoint_engine=object())
    inner = engine.checkpoint_engine
    for device, threads in ((torch.device("cpu"), 8), (torch.device("cuda", 0), 0)):
        with serialization.staged_loads(engine, device, threads):
            assert engine.checkpoint_engine is inner
    big, small = torch.zeros(1 << 19, dtype=torch.float32), torch.tensor(3)
    state = OrderedDict(opt={"state": {0: {"exp_avg": big, "step": small}}}, fp32=[big, (big, "tag")], n=7)
    found = list(serialization.tensors_in(state))
    assert sum(t is big for t in found) == 3 and any(t is small for t in found)
    moved = big.clone()
    out = serialization.rebuilt(state, lambda t: moved if t is big else t)
    assert type(out) is OrderedDict and out["n"] == 7 and out["fp32"][1][1] == "tag"
    assert out["opt"]["state"][0]["exp_avg"] is moved and out["opt"]["state"][0]["step"] is small
    assert out["fp32"][0] is moved and type(out["fp32"][1]) is tuple and out["fp32"][1][0] is moved
    assert state["fp32"][0] is big  # the loaded state itself is untouched

def run_dir(tmp_path, iterations: int, keep_checkpoints: int, keep_models: int, it: int):
    paths = RunPaths(tmp_path)
    for i in range(iterations):
        (paths.checkpoints / f"iter_{i:05d}").mkdir(parents=True)
        (paths.checkpoints / f"iter_{i:05d}" / "state.pt").write_bytes(b"x")
        (paths.models / f"iter_{i:05d}").mkdir(parents=True)
    (paths.models / "base").mkdir()
    cfg = SimpleNamespace(save=SimpleNamespace(keep_checkpoints=keep_checkpoints, keep_models=keep_models))
    return SimpleNamespace(paths=paths, cfg=cfg, iteration=it)


def names(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir())


@pytest.mark.parametrize("keep", [1, 2])
def test_prune_checkpoints_keeps_the_newest_and_never_a_later_one(tmp_path, keep):
    # A rerun of save for iteration 2 while iteration 3's checkpoint already exists: 3 is not touched.
    ctx = run_dir(tmp_path, 4, keep, 0, it=2)
    removed = prune_checkpoints(ctx)
    kept = ["iter_00002"] if keep == 1 else ["iter_00001", "iter_00002"]
    assert names(ctx.paths.checkpoints) == kept + ["iter_00003"]
    assert removed == [f"checkpoints/iter_{i:05d}" for i in range(3 - keep)]


def test_prune_models_counts_this_iterations_export_and_keeps_base(tmp_path):
    ctx = run_dir(tmp_path, 4, 1, 2, it=3)
    assert prune_models(ctx) == ["models/iter_00000", "models/iter_00001"]
    assert names(ctx.paths.models) == ["base", "iter_00002", "iter_00003"]
    assert prune_models(run_dir(tmp_path / "all", 4, 1, 0, it=3)) == []  # keep_models 0: every export stays


def test_verify_compares_every_exported_tensor(tmp_path):
    from safetensors.torch import load_file

    from stages.rl.tiny_model import create_base_model
    from stages.save import verify

    model = create_base_model(tmp_path / "m", "tiny-llama")
    weights = load_file(model / "model.safetensors")
    verify(model, weights, "float32")
    name = sorted(weights)[-1]
    weights[name] = weights[name].clone()
    weights[name].view(-1)[0] += 1
    with pytest.raises(RuntimeError, match=f"differs from the checkpoint at {name}"):
        verify(model, weights, "float32")


def test_staged_loads_serve_the_checks_load_once_and_keep_room_unless_zero_copies_in_place():
    # DeepSpeed loads the model file twice in a row (a check, then the load): the second is served by
    # the first's moved copy, once; another file in between lets it go. The room kept for one more
    # tensor of the largest's size is kept unless ZeRO 1-2's optimizer copies a rigid checkpoint of
    # unpadded partitions in place.
    calls = []

    class Inner:
        def load(self, path, map_location=None):
            calls.append(path)
            return {"path": path, "step": torch.tensor(1)}  # nothing large: no GPU needed to "move" it

    rigid = dict(elastic_checkpoint=False, round_robin_bit16_padding=[[0, 0], [0]])
    for optimizer, spare in ((SimpleNamespace(**rigid, groups_padding=[0, 0]), False),
                             (SimpleNamespace(**rigid, groups_padding=[0, 96]), True),  # the last rank's
                             (SimpleNamespace(**{**rigid, "round_robin_bit16_padding": [[0, 8]]}, groups_padding=[0]),
                              True),
                             (SimpleNamespace(**rigid), True),  # not ZeRO 1-2's
                             (SimpleNamespace(elastic_checkpoint=True, groups_padding=[0]), True), (object(), True)):
        engine = SimpleNamespace(checkpoint_engine=Inner(), optimizer=optimizer)
        with serialization.staged_loads(engine, torch.device("cuda", 0), threads=4):
            assert engine.checkpoint_engine.spare_largest is spare
            calls.clear()
            first = engine.checkpoint_engine.load("model.pt")
            assert engine.checkpoint_engine.load("model.pt") is first and calls == ["model.pt"]
            engine.checkpoint_engine.load("model.pt")  # served once only: a third load reads again
            engine.checkpoint_engine.load("optim.pt")
            engine.checkpoint_engine.load("model.pt")
            assert calls == ["model.pt", "model.pt", "optim.pt", "model.pt"]
        assert isinstance(engine.checkpoint_engine, Inner)
