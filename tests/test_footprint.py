"""What a run will hold on disk (stages/runtime/footprint.py) and `syncrl check`'s warning where a
filesystem cannot hold it, on real filesystems of a given size."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stages.runtime import footprint
from stages.runtime.config import load_config
from stages.runtime.presets import PRESETS, VOCAB_SIZE
from tests.test_faults import small_disk  # noqa: F401 (a fixture)

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "local_tiny.yaml")


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_a_presets_parameters_are_those_of_the_model_it_builds(preset):
    from transformers import LlamaForCausalLM

    from stages.rl.tiny_model import build_tokenizer, llama_config

    assert VOCAB_SIZE == len(build_tokenizer())
    with torch.device("meta"):  # the 8B shape's layout without its memory
        model = LlamaForCausalLM(llama_config(PRESETS[preset]))
    assert footprint.parameters("", preset) == sum(p.numel() for p in model.parameters())


def test_a_model_paths_parameters_come_from_its_safetensors_headers(tmp_path):
    from transformers import AutoModelForCausalLM

    from stages.rl.tiny_model import create_base_model

    path = create_base_model(tmp_path / "m", "tiny-llama", dtype="bfloat16")
    model = AutoModelForCausalLM.from_pretrained(path)
    assert footprint.parameters(str(path), "tiny-llama") == sum(p.numel() for p in model.parameters())
    assert footprint.parameters(str(tmp_path), "tiny-llama") is None  # no safetensors there


def test_the_peak_counts_the_kept_checkpoints_and_the_one_being_written(tmp_path):
    cfg = load_config(TINY, [f"run_dir={tmp_path}", "model.dtype=bfloat16", "iterations=10",
                             "save.keep_checkpoints=2", "save.keep_models=3"])
    fp = footprint.footprint(cfg, 1000)
    assert (fp.checkpoint, fp.checkpoints_held) == (14_000, 3)  # bf16 weights, fp32 master, two fp32 moments
    assert (fp.model, fp.models_held, fp.base) == (2000, 3, 2000)
    fp32 = footprint.footprint(load_config(TINY, [f"run_dir={tmp_path}", "iterations=4"]), 1000)
    assert (fp32.checkpoint, fp32.models_held) == (12_000, 4)  # no master copy; save.keep_models=0 keeps all 4


def check(*overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jobs.cli", "check", TINY, *overrides], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_check_warns_where_every_iterations_model_would_not_fit_and_says_how_many_would(small_disk):
    disk = small_disk(4096)
    params = footprint.parameters("", "tiny-llama")
    proc = check(f"run_dir={disk}/run", "iterations=500")
    assert proc.returncode == 0, proc.stderr  # a warning: the run may still start
    (line,) = [x for x in proc.stderr.splitlines() if "warning" in x]
    assert f"syncrl check: warning: {disk}: the run will hold about" in line
    assert "exported models, 500 of" in line and "save.keep_models=0 keeps every iteration's" in line
    keep = int(line.split("set save.keep_models=")[-1].split(",")[0])
    # The number it names fits: the checkpoints, the base model and `keep` models within the disk.
    free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
    assert 2 * params * 12 + params * 4 * (1 + keep) <= free < 2 * params * 12 + params * 4 * (2 + keep)
    quiet = check(f"run_dir={disk}/run", "iterations=500", f"save.keep_models={keep}")
    assert quiet.returncode == 0 and "warning" not in quiet.stderr, quiet.stderr


def test_checkpoints_linked_to_another_filesystem_count_against_it(small_disk, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "checkpoints").symlink_to(small_disk(1024))
    proc = check(f"run_dir={run_dir}", "model.preset=small-llama", "iterations=2")
    (line,) = [x for x in proc.stderr.splitlines() if "warning" in x]
    assert f"{run_dir / 'checkpoints'}: the run will hold about 11.4 GB there (checkpoints, 2 of 5.7 GB" in line
    assert "exported models" not in line  # they go to run_dir, on a filesystem with room


def test_what_the_run_already_holds_counts_as_room(small_disk):
    """A resumed run: its models folder holds files that pruning replaces."""
    disk = small_disk(4096)
    models = disk / "run" / "models"
    models.mkdir(parents=True)
    params = footprint.parameters("", "tiny-llama")
    need = 2 * params * 12 + params * 4 * 4  # two fp32 checkpoints; three models and the base model
    held = 3 << 20
    assert 4096 * 1024 - held < need < 4096 * 1024 - (64 << 10)  # fits the disk only counting what is held
    (models / "iter_00000.bin").write_bytes(b"\0" * held)
    assert "warning" not in check(f"run_dir={disk}/run", "iterations=3").stderr
    (disk / "other.bin").write_bytes(b"\0" * (1 << 20))  # not the run's: it does not count
    assert check(f"run_dir={disk}/run", "iterations=3").stderr.count("warning") == 1


def test_node_local_checkpoints_count_against_the_nodes_storage_where_it_can_be_seen(small_disk, tmp_path):
    """With the local launcher this machine is the node: train.local_checkpoint_dir's filesystem holds
    the last checkpoint and the one being written. Elsewhere (a login node) its storage is not the
    nodes': not counted."""
    store = small_disk(1024)
    proc = check(f"run_dir={tmp_path}/run", f"train.local_checkpoint_dir={store}/syncrl", "model.preset=small-llama",
                 "--launcher", "local")
    (line,) = [x for x in proc.stderr.splitlines() if "warning" in x]
    assert f"warning: {store}: the run will hold about 11.4 GB there (this node's share of the node-local" in line
    assert "point train.local_checkpoint_dir at node storage with more room" in line
    assert "use a run_dir" not in line  # the run dir's filesystem has room for the rest
    cfg = load_config(TINY, [f"run_dir={tmp_path}/run", f"train.local_checkpoint_dir={store}/syncrl"])
    assert footprint.footprint(cfg, 1000, nodes=None).node_local == 0
    assert footprint.footprint(cfg, 1000, nodes=2).node_local == 12_000  # 2 x 12 kB over 2 nodes


def test_a_deferred_checkpoint_over_its_host_memory_budget_is_named_with_what_takes_it_off(tmp_path):
    # The 3B shape under ZeRO-3 on one H200 node (125 GB host, ~120 GB available) with checkpoints/
    # in tmpfs, as it ran: rank 0's snapshot is the whole optimizer file, 12 bytes a parameter.
    from jobs.check import snapshot_warnings

    shm = Path("/dev/shm")
    if not footprint.memory.memory_backed(shm) or footprint.memory.memory_backed(tmp_path):
        pytest.skip("needs /dev/shm on tmpfs and a temporary directory on disk")
    params = footprint.parameters("", "llama3-3b-shape")
    zero3 = ["model.preset=llama3-3b-shape", "model.dtype=bfloat16", "save.keep_checkpoints=1", "iterations=3",
             "train.deepspeed_config=configs/ds_zero3_multinode.json"]
    in_shm = load_config(None, [f"run_dir={shm}/syncrl-test-never-written", *zero3])
    on_disk = load_config(None, [f"run_dir={tmp_path}/run", *zero3])
    short = footprint.snapshot_shortfall(in_shm, params, world=1, nodes=1, zero_stage=3, offload=False,
                                         available=120 * 10**9)
    assert short.in_memory and short.snapshot == 12 * params
    # Half the available memory less the kept checkpoint (14 bytes a parameter), halved again for tmpfs.
    assert short.budget == int((120 * 10**9 - 14 * params) * 0.5 / 2)
    assert short.available_needed == 2 * 12 * params * 2 + 14 * params
    # On disk the same node holds it; ZeRO-2 adds the weights to rank 0's snapshot; offload holds nothing.
    assert footprint.snapshot_shortfall(on_disk, params, 1, 1, 3, False, 120 * 10**9) is None
    assert footprint.snapshot_shortfall(on_disk, params, 1, 1, 2, False, 60 * 10**9).snapshot == 14 * params
    assert footprint.snapshot_shortfall(in_shm, params, 1, 1, 3, True, 120 * 10**9) is None
    # Two ranks a node share the budget; each holds half the optimizer state.
    two = footprint.snapshot_shortfall(on_disk, params, world=2, nodes=1, zero_stage=3, offload=False,
                                       available=60 * 10**9)
    assert two.snapshot == 6 * params and two.budget == int(60 * 10**9 * 0.5 / 2)
    (line,) = snapshot_warnings(in_shm, 1, 1, 120 * 10**9)
    assert "written before its marker every iteration" in line and "(33.8 GB)" in line and "tmpfs" in line
    assert line.startswith(f"about {(short.snapshot - short.budget) / 1e9:.1f} GB of train's checkpoint")
    assert snapshot_warnings(on_disk, 1, 1, 120 * 10**9) == []
    # Off where nothing is deferred.
    off = load_config(None, [f"run_dir={shm}/syncrl-test-never-written", *zero3, "tuning.deferred_checkpoint=false"])
    assert footprint.snapshot_shortfall(off, params, 1, 1, 3, False, 10**9) is None
