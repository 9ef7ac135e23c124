"""The distributed runtime: the env table and the progress watchdog."""

from stages.runtime.dist import dist_info


def test_env_table_slurm_and_torchrun_names():
    slurm = dist_info({"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8", "SLURM_NODEID": "2",
                       "SLURM_STEP_NUM_NODES": "4", "MASTER_ADDR": "n1", "MASTER_PORT": "23456"})
    assert (slurm.rank, slurm.local_rank, slurm.world_size, slurm.node_id, slurm.num_nodes) == (5, 1, 8, 2, 4)
    assert slurm.tag == "n2:r5" and slurm.master_addr == "n1" and slurm.master_port == 23456
    # torchrun's names win: torchrun inside an allocation knows the real layout
    both = dist_info({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "RANK": "3", "WORLD_SIZE": "4"})
    assert (both.rank, both.world_size) == (3, 4)
    alone = dist_info({})
    assert (alone.rank, alone.world_size, alone.is_main) == (0, 1, True)


def test_progress_watchdog_ends_a_stuck_process(tmp_path):
    import subprocess
    import sys
    code = ("import time, logging\n"
            "logging.basicConfig()\n"
            "from stages.runtime.dist import ProgressWatchdog\n"
            "w = ProgressWatchdog(0.5, lambda msg: open(r'%s', 'w').write(msg))\n"
            "for _ in range(5):\n    time.sleep(0.2)\n    w.beat('stepping')\n"
            "w.rest()\n"  # a wait with a bound of its own (train's, for its turn): no limit meanwhile
            "time.sleep(1.5)\n"
            "w.beat('waiting for a peer')\n"
            "time.sleep(60)\n") % (tmp_path / "record")
    t0 = __import__("time").monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3
    assert __import__("time").monotonic() - t0 < 30
    assert "in phase 'waiting for a peer'" in proc.stderr
    assert "no progress for" in (tmp_path / "record").read_text()


def test_communication_env_respects_the_user_and_turns_on_debug_for_retries():
    from stages.runtime.dist import communication_env
    env = {"NCCL_DEBUG": "TRACE"}
    changed = communication_env(1, env=env)
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3" and env["NCCL_DEBUG"] == "TRACE"
    assert "NCCL_DEBUG" not in changed
    env = {}
    communication_env(2, "ib0", env=env)
    assert env["NCCL_DEBUG"] == "INFO" and env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "ib0"
