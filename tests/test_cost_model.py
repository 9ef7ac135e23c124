"""The cost model on paper (tests/benchmarks/cost_model.py, docs/scale.md): its parameter counts, that
its train time scales with the tokens, that node-local checkpoints beat the shared filesystem with
its defaults, and that its script prints both models as a table and as JSON. Torch-free and fast."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.benchmarks import cost_model
from tests.benchmarks.shapes import SHAPES, block_params

ROOT = Path(__file__).resolve().parents[1]


def test_parameter_counts_come_from_the_dimensions():
    # Llama 3.1 8B and 70B (untied, 128k vocabulary) and Llama 3.2 3B (tied): their published sizes.
    assert cost_model.shape("8b")["params"] == pytest.approx(8.03e9, rel=2e-3)
    assert cost_model.shape("70b")["params"] == pytest.approx(70.55e9, rel=2e-3)
    assert cost_model.shape("3b")["params"] == pytest.approx(3.21e9, rel=2e-3)
    # The blocks agree with the training benchmarks' shapes, which leave out norms and the vocabulary.
    for ours, theirs in (("8b", "llama-8b"), ("70b", "llama-70b")):
        s, dims = cost_model.SHAPES[ours], SHAPES[theirs]
        blocks = cost_model.shape(ours)["params"] - 2 * s["vocab"] * s["hidden"] - (2 * s["layers"] + 1) * s["hidden"]
        assert blocks == block_params(dims)
    # flops.py's N: every weight but the input embedding, the output projection counted even when tied.
    for name in ("3b", "8b"):
        m, s = cost_model.shape(name), cost_model.SHAPES[name]
        assert m["n"] == m["params"] - s["vocab"] * s["hidden"] * (0 if s["tied"] else 1)
    # K and V in bf16: 8 KV heads of 128 over 80 layers is 320 KiB per position at 70B.
    assert cost_model.shape("70b")["kv_bytes"] == 2 * 80 * 8 * 128 * 2


def test_train_time_scales_linearly_with_tokens():
    a = cost_model.parse([])
    b = cost_model.parse(["--prompts", str(2 * a.prompts)])
    link = a.inter_node_gbs * 1e9
    for name in ("8b", "70b"):
        m, gpu = cost_model.shape(name), cost_model.GPUS["h200"]
        one, two = (cost_model.update(m, gpu, x, 16, link) for x in (a, b))
        assert two["tokens"] == 2 * one["tokens"]
        for key in ("flops", "compute_s", "comm_s", "seconds"):
            assert two[key] == pytest.approx(2 * one[key], rel=1e-12), key
        # Overlapped, the update takes the longer of compute and communication; without, their sum.
        assert one["seconds"] == max(one["compute_s"], one["comm_s"])
        alone = cost_model.update(m, gpu, cost_model.parse(["--no-overlap"]), 16, link)
        assert alone["seconds"] == pytest.approx(one["compute_s"] + one["comm_s"])


def test_node_local_checkpoints_beat_the_shared_filesystem_with_the_defaults():
    local, shared = cost_model.parse([]), cost_model.parse(["--checkpoint", "shared"])
    for gpu in ("h100", "h200"):
        for name in ("8b", "70b"):
            r = cost_model.iteration(name, gpu, local)
            s = cost_model.iteration(name, gpu, shared)
            assert r["round_trip_local_s"] < r["round_trip_shared_s"]
            # 14 bytes per parameter, each node its own half: ~494 GB per node at 70B.
            assert r["checkpoint_gb_per_node"] == pytest.approx(14 * r["params"] / 2 / 1e9)
            assert r["iteration_s"] < s["iteration_s"]
            assert s["stages"]["persist (durable copy)"] == 0  # train wrote the durable copy itself
    # The 70B's bf16 weights do not fit one GPU: sampling goes tensor-parallel over a node's 8.
    r = cost_model.iteration("70b", "h100", local)
    assert (r["generate"]["tp"], r["generate"]["groups"]) == (8, 2)
    assert r["generate"]["layer_split_s"] > r["generate"]["seconds"]
    assert not r["train"]["states_fit"] and cost_model.iteration("70b", "h200", local)["train"]["states_fit"]


def test_the_script_prints_both_models_and_names_the_dominant_stage(capsys):
    assert cost_model.main([]) == 0
    out = capsys.readouterr().out
    assert "8B (8.03B params) on 2 x 8 H200" in out and "70B (70.55B params) on 2 x 8 H200" in out
    assert out.count("dominant stage: ") == 2 and out.count("checkpoint round trip") == 2
    for stage in ("generate", "train: update", "train: checkpoint write", "save (export)", "persist (durable copy)"):
        assert out.count(f"\n{stage} ") == 2, stage


def test_json_output_parses(capsys):
    assert cost_model.main(["--json", "--gpu", "h100,h200", "--models", "3b,8b,70b"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["inputs"]["mfu"] == 0.43
    assert [(r["gpu"], r["model"]) for r in doc["results"]] == [
        (g, m) for g in ("h100", "h200") for m in ("3b", "8b", "70b")]
    for r in doc["results"]:
        assert r["iteration_s"] == pytest.approx(sum(r["stages"].values()))
        assert r["dominant"] in r["per_stage"] and r["remedy"]


def test_the_script_runs_without_torch():
    code = ("import sys; sys.argv = ['cost_model.py']; sys.path.insert(0, 'tests/benchmarks'); import cost_model; "
            "cost_model.main(['--models', '70b']); assert 'torch' not in sys.modules")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "70B" in proc.stdout


def test_unknown_names_are_refused_with_the_valid_ones(capsys):
    with pytest.raises(SystemExit):
        cost_model.main(["--models", "405b"])
    assert "valid: 3b, 8b, 70b" in capsys.readouterr().err
