"""End to end on this machine: the real stages, LocalLauncher, DeepSpeed over gloo, 2 ranks."""

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stages.runtime.paths import STAGES
from tests.conftest import TINY_RUN

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
# Small enough for CI's 2 cores: 8 prompts x 4 samples per iteration.
# start_early=always: the 2-core test machine would not start stages early on its own (auto).
SMALL = ["start_early=always", "data.prompts_per_iteration=8", "generate.attempts=4", "train.micro_batch_size=16"]


def syncrl(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "jobs.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_two_iterations_then_everything_skipped(tiny_run):
    run, proc = tiny_run.dir, tiny_run.proc
    for it in (0, 1):
        d = run / f"iter_{it:05d}"
        for stage in STAGES:
            assert (d / "markers" / f"{stage}.done").is_file(), (it, stage)
        assert sorted(p.name for p in (d / "generate").glob("rank_*.jsonl")) == ["rank_00000.jsonl",
                                                                               "rank_00001.jsonl"]
        assert (d / "gather" / "train.jsonl").is_file() and (d / "gather" / "stats.json").is_file()
        for stage, ranks in (("generate", 2), ("score", 2), ("gather", 1), ("train", 2), ("save", 1)):
            logs = sorted((run / "logs" / f"iter_{it:05d}" / stage / "attempt_1").glob("rank_*.log"))
            assert len(logs) == ranks, (it, stage, logs)
            assert "[n0:r0]" in logs[0].read_text()
        # Train wrote the run dir's checkpoint: the coordinator marked persist done, starting no process.
        assert not (run / "logs" / f"iter_{it:05d}" / "persist").exists()
        assert "nothing to persist" in json.loads((d / "markers" / "persist.done").read_text())["summary"]
        row = json.loads((d / "generate" / "rank_00001.jsonl").read_text().splitlines()[0])
        assert len(row["completion_ids"]) == len(row["logprobs"]) > 0 and row["rank"] == 1

    from transformers import AutoModelForCausalLM, AutoTokenizer
    m0 = AutoModelForCausalLM.from_pretrained(run / "models" / "iter_00000")
    m1 = AutoModelForCausalLM.from_pretrained(run / "models" / "iter_00001")
    AutoTokenizer.from_pretrained(run / "models" / "iter_00001")
    w0, w1 = m0.state_dict(), m1.state_dict()
    assert any(not (w0[k] == w1[k]).all() for k in w0), "training changed no weight"

    # train, save and the next generate were started early (each then waited for its turn, or was
    # still preloading when it came); timings exclude the wait.
    for it, stage in ((0, "train"), (0, "save"), (1, "generate"), (1, "train"), (1, "save")):
        m = json.loads((run / f"iter_{it:05d}" / "markers" / f"{stage}.rank_00000.done").read_text())
        assert m["started_early_waited_s"] + m["started_early_late_s"] > 0, (it, stage)
        # Where its life before the turn went: the interpreter and imports, then preload's parts.
        parts = m["preload_phases"]
        if stage == "train":
            preload = {"imports", "deepspeed", "deepspeed_lazy_modules", "model_code", "rehearsal", "freeze_objects"}
            # tuning.set_up_early: once generate's processes had exited (the coordinator's note), the
            # engine was built before the turn if the preload was done by then; the turn only read the
            # train set.
            set_up = {"waited_for_gpus", *(f"set_up {k}" for k in ("import_deepspeed", "devices", "process_group",
                                                                    "load_models", "deepspeed_initialize",
                                                                    "resume_checkpoint"))}
            assert set(parts) in (preload, preload | set_up), parts
            assert set(m["startup_phases"]) == ({"read_train_set", "barrier"} if set_up <= set(parts) else
                                  {"import_deepspeed", "devices", "process_group", "load_models",
                                   "deepspeed_initialize", "resume_checkpoint", "read_train_set", "barrier"})
            assert sum(parts.values()) == pytest.approx(m["import_s"], abs=1.0), (parts, m["import_s"])
            assert json.loads(markers_note(run, it).read_text())["attempt"] == 1
        assert parts["imports"] > 0 and parts["freeze_objects"] >= 0  # its objects left out of later collections
        # Its log names the process from its first line, and its start line (`pid=`) at the turn.
        log = (run / "logs" / f"iter_{it:05d}" / stage / "attempt_1" / "rank_00000.log").read_text()
        first = next(line for line in log.splitlines() if line.startswith("[n0:r0]"))
        who = re.search(rf"{stage} iteration {it} attempt 1 started early on host (\S+) as process (\d+) \(rank 0/",
                        first)
        assert who and re.search(rf"attempt 1: host={re.escape(who[1])} pid={who[2]} ", log), log[:2000]
    assert "iteration 0 train    started early (attempt 1): loading while generate runs" in proc.stderr
    assert "iteration 1 train    started early (attempt 1): loading while generate runs" in proc.stderr
    assert "iteration 1 save     started early (attempt 1): loading while generate runs" in proc.stderr
    assert "iteration 1 generate started early (attempt 1): loading while generate runs" in proc.stderr
    train = json.loads((run / "iter_00001" / "markers" / "train.done").read_text())
    assert train["world_size"] == 2 and train["steps"] >= 1
    # tuning.deferred_checkpoint (the default): train marked done, then wrote its checkpoint; save
    # exported from the policy file train wrote before its marker (iteration 1's save removed iteration
    # 0's). save.keep_checkpoints=1: once iteration 1's checkpoint was there, train removed iteration 0's.
    assert train["deferred_checkpoint"]["id"] == json.loads(
        (run / "checkpoints" / "iter_00001" / "syncrl-checkpoint.json").read_text())["id"]
    assert sorted(p.name for p in (run / "checkpoints").glob("iter_*")) == ["iter_00001"]
    train_log = (run / "logs" / "iter_00001" / "train" / "attempt_1" / "rank_00000.log").read_text()
    assert "pruned checkpoints/iter_00000" in train_log and "checkpoint written after the marker" in train_log
    save = json.loads((run / "iter_00001" / "markers" / "save.done").read_text())
    assert save["pruned"] == ["iter_00000/train/policy.safetensors"]
    assert (run / "iter_00001" / "train" / "policy.safetensors").is_file()

    again = syncrl("run", TINY_RUN[0], f"run_dir={run}", *TINY_RUN[1:])
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stderr.count("already done, skipping") == 2 * len(STAGES)
    assert "launching" not in again.stderr

    status = syncrl("status", str(run))
    assert status.returncode == 0 and "12/12 stages done" in status.stdout
    check_observability(run)


def markers_note(run, it):
    """The coordinator's note that the GPUs were free for train of iteration `it` (before its turn)."""
    return run / f"iter_{it:05d}" / "markers" / "gpus_free_for_train.json"


# What every iteration must report (metrics.jsonl and W&B), whatever the stage that measured it.
EXPECTED_METRICS = [
    "rollout/reward_mean", "rollout/reward_std", "rollout/accuracy", "rollout/zero_variance_groups",
    "rollout/length_mean", "rollout/length_max", "rollout/truncated", "train/loss_mean", "train/grad_norm_mean",
    "train/lr", "generate/tokens_per_s", "train/tokens_per_s", "train/startup_s",
    *[f"{s}/duration_s" for s in STAGES], *[f"{s}/retries" for s in STAGES],
    # Persist without node-local checkpoints is marked done by the coordinator: no process, no memory.
    *[f"{s}/memory/host_rss_peak_gib" for s in STAGES if s != "persist"],
]


def check_observability(run):
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for it in (0, 1):
        merged = {k: v for r in rows if r["iteration"] == it for k, v in r.items()}
        missing = [k for k in EXPECTED_METRICS if k not in merged]
        assert not missing, (it, missing)
    # One W&B run for the RL run (offline here: no API key), resumed rather than duplicated.
    run_id = (run / "wandb_run_id").read_text().strip()
    offline = sorted((run / "wandb").glob("offline-run-*"))
    assert offline and all(p.name.endswith(run_id) for p in offline), offline
    logged = b"".join(p.read_bytes() for d in offline for p in d.glob("run-*.wandb"))
    for key in ("rollout/accuracy", "train/loss_mean", "generate/tokens_per_s", "save/duration_s"):
        assert key.encode() in logged, key
    report = syncrl("report", str(run))
    assert report.returncode == 0, report.stderr
    assert (run / "report.png").stat().st_size > 10_000
    assert "| 1 |" in (run / "report.md").read_text()


def test_killed_during_train_resumes_without_redoing_completed_stages(tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "jobs.cli", "run", "configs/local_tiny.yaml", f"run_dir={run}", "iterations=1",
           *SMALL]
    log = open(tmp_path / "coordinator.log", "w")
    coord = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    train_log = run / "logs" / "iter_00000" / "train" / "attempt_1" / "rank_00000.log"
    deadline = time.monotonic() + 300
    while not (train_log.is_file() and "train iteration 0 attempt 1:" in train_log.read_text()):  # past any early wait
        assert coord.poll() is None, (tmp_path / "coordinator.log").read_text()
        assert time.monotonic() < deadline, "train never started"
        time.sleep(0.1)
    coord.send_signal(signal.SIGKILL)  # no chance to clean up: ranks must still go down with it
    coord.wait(30)

    done_before = {p.name: (p.stat().st_mtime_ns, p.read_bytes())
                   for p in (run / "iter_00000" / "markers").glob("*.done")}
    assert {"generate.done", "score.done", "gather.done"} <= set(done_before)
    assert "train.done" not in done_before
    shards_before = {p: p.stat().st_mtime_ns for p in (run / "iter_00000").glob("*/rank_*.jsonl")}
    _wait_for_rank_exit(run)

    status = syncrl("status", str(run))
    assert "interrupted" in status.stdout, status.stdout

    proc = syncrl("run", "configs/local_tiny.yaml", f"run_dir={run}", "iterations=1", *SMALL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for stage in ("generate", "score", "gather"):
        assert f"iteration 0 {stage:<8} already done, skipping" in proc.stderr
        name = f"{stage}.done"
        assert (run / "iter_00000" / "markers" / name).read_bytes() == done_before[name][1]
        assert (run / "iter_00000" / "markers" / name).stat().st_mtime_ns == done_before[name][0]
        assert not (run / "logs" / "iter_00000" / stage / "attempt_2").exists()
    for p, mtime in shards_before.items():
        assert p.stat().st_mtime_ns == mtime, f"{p} was rewritten"
    assert (run / "logs" / "iter_00000" / "train" / "attempt_2").is_dir()
    assert (run / "iter_00000" / "markers" / "save.done").is_file()
    assert (run / "models" / "iter_00000" / "model.safetensors").is_file()
    # The restarted coordinator resumed the killed one's W&B run: one run id for the RL run.
    run_id = (run / "wandb_run_id").read_text().strip()
    offline = list((run / "wandb").glob("offline-run-*"))
    assert len(offline) == 2 and all(p.name.endswith(run_id) for p in offline), offline


GATED_REWARD = """
import os, time


def reward(completion, row, cfg):
    # Holds score until the test opens the gate (bounded), so that train's early set-up comes first.
    deadline = time.monotonic() + 300
    while not os.path.exists(os.environ["SYNCRL_TEST_SCORE_GATE"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return float(len(completion) % 2)
"""


def test_a_train_rank_killed_while_setting_up_before_its_turn_costs_that_attempt_only(tmp_path):
    # tuning.set_up_early: train's processes build their engine while score runs (held here by a
    # reward function that waits for a file). Rank 1 is killed then: the attempt fails with rank 1
    # named, a fresh attempt runs at the turn, and nothing done before is redone.
    import os

    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "gated_rewards.py").write_text(GATED_REWARD)
    gate, run = tmp_path / "gate", tmp_path / "run"
    env = {**os.environ, "SYNCRL_TEST_SCORE_GATE": str(gate),
           "PYTHONPATH": os.pathsep.join([str(plugins), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "jobs.cli", "run", "configs/local_tiny.yaml", f"run_dir={run}", "iterations=1",
           *SMALL, "score.reward_fn=gated_rewards:reward", "retry.backoff_s=0.5"]
    out = open(tmp_path / "coordinator.log", "w")
    coord = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
    log = run / "logs" / "iter_00000" / "train" / "attempt_1" / "rank_00001.log"
    deadline = time.monotonic() + 400
    while not (log.is_file() and (m := re.search(r"setting up before the turn \(process (\d+)\)", log.read_text()))):
        assert coord.poll() is None, (tmp_path / "coordinator.log").read_text()
        assert time.monotonic() < deadline, "train never set up before its turn"
        time.sleep(0.05)
    os.kill(int(m[1]), signal.SIGKILL)
    assert not (run / "iter_00000" / "markers" / "score.done").exists()  # still before the turn
    gate.touch()
    assert coord.wait(600) == 0, (tmp_path / "coordinator.log").read_text()[-3000:]
    text = (tmp_path / "coordinator.log").read_text()
    assert "iteration 0 train    the GPUs are free: it sets up before its turn" in text
    assert re.search(r"iteration 0 train attempt 1 failed on rank\(s\) (0,)?1\b", text), text[-3000:]
    assert json.loads((run / "iter_00000" / "markers" / "train.done").read_text())["attempt"] == 2
    for stage in ("generate", "score", "gather"):
        assert not (run / "logs" / "iter_00000" / stage / "attempt_2").exists(), stage
    assert (run / "models" / "iter_00000" / "model.safetensors").is_file()


def _wait_for_rank_exit(run, timeout=30):
    """The killed coordinator's ranks get SIGTERM from the kernel (parent-death signal); wait for them."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = subprocess.run(["pgrep", "-f", "--", f"--run-dir {run}"], capture_output=True, text=True).stdout
        alive = [pid for pid in out.split() if _is_live(pid)]
        if not alive:
            return
        time.sleep(0.2)
    raise AssertionError(f"ranks of the killed run still alive: {alive}")


def _is_live(pid):
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"  # zombies are reaped slowly here; they hold nothing


def test_zero3_with_kl_and_rloo_resumes_sharded_optimizer_and_generate_spreads_over_two_ranks_slots(tmp_path):
    # One run for two settings that do not meet: train's ZeRO-3 with a KL term, RLOO advantages and
    # torch.compile, and generate.gpus_per_process=2 (one generate, and score, task takes both rank
    # slots, its process sampling with a second one on the policy sharded over both; train keeps 2
    # ranks).
    run = tmp_path / "run"
    proc = syncrl("run", "configs/local_tiny.yaml", f"run_dir={run}", "iterations=2", *SMALL,
                  "train.deepspeed_config=configs/ds_zero3_cpu.json", "train.kl_coef=0.1", "gather.advantage=rloo",
                  "train.compile=aot_eager",  # dynamo traces through ZeRO-3's hooks; no kernels built on CPU
                  "tuning.max_tokens_per_micro_batch=40",  # each rank's 16 rows of ~6 tokens: 3 micro-batches
                  "generate.gpus_per_process=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for it in (run / "iter_00000", run / "iter_00001"):
        assert [p.name for p in sorted((it / "generate").glob("rank_*.jsonl"))] == ["rank_00000.jsonl"]
        assert [p.name for p in sorted((it / "score").glob("rank_*.jsonl"))] == ["rank_00000.jsonl"]
        rows = (it / "generate" / "rank_00000.jsonl").read_text().splitlines()
        assert len(rows) == 8 * 4  # every prompt of the iteration x attempts, in the one shard
        worlds = [json.loads((it / "markers" / f"{s}.done").read_text())["world_size"] for s in ("generate", "train")]
        assert worlds == [1, 2]
        assert json.loads((it / "markers" / "generate.rank_00000.done").read_text())["sampling"]["tensor_parallel"] == 2
    log = (run / "logs" / "iter_00001" / "train" / "attempt_1" / "rank_00001.log").read_text()
    assert "ZeRO stage 3" in log and "resumed weights and optimizer state" in log
    assert re.search(r"policy and \d+ reference layers compiled with torch.compile backend aot_eager", log)
    steps = [json.loads(line) for line in (run / "iter_00001" / "train" / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 2 and all(s["kl"] >= 0 for s in steps)  # one step of 32 rows per epoch, however grouped
    assert steps[1]["step"] == steps[0]["step"] + 1  # one record per optimizer step, in order
    assert any(s["kl"] > 0 for s in steps)  # the policy moved away from the reference in iteration 0
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(run / "models" / "iter_00001")
    # The checkpoint went to disk after train's marker (tuning.deferred_checkpoint, the default): no rank
    # holds ZeRO-3's weights whole, so train gathered them from the shards into the file save linked
    # in, and that export is the checkpoint's fp32 master weights.
    train = json.loads((run / "iter_00001" / "markers" / "train.done").read_text())
    assert "iter_00001/train/policy.safetensors" in train["outputs"] and "deferred_checkpoint" in train
    assert "checkpoint written after the marker" in log
    assert json.loads((run / "iter_00001" / "markers" / "save.done").read_text())["export"] == "linked"
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file

    master = get_fp32_state_dict_from_zero_checkpoint(str(run / "checkpoints"), tag="iter_00001")
    exported = load_file(run / "models" / "iter_00001" / "model.safetensors")
    assert all(torch.equal(exported[k], master[k].to(exported[k].dtype)) for k in exported)


def test_rerun_acts_on_the_run_dir_given_not_the_one_its_config_records(tmp_path, tiny_run):
    import shutil

    original = tiny_run.dir
    before = {p: p.stat().st_mtime_ns for p in original.rglob("*")}
    copy = tmp_path / "copy"
    shutil.copytree(original, copy)
    proc = syncrl("rerun", str(copy), "--iteration", "0", "--stage", "score")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (copy / "logs" / "iter_00000" / "score" / "attempt_2").is_dir()
    assert {p: p.stat().st_mtime_ns for p in original.rglob("*")} == before  # the original is untouched
    # Moved: the old path is not recreated.
    moved = tmp_path / "moved"
    copy.rename(moved)
    proc = syncrl("rerun", str(moved), "--iteration", "0", "--stage", "gather")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not copy.exists() and (moved / "logs" / "iter_00000" / "gather" / "attempt_2").is_dir()


def test_a_non_finite_gradient_stops_train_and_keeps_what_was_done(tmp_path, tiny_run):
    # With DeepSpeed's bf16 overflow check off (configs/ds_zero2_gpu.json) train itself stops at the
    # first step whose gradient norm is not finite: lr 1e30 makes step 1's weights overflow step 2.
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(tiny_run.dir, copy)
    for marker in (copy / "iter_00000" / "markers").glob("train*"):
        marker.unlink()
    curve = (copy / "iter_00000" / "train" / "metrics.jsonl").read_text()
    ds = json.loads((ROOT / "configs" / "ds_zero2_cpu.json").read_text())
    ds["bf16"] = {"enabled": True, "check_grad_overflow": False}
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    proc = subprocess.run([sys.executable, "-m", "stages.train", "--run-dir", str(copy), "--iteration", "0",
                           "train.lr=1e30", f"train.deepspeed_config={tmp_path / 'ds.json'}", "model.dtype=bfloat16"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert "rank 0: optimizer step 2 of iteration 0 has a non-finite gradient norm" in proc.stderr
    assert '"check_grad_overflow": true' in proc.stderr  # the fix, named
    assert not (copy / "iter_00000" / "markers" / "train.rank_00000.done").exists()
    assert (copy / "iter_00000" / "train" / "metrics.jsonl").read_text() == curve  # nothing of the attempt kept
