"""The GPU benchmarks still run end to end: each once on CPU, tiny, so they cannot rot between GPU sessions.

The figures they print here mean nothing (2 CPU cores, a 70k-parameter model); the runs check that
the scripts drive the current stage code and print their tables.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # each runs a benchmark script in processes of its own

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT)}


def run(args, timeout=300):
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture(scope="module")
def preset_scaling(tmp_path_factory):
    """scaling.py over the tiny-llama preset loaded from disk: its output and its JSON file. Read by
    the scaling case and, for the parameter count, by the model built in place."""
    tmp_path = tmp_path_factory.mktemp("scaling")
    out = run(["tests/benchmarks/scaling.py", "--gpus", "2", "--preset", "tiny-llama", "--seq", "160",
               "--steps", "2", "--variants", "z2:m2,z3:m2:kl", "--model-dir", str(tmp_path / "base"),
               "--json", str(tmp_path / "scaling.json")])
    return out, tmp_path / "scaling.json"


def test_scaling_benchmark_runs_the_train_micro_step_as_two_nodes(preset_scaling):
    # scaling.py starts train_mfu.py under two launchers (node ranks 0 and 1), as on 2 nodes.
    out, rows_file = preset_scaling
    assert out.count("s/step") == 2 and "forward = 2*N*s + 4*L*d*s^2" in out
    import json
    rows = json.loads(rows_file.read_text())
    assert [(r["variant"], r["gpus"], r["efficiency"]) for r in rows] == [("z2:m2", 2, 1.0), ("z3:m2:kl", 2, 1.0)]
    assert all(r["tokens_per_s"] > 0 for r in rows)


def test_the_train_step_benchmark_names_where_the_host_time_goes(tmp_path):
    # --host-profile: rank 0's timed steps under cProfile; DeepSpeed's engine step and syncrl's micro-step
    # are among the functions it names. The variants also take the step records, balanced micro-batches
    # of rows of mixed lengths, and the rehearsal.
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
                           "tests/benchmarks/train_mfu.py", "--preset", "tiny-llama", "--seq", "160", "--steps", "2",
                           "--warmup", "1", "--mixed", "--variants",
                           "z2:m2:records,z2:m2:nonorm,z2:m2:flatnorm:records:balance:rehearse",
                           "--model-dir", str(tmp_path / "base"), "--host-profile"],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("s/step") == 3
    assert proc.stderr.count("HOST PROFILE wall") == 6, proc.stderr[-3000:]
    # nonorm: the step computes no gradient norm (DeepSpeed's per-parameter one is what it costs);
    # flatnorm: tuning.grad_norm=flat's.
    lines = [line for line in proc.stdout.splitlines() if "s/step" in line]
    assert re.search(r"grad norm \d", lines[0]) and lines[1].endswith("grad norm not computed"), lines
    assert re.search(r"grad norm \d", lines[2]), lines
    assert "micro_step" in proc.stderr and "engine.py" in proc.stderr and "(step)" in proc.stderr


def test_a_model_built_in_place_is_the_same_model_partitioned(tmp_path, preset_scaling):
    # --shape builds from the config under zero.Init (how the largest models are benchmarked): the
    # same parameter count as the preset loaded from disk, and each rank holding only its partition.
    from stages.rl.tiny_model import PRESETS

    sys.path.insert(0, str(ROOT / "tests" / "benchmarks"))
    from shapes import SHAPES, block_params, largest_fitting

    out = run(["tests/benchmarks/scaling.py", "--gpus", "2", "--shape", "tiny-llama", "--seq", "160", "--steps", "1",
               "--variants", "z3:m2,z2:m2", "--json", str(tmp_path / "scaling.json")])
    disk = preset_scaling[0]  # the preset loaded from disk
    assert out.split("tiny-llama: N = ")[1].split(",")[0:2] == disk.split("tiny-llama: N = ")[1].split(",")[0:2]
    assert "tiny-llama" in out and out.count("s/step") == 2
    tiny = PRESETS["tiny-llama"]
    assert block_params(tiny) == 2 * (2 * 64 * 64 + 2 * 64 * 64 + 3 * 64 * 128)
    # 7.0B x 16 bytes of ZeRO-3 states fit 70% of 2 x 141 GB; 13.2B need 4 GPUs, 31.2B need 8.
    assert [largest_fitting(g, 141 * 10**9) for g in (2, 4, 8)] == ["llama-8b", "qwen-14b", "qwen-32b"]
    assert set(SHAPES) == {"llama-8b", "qwen-14b", "qwen-32b", "llama-70b"}


def test_generate_benchmark_runs_every_mode(tmp_path):
    # compact:decode_graphs=false is compact itself on a CPU (no graphs there): not run twice here.
    modes = ["compact", "static:batch_size=4", "dynamic"]
    out = run(["tests/benchmarks/generate_cache.py", "--preset", "tiny-llama", "--dtype", "float32",
               "--prompts", "2", "--attempts", "2", "--new-tokens", "4", "--repeats", "1", "--json",
               str(tmp_path / "gen.json"), "--modes", ",".join(modes), "--step-times"])
    for mode in modes:
        assert re.search(rf"^{re.escape(mode)} +[0-9.]+s +[0-9]+ +[0-9]+ ", out, re.M), mode
    assert "bound at 4.80 TB/s (H200, for no GPU)" in out and "compactions" in out
    assert re.search(r"roofline with each prompt's K/V read once for its attempts .*: all [0-9.e-]+s, [0-9.]+% of", out)
    assert re.search(r"of sampling; with each step's projections and attention one after the other [0-9.e-]+s, "
                     r"[0-9.]+%$", out, re.M), out
    # The compact sampler's steps by rows decoded, and its line per call.
    assert re.search(r"^STEPS +4 +[1-9][0-9]* +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+%$", out, re.M), out
    assert re.search(r"^decoding call 1: 4 sequences of width [0-9]+, ", out, re.M), out


def test_generate_benchmark_runs_the_vllm_modes_through_the_standin(tmp_path):
    # vLLM's stand-in (tests/standins/vllm: vLLM cannot run here): the modes' engine start-up, the
    # persistent engine's sleep and wake-up before its later call, and the roofline line.
    (tmp_path / "tmp").mkdir()
    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests" / "standins")]),
           "TMPDIR": str(tmp_path / "tmp")}
    proc = subprocess.run([sys.executable, "tests/benchmarks/generate_cache.py", "--preset", "tiny-llama", "--dtype",
                           "float32", "--prompts", "2", "--attempts", "2", "--new-tokens", "4", "--repeats", "2",
                           "--modes", "vllm,vllm:persistent=true"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not list((tmp_path / "tmp").glob("syncrl-gen-*"))  # the benchmark's model is removed at its end
    out = proc.stdout
    for mode in ("vllm", "vllm:persistent=true"):
        assert re.search(rf"^{re.escape(mode)} +[0-9.]+s +[0-9]+ +[0-9]+ ", out, re.M), out
    assert len(re.findall(r"call 0: [0-9.]+s, [0-9]+ new tok/s after engine_start_s [0-9.]+s", out)) == 2, out
    # The persistent engine sleeps and wakes once, before its second call; its third follows that one.
    assert len(re.findall(r"call 1: [0-9.]+s, [0-9]+ new tok/s after sleep_s [0-9.]+s, wake_weights_s .*reload_s",
                          out)) == 1, out
    assert len(re.findall(r"call 2: [0-9.]+s, [0-9]+ new tok/s$", out, re.M)) == 2, out
    assert len(re.findall(r"roofline: all [0-9.e-]+s \([0-9]+ new tok/s\), [0-9.]+% of the first call, "
                          r"[0-9.]+% of a later one; one after the other [0-9.e-]+s", out)) == 2, out


def test_pipeline_benchmark_reports_every_figure(tmp_path, tiny_run):
    # The report of a finished run (the session's tiny run: running it is `syncrl run`'s, tested elsewhere).
    out = run(["tests/benchmarks/gpu_pipeline.py", "--report-only", "--iterations", "2", "--run-dir",
               str(tiny_run.dir), "--json", str(tmp_path / "pipe.json")], timeout=600)
    for needle in ("wall time per stage", "train start-up phases", "deepspeed_initialize", "checkpoint GB/s",
                   "start-up per stage", "non-compute share", "tensors differ from base", "process exit",
                   "preload past turn s", "train preload, started early", "deepspeed_lazy_modules",
                   "of roofline, shared", "handoff: the stage's marker held"):
        assert needle in out, needle
    import json
    figures = json.loads((tmp_path / "pipe.json").read_text())
    assert 0 < figures["non_compute_share"][0] < 1 and figures["checkpoint_bytes"] > 0
    for it in figures["iterations"]:  # reading each prompt once for its attempts can only lower the bound
        g = it["generate"]
        assert 0 < g["of_roofline_shared_prompts"] <= g["of_roofline"]["all"]
    assert all(it["train"]["preload_late_s"] >= 0 for it in figures["iterations"])
    exits = figures["iterations"][0]["exit_s"]  # a stage's marker comes after its ranks' markers
    assert sorted(exits) == sorted(["generate", "score", "gather", "train", "save", "persist"]) and min(exits.values()) >= 0
    # Gather's marker let train 1 (started early) go once train 0's checkpoint, written after its marker, was whole.
    gather = json.loads((tiny_run.dir / "iter_00001/markers/gather.done").read_text())
    assert gather["handoff_s"] >= 0 and figures["iterations"][1]["handoff_s"]["gather"] == gather["handoff_s"]
    assert "critical path, s" in out and "TB/s (H200, for no GPU)" in out and figures["hbm_bytes_per_s"] == 4.8e12
    for it in figures["iterations"]:  # the stages' spans add up to the iteration, their parts to each span
        path = it["critical_path"]
        assert sum(p["span_s"] for p in path.values()) == pytest.approx(it["iteration_s"])
        for p in path.values():
            assert sum(v for k, v in p.items() if k != "span_s") == pytest.approx(p["span_s"])
            assert p["start"] >= 0 and p["exit"] >= 0 and p["handoff"] >= 0 and p["work"] > 0
        assert path["generate"]["model load"] > 0
        # Train's model load is on the critical path, or was done before its turn (tuning.set_up_early).
        assert path["train"]["model load"] > 0 or it["train_preload"].get("set_up load_models", 0) > 0


def test_checkpoint_benchmark_reads_back_what_it_wrote_under_every_setting(tmp_path):
    # Two ranks (ZeRO-2 partitions), every variant: the script itself fails if any rank's optimizer
    # state reads back different.
    import json
    out = run(["-m", "torch.distributed.run", "--nproc-per-node", "2", "tests/benchmarks/checkpoint_io.py",
               "--preset", "tiny-llama", "--model-dir", str(tmp_path / "base"), "--dir", str(tmp_path / "ckpt"),
               "--json", str(tmp_path / "io.json")])
    assert "plain write" in out and out.count("read back identical") == 12 and "mean of 2:" in out
    rows = json.loads((tmp_path / "io.json").read_text())["results"]
    variants = ["default", "nocrc", "nocrc+mmap", "nocrc+mmap+pinned", "nocrc+mmap+pinned+threads",
                "nocrc+mmap+pinned+threads+staged"]  # staged: the plain load on CPU (nothing to move)
    assert [r["variant"] for r in rows] == variants + variants[::-1]  # mirrored second pass
    assert all(r["identical"] and r["bytes"] > 0 and r["save_s"] > 0 for r in rows)


def test_checkpoint_benchmarks_fingerprint_changes_with_any_element():
    # The benchmark checks a read-back state by these sums instead of a copy: one changed element,
    # or two swapped, must show, in the last partial chunk as in a whole one.
    from tests.benchmarks.checkpoint_io import fingerprint
    import torch
    t = torch.randn(1000)
    before = fingerprint(t, chunk=256)
    assert len(before) == 4 and fingerprint(t.clone(), chunk=256) == before
    changed = t.clone()
    changed[999] = torch.nextafter(changed[999], torch.tensor(1e9))
    swapped = t.clone()
    swapped[[3, 4]] = t[[4, 3]]
    assert fingerprint(changed, chunk=256) != before and fingerprint(swapped, chunk=256) != before


def test_checkpoint_benchmark_builds_a_shape_and_traces_its_last_load(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
                           "tests/benchmarks/checkpoint_io.py", "--shape", "small-llama-host", "--variants", "nocrc+mmap",
                           "--repeats", "2", "--profile", "--dir", str(tmp_path / "ckpt")],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "small-llama-host" in proc.stdout and proc.stdout.count("read back identical") == 2
    assert proc.stderr.count("PROFILE wall") == 1 and "aten::copy_" in proc.stderr  # the last load only


def test_save_export_benchmark_times_both_ways(tmp_path):
    import json
    out = run(["tests/benchmarks/save_export.py", "--preset", "tiny-llama", "--dtype", "float32", "--repeats", "1",
               "--dir", str(tmp_path / "w"), "--json", str(tmp_path / "s.json")])
    assert re.search(r"^mean: written [0-9.]+s, linked [0-9.]+s", out, re.M), out
    rows = json.loads((tmp_path / "s.json").read_text())["rows"]
    assert [(r["method"], r["export"]) for r in rows] == [("written", "written"), ("linked", "linked")]
    assert not (tmp_path / "w").exists()


def test_vllm_engine_benchmark_runs_its_cycles_against_the_standin(tmp_path):
    # vLLM's API from tests/standins (vLLM cannot run here): the benchmark's own logic, the
    # sleep/wake/reload cycle included, runs for real around it.
    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "standins"), str(ROOT)])}
    proc = subprocess.run([sys.executable, "tests/benchmarks/vllm_engine.py", "--work", str(tmp_path / "w"),
                           "--cache", str(tmp_path / "c"), "--preset", "tiny-llama", "--cycles", "2", "--prompts",
                           "3", "--attempts", "2", "--new-tokens", "6", "--json", str(tmp_path / "e.json")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "reload check: model b differs from a: True | model a again equals a: True" in proc.stdout
    import json
    figures = json.loads((tmp_path / "e.json").read_text())
    assert figures["startup"]["weights_s"] == 0.25 and len(figures["cycles"]) == 2
    assert all(c["reload_s"] > 0 and c["new_tokens"] > 0 for c in figures["cycles"])


def test_compare_trees_runs_the_command_in_each_revision_in_turn(tmp_path):
    """Each run imports its own tree's code (not the checkout's), the order turns round every other
    round, and a run past its timeout is stopped and reported while the rest go on."""
    trees = tmp_path / "trees"
    out = run(["tests/benchmarks/compare_trees.py", "archive", "--out", str(trees), "old=HEAD", "new=HEAD"])
    assert "old: HEAD" in out and "new: HEAD" in out and (trees / "new" / "stages" / "train.py").is_file()
    probe = "import stages, time; print('imported from', stages.__file__); time.sleep(float('{name}' == 'slow'))"
    out = run(["tests/benchmarks/compare_trees.py", "run", "--trees", str(trees / "old"), str(trees / "new"),
               "--rounds", "2", "--logs", str(tmp_path / "logs"), "--grep", "imported from", "--",
               sys.executable, "-c", probe])
    heads = re.findall(r"^## (\w+), round (\d):", out, re.M)
    assert heads == [("old", "0"), ("new", "0"), ("new", "1"), ("old", "1")], out
    for name in ("old", "new"):
        assert out.count(f"imported from {trees / name / 'stages' / '__init__.py'}") == 2, out
    assert (tmp_path / "logs" / "new_round1.log").is_file()

    (trees / "old").rename(trees / "slow")
    proc = subprocess.run([sys.executable, "tests/benchmarks/compare_trees.py", "run", "--trees", str(trees / "slow"),
                           str(trees / "new"), "--timeout", "5", "--logs", str(tmp_path / "logs"), "--",
                           sys.executable, "-c", probe.replace("float(", "60 * float(")],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert re.search(r"## slow, round 0: [\d.]+s, timed out", proc.stdout), proc.stdout
    assert re.search(r"## new, round 0: [\d.]+s, exit 0", proc.stdout), proc.stdout

