"""The long-lived generation engine of generate.persistent: one per generate rank, in a job step of
its own that the coordinator keeps running beside the stages (jobs/engines.py).

It starts vLLM on its rank's GPUs with the policy of the iteration it starts at, publishes its
address (stages/runtime/engine_link.py) and then serves its generate rank's requests, one at a
time: wake up, load the weights the request names in place, sample, go back to sleep. Asleep it
holds neither weights nor KV cache on the GPU, so train has the memory. The generate stage, its
marker and its rerun stay what they are: the stage asks, and records the weights that were served.

A request that fails is answered with the error, and the engine exits: the coordinator starts a
new one for the stage's next attempt, rather than trusting an engine in an unknown state.

    python -m stages.engine --run-dir RUN_DIR --iteration I
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import sys
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Listener
from pathlib import Path
from types import SimpleNamespace

from stages.runtime.dist import dist_info
from stages.runtime.engine_link import failure_path, publish_address, receive, send
from stages.runtime.logs import setup_logging
from stages.runtime.markers import write_text_atomic
from stages.runtime.stage import exit_now, make_context

log = logging.getLogger("syncrl.engine")

# A connected generate rank sends its request at once; one that does not is dropped after this.
REQUEST_WAIT_S = 60.0


class Engine:
    def __init__(self, sampler):
        self.sampler = sampler
        self.served = 0

    def serve(self, request: dict) -> dict:
        """Wake up with the request's weights, sample, sleep; the reply's figures time each step."""
        weights = Path(request["weights"])
        figures = dict(self.sampler.figures()) if self.served == 0 else {}  # start-up, told once
        if self.sampler.asleep:
            figures.update(self.sampler.wake_up(weights))
        elif weights != self.sampler.model_path:
            figures["reload_s"] = self.sampler.load(weights)
        t0 = time.time()
        g = SimpleNamespace(attempts=request["n"], temperature=request["temperature"], top_p=request["top_p"],
                            max_new_tokens=request["max_tokens"])
        completions = self.sampler.sample(request["prompts"], g, request["eos_token_id"], request["seed"])
        figures["engine_sample_s"] = time.time() - t0
        figures["sleep_s"] = self.sampler.sleep()
        self.served += 1
        figures["requests_served"] = self.served
        return {"ok": True, "served": str(weights), "completions": completions, "figures": figures}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m stages.engine", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--iteration", type=int, required=True, help="the iteration whose policy it starts with")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    setup_logging(dist_info().tag)
    ctx = make_context("engine", args.run_dir, args.iteration, args.overrides, waiting=True)
    paths, rank, cfg = ctx.paths, ctx.rank, ctx.cfg
    failed = failure_path(paths, rank)
    failed.unlink(missing_ok=True)
    log.info("engine for generate rank %d: host=%s pid=%d, starting with %s", rank, ctx.info.host, os.getpid(),
             ctx.policy_path())
    try:
        from stages.generate import sample_seed
        from stages.rl.vllm_sampler import VllmSampler

        sampler = VllmSampler(ctx.policy_path(), ctx.tokenizer_path(), cfg.model.dtype, cfg.generate,
                              sample_seed(cfg.seed, args.iteration, rank), cache_dir=paths.vllm_cache(rank),
                              sleep_mode=True, enforce_eager=cfg.tuning.vllm_enforce_eager)
        key = secrets.token_bytes(32)
        listener = Listener(("0.0.0.0", 0), authkey=key)
        publish_address(paths, rank, listener.address[1], key, {"iteration": args.iteration,
                                                                 "attempt": ctx.attempt})
    except Exception as e:
        log.exception("the engine failed to start")
        # Whole or absent, as its generate rank may read it at any moment.
        where = paths.logs(args.iteration, "engine", ctx.attempt)
        write_text_atomic(failed, f"{type(e).__name__}: {e} (log: {where})\n")
        print(f"engine: rank {rank} failed to start: {type(e).__name__}: {e}", file=sys.stderr)
        exit_now(1)
    log.info("listening on port %d", listener.address[1])
    engine = Engine(sampler)
    while True:  # until the coordinator ends the step (the run's end, or its own exit)
        try:
            conn = listener.accept()
        except (AuthenticationError, OSError) as e:
            log.warning("refused a connection: %s", e)
            continue
        with conn:
            try:
                request = receive(conn, REQUEST_WAIT_S, "the connected generate rank")
            except (TimeoutError, EOFError, OSError) as e:
                log.warning("dropped a connection: %s", e)
                continue
            if request.get("op") != "generate":
                send(conn, {"ok": False, "error": f"unknown request {request.get('op')!r}"})
                continue
            log.info("request: %d prompts x %d with %s", len(request["prompts"]), request["n"], request["weights"])
            try:
                reply = engine.serve(request)
            except Exception as e:
                log.exception("the request failed; exiting, so that a new engine serves the next attempt")
                send(conn, {"ok": False, "error": f"{type(e).__name__}: {e}"})
                exit_now(1)
            try:
                send(conn, reply)
            except OSError as e:  # the generate rank is gone (its attempt was stopped): it reads nothing
                log.warning("could not answer: %s", e)
                continue
            log.info("served %s: %s", reply["served"],
                     ", ".join(f"{k} {v:.2f}" for k, v in reply["figures"].items() if isinstance(v, float)))


if __name__ == "__main__":
    main()
