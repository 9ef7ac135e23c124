"""The link between a generate rank and its long-lived generation engine (generate.persistent).

The engine (stages/engine.py) is a job step of its own that the coordinator keeps running beside
the stages. When it is ready it writes RunPaths.engine_address(rank): host, port, process and a
random key, readable by the run's owner only. A generate rank connects there, sends one request
(the weights to serve, the prompts, the sampling settings) and waits for the completions.

Messages are JSON, sent over multiprocessing.connection, whose handshake proves that both ends hold
the key. Every wait is bounded: for the address (the engine is starting) and for the answer, by
generate.engine_timeout_s. An engine that is gone fails the request at once; the coordinator
starts a new one for the next attempt. Torch-free.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from multiprocessing.connection import Client, Connection
from pathlib import Path

from stages.runtime.dist import node_name
from stages.runtime.markers import write_text_atomic
from stages.runtime.paths import RunPaths

log = logging.getLogger("syncrl.engine")

POLL_S = 0.5


def send(conn: Connection, message: dict) -> None:
    conn.send_bytes(json.dumps(message).encode())


def receive(conn: Connection, timeout_s: float, what: str) -> dict:
    if not conn.poll(timeout_s):
        raise TimeoutError(f"no answer from {what} within {timeout_s:.0f}s")
    return json.loads(conn.recv_bytes())


def publish_address(paths: RunPaths, rank: int, port: int, key: bytes, extra: dict) -> None:
    """The engine's address file, written last: once it exists the engine answers."""
    record = {"host": socket.gethostname(), "node": node_name(), "port": port, "pid": os.getpid(), "key": key.hex(),
              "time": time.time(), **extra}
    path = paths.engine_address(rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(record) + "\n", mode=0o600)


def failure_path(paths: RunPaths, rank: int) -> Path:
    """What an engine that could not start wrote about it, so that its generate rank stops waiting."""
    return paths.engine_address(rank).with_suffix(".failed")


def read_address(paths: RunPaths, rank: int, timeout_s: float) -> dict:
    """The engine's address, once it has started (bounded by timeout_s)."""
    path, failed = paths.engine_address(rank), failure_path(paths, rank)
    deadline = time.monotonic() + timeout_s
    while True:
        if failed.exists():
            raise RuntimeError(f"the generation engine of rank {rank} failed to start: "
                               f"{failed.read_text(errors='replace').strip()}")
        try:
            return json.loads(path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"the generation engine of rank {rank} did not start within {timeout_s:.0f}s "
                               f"({path} not written): see its log under {paths.root}/logs/iter_*/engine/, or "
                               f"raise generate.engine_timeout_s")
        time.sleep(POLL_S)


class EngineClient:
    """A sampler (the interface of stages/rl/vllm_sampler.VllmSampler) that asks rank `rank`'s
    long-lived engine to serve `weights` and sample."""

    def __init__(self, paths: RunPaths, rank: int, weights: Path, timeout_s: float):
        self.paths, self.rank, self.weights, self.timeout_s = paths, rank, Path(weights), timeout_s
        self._figures: dict = {}

    def sample(self, prompt_ids: list[list[int]], g, eos_token_id: int, seed: int) -> list[list[int]]:
        t0 = time.monotonic()
        address = read_address(self.paths, self.rank, self.timeout_s)
        what = f"the generation engine of rank {self.rank} at {address['host']}:{address['port']} " \
               f"(pid {address['pid']})"
        try:
            conn = Client((address["host"], address["port"]), authkey=bytes.fromhex(address["key"]))
        except OSError as e:
            raise RuntimeError(f"{what} is not answering ({e}): it has most likely died; its log is under "
                               f"{self.paths.root}/logs/iter_*/engine/, and the next attempt starts a new one") from e
        with conn:
            send(conn, {"op": "generate", "weights": str(self.weights), "prompts": prompt_ids,
                        "n": g.attempts, "temperature": g.temperature, "top_p": g.top_p,
                        "max_tokens": g.max_new_tokens, "seed": seed, "eos_token_id": eos_token_id})
            remaining = self.timeout_s - (time.monotonic() - t0)
            try:
                reply = receive(conn, max(1.0, remaining), what)
            except (EOFError, ConnectionError) as e:
                raise RuntimeError(f"{what} closed the connection before answering: it has most likely died; its "
                                   f"log is under {self.paths.root}/logs/iter_*/engine/") from e
        if not reply.get("ok"):
            raise RuntimeError(f"{what} failed the request: {reply.get('error')}")
        if reply["served"] != str(self.weights):
            raise RuntimeError(f"{what} served {reply['served']}, not {self.weights}")
        self._figures = {**reply["figures"], "served": reply["served"], "engine_pid": address["pid"],
                         "engine_node": address["node"], "engine_started": address["time"]}
        log.info("engine (pid %d) served %s: %s", address["pid"], reply["served"],
                 ", ".join(f"{k} {v:.2f}" for k, v in reply["figures"].items() if isinstance(v, float)))
        return reply["completions"]

    def figures(self) -> dict:
        return self._figures
