"""Session fixture ``slurm_cluster``: a real two-node SLURM cluster (n1, n2) on this machine.

Import it from conftest.py (``from tests.slurm_fixture import slurm_cluster``) or load this module as a
plugin (``pytest -p tests.slurm_fixture``). If ``sinfo`` already shows n1 and n2 up, the running
cluster is used as is; otherwise ``bash slurm/local_cluster.sh start`` is run once per session. The
cluster is left running afterwards (starting it again costs ~1-10 s; stop it with
``bash slurm/local_cluster.sh stop``).

Tests are skipped when the machine cannot host the cluster (the script exits 3: not root, no
apt-get, packages not installable); any other failure of the script fails the tests loudly, because
it means the script itself is broken.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
CLUSTER_SCRIPT = REPO_ROOT / "slurm" / "local_cluster.sh"
NODES = ("n1", "n2")
PARTITION = "debug"
# local_cluster.sh's exit code for "this machine cannot host the cluster".
EXIT_UNAVAILABLE = 3
# Compact sinfo states in which a node accepts work (a trailing "*" means not responding).
USABLE_STATES = {"idle", "mix", "alloc", "comp"}
# First start may apt-get install (~20 s measured); allow slow mirrors.
START_TIMEOUT_S = 600


@dataclass(frozen=True)
class SlurmCluster:
    nodes: tuple[str, ...]
    partition: str
    started_by_fixture: bool


def node_states(timeout: float = 15) -> dict[str, str]:
    """Compact sinfo state of each of our nodes; empty when SLURM is absent or not answering."""
    if shutil.which("sinfo") is None:
        return {}
    try:
        proc = subprocess.run(
            ["sinfo", "-h", "-N", "-n", ",".join(NODES), "-o", "%N %t"],
            capture_output=True, text=True, timeout=timeout,
        )
    except (subprocess.TimeoutExpired, OSError):
        return {}
    if proc.returncode != 0:
        return {}
    return dict(line.split(None, 1) for line in proc.stdout.splitlines() if len(line.split()) == 2)


def nodes_up() -> bool:
    states = node_states()
    return all(states.get(node) in USABLE_STATES for node in NODES)


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


@pytest.fixture(scope="session")
def slurm_cluster() -> SlurmCluster:
    if nodes_up():
        return SlurmCluster(NODES, PARTITION, started_by_fixture=False)
    if not sys.platform.startswith("linux") or shutil.which("bash") is None:
        pytest.skip("local SLURM cluster needs Linux with bash")
    if not CLUSTER_SCRIPT.is_file():
        pytest.fail(f"{CLUSTER_SCRIPT} is missing")
    try:
        proc = subprocess.run(
            ["bash", str(CLUSTER_SCRIPT), "start"],
            capture_output=True, text=True, timeout=START_TIMEOUT_S, cwd=REPO_ROOT,
        )
    except subprocess.TimeoutExpired as exc:
        stderr = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr
        pytest.fail(f"local_cluster.sh start did not finish within {START_TIMEOUT_S}s:\n{_tail(stderr or '')}")
    output = _tail(proc.stdout + proc.stderr)
    if proc.returncode == EXIT_UNAVAILABLE:
        pytest.skip(f"local SLURM cluster unavailable on this machine: {output}")
    if proc.returncode != 0:
        pytest.fail(f"local_cluster.sh start failed (rc={proc.returncode}):\n{output}")
    if not nodes_up():
        pytest.fail(f"local_cluster.sh start succeeded but nodes are not up: {node_states()}\n{output}")
    return SlurmCluster(NODES, PARTITION, started_by_fixture=True)
