"""Sampling a model too large for one GPU: the compact sampler, tensor-parallel over a generate
process's GPUs.

A generate task with generate.gpus_per_process = N > 1 (backend hf, cache compact) holds N GPUs of
one node. Its process starts N - 1 members beside itself. The N processes form a torch.distributed
group of their own (NCCL on GPUs, gloo on the host) and load the policy with the model's
tensor-parallel plan in transformers: each holds 1/N of every layer's heads and MLP, and the logits
come out whole on every member. They then run the same compact sampler in lock step: the
same prompts, the same generator seed, so the same tokens. The task's own process (member 0) keeps
the completions and log-probs; the others discard theirs and exit.

Every wait is bounded. A collective that no peer answers fails after COLLECTIVE_TIMEOUT. A member
that dies ends the task's process, which fails the stage. A member whose task process is gone
receives SIGTERM. The members compare what they sampled before they return: members that drifted
apart fail the stage rather than write a shard that only one of them computed.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import logging
import multiprocessing
import os
import threading
import time

import torch

from stages.runtime.config import GenerateConfig, TuningConfig

log = logging.getLogger("syncrl.generate")

# Long enough for the slowest member to load its shard of a large model before the first collective.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=30)
# How long member 0 waits for the others to exit once every collective is done.
EXIT_WAIT_S = 60.0


@dataclasses.dataclass(frozen=True)
class Job:
    """What every member needs to sample the same: sent to the members it starts."""
    policy: str
    tokenizer: str
    dtype: str
    prompt_ids: list
    generate: GenerateConfig
    tuning: TuningConfig
    seed: int
    size: int
    tag: str  # the generate process's log tag: the members' lines are told apart by " tpK"
    port: int = 0


def sample(job: Job) -> tuple[list, list, dict]:
    """Completions and log-probs of every prompt's sequences (generate.sample_compact's), sampled by
    job.size processes on the model sharded over them; run by the generate task's process."""
    from torch.distributed import TCPStore

    # Port 0: the store takes a free port as it binds, and the members are told which.
    store = TCPStore("127.0.0.1", 0, job.size, is_master=True, timeout=COLLECTIVE_TIMEOUT, wait_for_workers=False)
    job = dataclasses.replace(job, port=store.port)
    spawn = multiprocessing.get_context("spawn")
    members = [spawn.Process(target=_member_main, args=(job, rank, os.getpid()), name=f"tensor-parallel member {rank}", daemon=True)
               for rank in range(1, job.size)]
    for m in members:
        m.start()
    done = threading.Event()
    threading.Thread(target=_watch, args=(members, done), daemon=True).start()
    try:
        completions, logprobs, stats = _run(job, 0, store)
    finally:
        done.set()
    deadline = time.time() + EXIT_WAIT_S
    for m in members:
        m.join(max(0.0, deadline - time.time()))
        if m.exitcode is None:
            m.terminate()
            raise RuntimeError(f"generate: {m.name} of {job.size} had not exited {EXIT_WAIT_S:.0f}s after sampling")
        if m.exitcode:  # after the members agreed on what they drew: the shard stands
            log.warning("generate: %s exited with code %s after sampling", m.name, m.exitcode)
    stats["tensor_parallel"] = job.size
    return completions, logprobs, stats


def _watch(members: list, done: threading.Event) -> None:
    # A dead member leaves member 0 in a collective until it times out: end the process at once.
    while not done.wait(1.0):
        for m in members:
            if m.exitcode not in (None, 0):
                log.error("generate: %s exited with code %s while sampling; ending this process", m.name, m.exitcode)
                logging.shutdown()
                os._exit(1)


def _member_main(job: Job, rank: int, parent: int) -> None:
    """A member other than the task's process: samples in step with the others, keeps nothing."""
    from torch.distributed import TCPStore

    from stages.runtime.logs import setup_logging

    _die_with_parent(parent)
    setup_logging(f"{job.tag} tp{rank}")
    store = TCPStore("127.0.0.1", job.port, job.size, is_master=False, timeout=COLLECTIVE_TIMEOUT)
    _run(job, rank, store)


def _run(job: Job, rank: int, store) -> tuple[list, list, dict]:
    import torch.distributed as dist

    from stages.generate import completion_length, sample_compact
    from stages.rl.batches import completion_logprobs
    from stages.rl.modeling import DTYPES, load_tokenizer, set_cpu_threads

    # transformers binds each member to the GPU LOCAL_RANK names, of those the task was given.
    os.environ["LOCAL_RANK"] = str(rank)
    set_cpu_threads()
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda", rank) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if on_gpu else "gloo", store=store, rank=rank, world_size=job.size,
                            timeout=COLLECTIVE_TIMEOUT, **({"device_id": device} if on_gpu else {}))
    try:
        t0 = time.time()
        model = load_sharded(job.policy, DTYPES[job.dtype], job.size)
        load_s = time.time() - t0
        tokenizer = load_tokenizer(job.tokenizer)
        g = job.generate
        # The fused layers and CUDA graphs have run on whole models only.
        tuning = dataclasses.replace(job.tuning, decode_graphs=False)
        torch.manual_seed(job.seed)
        completions, logprobs, stats = sample_compact(model, tokenizer, job.prompt_ids, g, device, tuning)
        if logprobs is None:  # tuning.logprobs=recompute: one more pass, in step like the sampling
            rows = [{"prompt_ids": job.prompt_ids[j // g.attempts],
                     "completion_ids": ids[:completion_length(ids, tokenizer.eos_token_id)]}
                    for j, ids in enumerate(completions)]
            logprobs = completion_logprobs(model, rows, g.temperature, device)
        _check_in_step(completions, rank, job.size)
        stats["load_s"] = load_s
        return completions, logprobs, stats
    finally:
        dist.destroy_process_group()


def load_sharded(path: str, dtype: torch.dtype, size: int):
    """The model at `path` with its tensor-parallel plan over the `size` processes of the default
    group (transformers before 5 takes the plan as tp_plan="auto")."""
    import transformers

    if hasattr(transformers, "DistributedConfig"):
        kwargs = {"distributed_config": transformers.DistributedConfig(tp_size=size)}
    else:
        kwargs = {"tp_plan": "auto"}
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs).eval()


def _check_in_step(completions: list, rank: int, size: int) -> None:
    import torch.distributed as dist

    digest = hashlib.sha256(repr(completions).encode()).hexdigest()
    digests = [None] * size
    dist.all_gather_object(digests, digest)
    apart = [r for r, d in enumerate(digests) if d != digests[0]]
    if apart:
        raise RuntimeError(f"generate: tensor-parallel members {apart} sampled other tokens than member 0 (rank "
                           f"{rank} of {size}); their logits differed. Rerun generate; set "
                           f"generate.gpus_per_process=1 where the model fits one GPU")


def _die_with_parent(parent: int) -> None:
    # A member whose generate process was killed would wait out its collectives: end it with it.
    import ctypes
    import signal
    import sys

    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before the line above: no signal will come
        os._exit(1)
