"""How launchers size and place each stage's tasks, including generate processes that span several GPUs."""

import shutil
from pathlib import Path

import pytest

from jobs.launchers import LocalLauncher, SrunLauncher, make_launcher
from stages.runtime.config import SlurmConfig, load_config
from stages.runtime.paths import RunPaths


def test_local_generate_groups_take_a_slice_of_the_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    launcher = LocalLauncher(4, generate_group=2)
    assert [launcher.ntasks(s) for s in ("generate", "score", "gather", "train", "save")] == [2, 2, 1, 4, 1]
    assert [launcher.visible_gpus("generate", r) for r in (0, 1)] == ["4,5", "6,7"]
    assert launcher.visible_gpus("train", 3) is None  # one GPU per train rank, chosen by local rank


@pytest.mark.skipif(shutil.which("scontrol") is None, reason="needs scontrol to expand the nodelist")
def test_srun_generate_groups_get_their_gpus_and_cpus(tmp_path):
    cfg = SlurmConfig(tasks_per_node=8, gpus_per_task=1, cpus_per_task=4)
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n1,n2"}
    launcher = SrunLauncher(cfg, env=env, generate_group=4)
    paths = RunPaths(tmp_path)
    gen, _ = launcher.command(paths, 0, "generate", 1)
    train, _ = launcher.command(paths, 0, "train", 1)
    assert {"--ntasks=4", "--ntasks-per-node=2", "--gpus-per-task=4", "--cpus-per-task=16"} <= set(gen)
    assert {"--ntasks=16", "--ntasks-per-node=8", "--gpus-per-task=1", "--cpus-per-task=4"} <= set(train)
    assert launcher.ntasks("score") == 4


def test_group_must_divide_the_ranks_per_node():
    from jobs.check import check

    cfg = load_config(None, ["run_dir=/tmp/x", "ranks=3", "generate.gpus_per_process=2", "slurm.tasks_per_node=8"])
    problems = check(cfg, "local", env={})
    assert any("ranks (3) is not a multiple of generate.gpus_per_process (2)" in p and "set ranks to 2" in p
               for p in problems), problems
    with pytest.raises(ValueError, match="ranks \\(3\\) is not a multiple"):
        make_launcher("local", cfg)
    cfg = load_config(None, ["run_dir=/tmp/x", "ranks=4", "generate.gpus_per_process=2"])
    assert make_launcher("local", cfg).ntasks("generate") == 2
    assert not [p for p in check(cfg, "local", env={}) if "gpus_per_process" in p]


@pytest.mark.parametrize("cores,mode,expected", [("6", "auto", False), ("8", "auto", True), ("48(x2)", "auto", True),
                                                 ("48", "never", False), ("1", "always", True)])
def test_start_early_auto_needs_four_cores_per_rank(tmp_path, monkeypatch, cores, mode, expected):
    from jobs.coordinator import Coordinator

    monkeypatch.setenv("SLURM_CPUS_ON_NODE", cores)
    cfg = load_config(None, [f"run_dir={tmp_path}", "ranks=2", f"start_early={mode}", "wandb.enabled=false"])
    assert Coordinator(cfg, LocalLauncher(2))._starts_early() is expected


def test_an_early_step_that_gave_up_waiting_is_started_afresh_and_one_that_failed_counts(tmp_path):
    import subprocess
    import sys
    import time

    from jobs.coordinator import Coordinator
    from jobs.launchers import LocalStep
    from stages.runtime.stage import EXIT_GAVE_UP_WAITING

    cfg = load_config(None, [f"run_dir={tmp_path}", "wandb.enabled=false"])
    coord = Coordinator(cfg, LocalLauncher(2))

    def step(*codes):
        return LocalStep({r: subprocess.Popen([sys.executable, "-c", f"raise SystemExit({c})"])
                          for r, c in enumerate(codes)})

    gave_up, finished, waiting = step(EXIT_GAVE_UP_WAITING, EXIT_GAVE_UP_WAITING), step(0, 0), LocalStep(
        {0: subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])})
    # A rank killed or raising once its turn came: the attempt counts, and its failure is reported.
    killed = LocalStep({0: subprocess.Popen([sys.executable, "-c", "pass"]),
                        1: subprocess.Popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), 9)"])})
    time.sleep(1.0)
    coord.early = {(0, "train"): (gave_up, 1, None), (0, "save"): (finished, 1, None),
                   (1, "generate"): (waiting, 2, None), (1, "score"): (killed, 1, None)}
    assert coord._take_early(0, "train") == (None, None)  # gave up waiting: launched anew, no attempt used
    assert coord._take_early(0, "save") == (finished, 1)  # already done after its turn: its result counts
    assert coord._take_early(1, "generate") == (waiting, 2)
    assert coord._take_early(1, "score") == (killed, 1)
    assert killed.wait(1).failed_ranks == [1]
    assert coord._take_early(1, "train") == (None, None) and not coord.early
    waiting.cancel()


def test_train_started_early_is_told_the_gpus_are_free_once_no_gpu_stage_is_left(tmp_path):
    # jobs/coordinator.py _note_gpus_free, called while the light stages run: train of the iteration,
    # started early, may set up on the GPUs once generate's processes have exited and the checkpoint it
    # resumes is published; the note names the attempt it is for.
    import json
    import subprocess
    import sys

    from jobs.coordinator import Coordinator
    from jobs.launchers import LocalStep
    from stages.runtime import markers

    cfg = load_config(None, [f"run_dir={tmp_path}", "wandb.enabled=false"])
    coord = Coordinator(cfg, LocalLauncher(2))
    paths = RunPaths(tmp_path)
    for it in (0, 1):
        paths.markers(it).mkdir(parents=True)
    note = markers.gpus_free_path(paths, 1, "train")
    exiting = LocalStep({0: subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"])})
    coord.early = {(1, "train"): (None, 3, None), (1, "generate"): (None, 1, None), (2, "train"): (None, 1, None)}
    coord.exiting = {(1, "generate"): exiting}
    # Train 0 wrote its checkpoint after its marker, and it is not there yet.
    markers.write_json_atomic(markers.marker_path(paths, 0, "train"), {"deferred_checkpoint": {"id": "abc"}})
    coord._note_gpus_free(1)
    assert not note.exists()  # generate's process is still exiting
    exiting.wait(10)
    coord._note_gpus_free(1)
    assert not note.exists()  # the checkpoint train 1 resumes is not published
    markers.write_json_atomic(markers.marker_path(paths, 0, "train"), {})
    coord._note_gpus_free(1)
    assert json.loads(note.read_text())["attempt"] == 3  # the early attempt's
    # Only for train (generate does not set up early) of this iteration.
    assert sorted(p.name for p in paths.markers(1).glob("gpus_free_for_*")) == ["gpus_free_for_train.json"]
    assert not paths.markers(2).exists()
    # tuning.set_up_early=false: no note.
    off = Coordinator(load_config(None, [f"run_dir={tmp_path}", "wandb.enabled=false", "tuning.set_up_early=false"]),
                      LocalLauncher(2))
    off.early = {(0, "train"): (None, 1, None)}
    off._note_gpus_free(0)
    assert not markers.gpus_free_path(paths, 0, "train").exists()


def test_a_process_started_early_sets_up_before_its_turn_once_the_gpus_are_free_for_its_attempt(tmp_path):
    # stages/runtime/stage.py wait_for_turn with set_up: a note for another attempt is not this one's;
    # once its own comes, set_up runs before the turn, as the attempt's (a failure in it is recorded);
    # where the turn comes first, set_up is left to the turn.
    import threading
    import time

    from stages.runtime import markers
    from stages.runtime.stage import StageContext, wait_for_turn

    paths = RunPaths(tmp_path)
    paths.markers(1).mkdir(parents=True)
    note, turn = markers.gpus_free_path(paths, 1, "train"), paths.markers(1) / "gather.done"
    markers.write_json_atomic(note, {"attempt": 1})
    ctx = StageContext(stage="train", iteration=1, cfg=None, paths=paths, info=None, attempt=2, config_hash="",
                       inputs="", waiting=True)
    seen = []

    def set_up(c):
        seen.append((c.turn_came(), c.waiting))
        return "engine"

    before_own_note = []

    def later():
        time.sleep(0.5)
        before_own_note.append((list(seen), ctx.gpus_free()))
        markers.write_json_atomic(note, {"attempt": 2})
        time.sleep(0.5)
        turn.write_text("{}")

    threading.Thread(target=later).start()
    assert wait_for_turn(ctx, str(turn), timeout_s=10, preload=None, set_up=set_up) is not None
    assert before_own_note == [([], False)]  # the stale note (attempt 1) is not this attempt's
    assert seen == [(False, False)] and ctx.set_up == "engine" and ctx.gpus_free()
    assert ctx.preload_phases["waited_for_gpus"] >= 0.4

    # The turn already there: nothing before it, whatever the note says.
    late = StageContext(stage="train", iteration=1, cfg=None, paths=paths, info=None, attempt=2, config_hash="",
                        inputs="", waiting=True)
    assert wait_for_turn(late, str(turn), timeout_s=10, preload=None, set_up=set_up) is not None
    assert len(seen) == 1 and late.set_up is None and late.waiting


def _procs(*scripts):
    import subprocess
    import sys

    return {r: subprocess.Popen([sys.executable, "-c", code], start_new_session=True) for r, code in enumerate(scripts)}


def test_a_step_done_by_its_markers_leaves_the_ranks_still_exiting_running(tmp_path):
    import time

    from jobs.launchers import LocalStep

    marker = tmp_path / "rank_1.done"
    # Rank 0 exits at once; rank 1 writes its "marker", then takes long to exit (a slow teardown).
    step = LocalStep(_procs("pass", f"import pathlib, time; pathlib.Path({str(marker)!r}).touch(); time.sleep(60)"))
    t0 = time.monotonic()
    # Done once rank 0 has exited too: the check runs every few tens of ms, maybe before it has.
    result = step.wait(30, done=lambda: marker.exists() and step.procs[0].poll() is not None)
    assert time.monotonic() - t0 < 10 and result.ok and result.lingering == (1,)
    assert step.running() is False and step.procs[1].poll() is None  # rank 1 still there, not killed
    joined = step.wait(0.5)  # the coordinator's join: past its grace it is killed
    assert joined.timed_out and step.procs[1].poll() is not None


def test_done_does_not_end_the_wait_once_a_rank_has_failed(tmp_path):
    from jobs.launchers import LocalStep

    marker = tmp_path / "rank_1.done"
    step = LocalStep(_procs("raise SystemExit(3)",
                            f"import pathlib, time; time.sleep(1); pathlib.Path({str(marker)!r}).touch(); time.sleep(60)"))
    result = step.wait(30, done=marker.exists)
    # Rank 0 failed first: the peers are stopped as ever (PEER_GRACE_S), none is left running.
    assert not result.ok and result.returncodes[0] == 3 and result.lingering == ()
    assert all(p.poll() is not None for p in step.procs.values())


@pytest.mark.slurm
def test_an_srun_step_done_by_its_markers_is_left_to_exit_then_joined(slurm_cluster, tmp_path):
    import subprocess
    import threading
    import time

    from jobs.launchers import SrunStep, _relay_srun_messages

    done = [tmp_path / f"rank_{r}.done" for r in (0, 1)]
    proc = subprocess.Popen(["srun", "--nodes=2", "--ntasks-per-node=1", "--time=2", "bash", "-c",
                             f"touch {tmp_path}/rank_$SLURM_PROCID.done; sleep 120"],
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    messages: list[str] = []
    reader = threading.Thread(target=_relay_srun_messages, args=(proc.stderr, messages), daemon=True)
    reader.start()
    step = SrunStep(proc, reader, messages, 2)
    t0 = time.monotonic()
    result = step.wait(60, done=lambda: all(p.exists() for p in done))
    assert result.ok and result.lingering == (0, 1) and time.monotonic() - t0 < 30
    assert step.running()  # its tasks still there
    joined = step.wait(1)
    assert joined.timed_out and not step.running()


def test_the_local_master_port_is_outside_the_kernels_ephemeral_range():
    # A stage started early binds its port only when its turn comes: one the kernel could hand to
    # another connection meanwhile made a train attempt fail with EADDRINUSE.
    import socket

    from jobs.launchers import free_port

    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    ports = {free_port() for _ in range(20)}
    assert all(port < low for port in ports) and len(ports) > 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))


def test_the_srun_master_port_is_outside_the_nodes_ephemeral_range():
    # The same hazard on a cluster: the port every rank of an srun step derives from the job, the
    # iteration, the attempt and the stage must not be one the kernel hands to outgoing connections.
    from jobs.launchers import derived_port, ephemeral_ports

    keys = [(str(job), it, attempt, stage) for job in (7, 123456) for it in range(20) for attempt in (1, 2)
            for stage in ("generate", "train", "save")]
    low, high = ephemeral_ports()
    here = [derived_port(*key) for key in keys]
    assert all(20000 <= p < low or high < p <= 65535 for p in here) and len(set(here)) > len(keys) * 0.9
    assert here == [derived_port(*key) for key in keys]  # every rank of a step derives the same one
    assert all(20000 <= derived_port(*k, ephemeral=(32768, 60999)) < 32768 for k in keys)
    assert all(40000 < derived_port(*k, ephemeral=(1024, 40000)) <= 65535 for k in keys)
    # A node whose ephemeral range leaves no room outside it: anywhere in 20000-59999.
    assert all(20000 <= derived_port(*k, ephemeral=(1024, 65000)) < 60000 for k in keys)
