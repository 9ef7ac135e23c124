"""The pipeline on GPUs (NCCL training, bf16): run on the lent H200 machines with `pytest -m gpu`.

Deselected by default (pyproject's addopts); skips where fewer than the needed GPUs are visible.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from stages.runtime.paths import STAGES

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[1]


def small_llama(layers: int):
    """A 256-wide Llama with grouped-query attention, random weights (seed 0), bf16 on the GPU."""
    import torch
    from transformers import AutoModelForCausalLM

    from stages.rl.tiny_model import llama_config

    torch.manual_seed(0)
    dims = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=layers, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512)
    return AutoModelForCausalLM.from_config(llama_config(dims), dtype=torch.bfloat16).cuda()


def run_gpu_small(run: Path, *overrides: str) -> None:
    """`syncrl run configs/gpu_small.yaml` for two iterations into `run`, with `overrides`; it must succeed."""
    proc = subprocess.run([sys.executable, "-m", "jobs.cli", "run", "configs/gpu_small.yaml", f"run_dir={run}",
                           "iterations=2", *overrides, "--launcher", "local"],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]


def gpu_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.skipif(gpu_count() < 1, reason="needs a GPU")
def test_two_iterations_on_the_gpus(tmp_path):
    # One rank per GPU, up to the config's 2 (NCCL even with one); iteration 1 resumes iteration 0's checkpoint.
    ranks = min(2, gpu_count())
    run = tmp_path / "run"
    run_gpu_small(run, f"ranks={ranks}", "data.prompts_per_iteration=32", "generate.max_new_tokens=64")
    for it in (0, 1):
        for stage in STAGES:
            assert (run / f"iter_{it:05d}" / "markers" / f"{stage}.done").is_file(), (it, stage)
    train_log = (run / "logs" / "iter_00001" / "train" / "attempt_1" / f"rank_{ranks - 1:05d}.log").read_text()
    assert f"world {ranks}" in train_log and "resumed weights and optimizer state" in train_log
    assert "NCCL version" in train_log and (ranks == 1 or f"backend=nccl world={ranks}" in train_log)
    train = json.loads((run / "iter_00000" / "markers" / "train.done").read_text())
    assert 0 < train["mfu"] < 1
    assert train["memory"]["gpu_peak_allocated_gib"] > 0.5 and train["memory"]["gpu_ooms"] == 0
    generate = json.loads((run / "iter_00000" / "markers" / "generate.done").read_text())
    assert generate["memory"]["gpu_peak_reserved_pct"] > 0 and generate["tokens_per_s"] > 0
    from transformers import AutoModelForCausalLM
    import torch
    model = AutoModelForCausalLM.from_pretrained(run / "models" / "iter_00001", dtype=torch.bfloat16)
    assert sum(p.numel() for p in model.parameters()) > 4e8


@pytest.mark.skipif(gpu_count() < 1, reason="needs a GPU")
def test_node_local_checkpoints_export_the_weights_the_shards_hold(tmp_path):
    # bf16 on the GPU: the model states save exports from are the fp32 master weights as the optimizer
    # step rounded them, bit for bit what consolidating the shards and casting gives.
    from tests.test_local_checkpoints import assert_export_matches_the_durable_copy

    run = tmp_path / "run"
    run_gpu_small(run, "ranks=1", "data.prompts_per_iteration=32", "generate.max_new_tokens=64",
                  f"train.local_checkpoint_dir={tmp_path / 'store'}")
    assert_export_matches_the_durable_copy(run, 1)  # iteration 0's durable copy is pruned (keep 1)


def vllm_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


@pytest.mark.skipif(gpu_count() < 1 or not vllm_importable(), reason="needs a GPU and vLLM")
@pytest.mark.parametrize("persistent", [False, True])
def test_two_iterations_with_the_real_vllm_engine(tmp_path, persistent):
    # The real engine on the GPU: rows whose old log-probs are the policy's (the generate stage's
    # pass), and with generate.persistent one engine that serves iteration 1 the weights of iteration 0.
    run = tmp_path / "run"
    run_gpu_small(run, "ranks=1", "data.prompts_per_iteration=32", "generate.max_new_tokens=64",
                  "generate.backend=vllm", f"generate.persistent={str(persistent).lower()}")
    from stages.rl.modeling import load_tokenizer

    eos = load_tokenizer(run / "models" / "base").eos_token_id
    engines = []
    for it in (0, 1):
        marker = json.loads((run / f"iter_{it:05d}" / "markers" / "generate.rank_00000.done").read_text())
        assert marker["rows"] == 32 * 8 and marker["new_tokens"] > 0
        engines.append(marker["sampling"]["engine"])
        rows = [json.loads(line) for line in (run / f"iter_{it:05d}" / "generate" / "rank_00000.jsonl").open()]
        assert all(len(r["logprobs"]) == len(r["completion_ids"]) > 0 for r in rows)
        assert all(r["truncated"] or r["completion_ids"][-1] == eos for r in rows)
    if persistent:
        assert engines[0]["engine_pid"] == engines[1]["engine_pid"]
        assert engines[1]["served"] == str(run / "models" / "iter_00000") and engines[1]["reload_s"] > 0
    else:
        # vLLM's start-up lines were read in both iterations.
        assert all(e["weights_s"] > 0 and e["engine_start_s"] > 0 for e in engines)


@pytest.mark.skipif(gpu_count() < 1, reason="needs a GPU")
def test_packed_rows_match_padded_rows_with_the_variable_length_kernel():
    # tuning.remove_padding on CUDA runs torch's variable-length flash attention (CPU: one SDPA call
    # per row, tests/test_packing.py): bf16, grouped-query attention, rows of many lengths.
    import torch

    from stages.rl import packing
    from stages.rl.batches import collate
    from tests.test_packing import loss_and_grads
    from tests.workers.step_gradients import train_rows

    assert packing._varlen_attn() is not None, "this torch has no torch.nn.attention.varlen"
    model = small_llama(layers=2)
    rows = train_rows(24, seed=5)
    device = torch.device("cuda")

    def run(batch):
        logp, loss, grads = loss_and_grads(model, batch)
        return logp[batch["mask"].bool()], loss.item(), torch.cat([g.float().flatten() for g in grads.values()])

    padded = run(collate(rows, device))
    packing.use_packed_attention(model)
    packed = run(packing.pack(rows, device))
    assert (packed[0] - padded[0]).abs().max() < 0.05  # bf16 logits, two attention kernels
    assert abs(packed[1] - padded[1]) < 1e-2 * max(1.0, abs(padded[1]))
    assert torch.nn.functional.cosine_similarity(packed[2], padded[2], dim=0) > 0.99


@pytest.mark.skipif(gpu_count() < 1, reason="needs a GPU")
@pytest.mark.parametrize("fused", [False, True], ids=["hf-layers", "fused-layers"])
def test_captured_layers_give_the_eager_loss_and_gradient_and_follow_the_weights(fused):
    # tuning.train_graphs (stages/rl/cuda_graphs.py): micro-batches of other rows and lengths, all
    # packed to one shape, through captured layers and through the eager ones, with the weights
    # changed in place between steps (as DeepSpeed's optimizer step changes them). The same kernels
    # on the same shapes: the same results; unpadded, within bf16's reach.
    import copy

    import torch

    from stages.rl import cuda_graphs, packing
    from tests.test_packing import loss_and_grads
    from tests.workers.step_gradients import train_rows

    eager = small_llama(layers=3)
    packing.use_packed_attention(eager)
    if fused:  # tuning.fused_layers: its Triton kernels captured too
        from stages.rl.fused_layers import fuse_layers

        assert fuse_layers(eager) == 6
    graphed = copy.deepcopy(eager)
    device = torch.device("cuda")
    micro_batches = [train_rows(24, seed=s)[:n] for s, n in ((1, 24), (2, 17), (3, 24), (4, 1))]
    shape = packing.fixed_shape(micro_batches)
    # As DeepSpeed's ZeRO 1-2 do: each parameter's gradient accumulator kept alive, with a hook
    # after accumulation. The capture must not reach them; every step must.
    params = list(graphed.parameters())
    accumulators = [p.view_as(p).grad_fn.next_functions[0][0] for p in params]
    hooked = []
    for p in params:
        p.register_post_accumulate_grad_hook(lambda p: hooked.append(p))
    assert cuda_graphs.capture_layers(graphed, shape, device) == 3
    assert hooked == [] and len(accumulators) == len(params)
    for step, rows in enumerate(micro_batches):
        batch = packing.pack(rows, device, shape)
        want_logp, want_loss, want_grads = loss_and_grads(eager, batch)
        logp, loss, grads = loss_and_grads(graphed, batch)
        assert len(hooked) == len(params) * (step + 1), step
        assert torch.equal(logp, want_logp) and torch.equal(loss, want_loss), step
        for name, g in want_grads.items():
            assert torch.equal(grads[name], g), (step, name)
        _, unpadded_loss, _ = loss_and_grads(eager, packing.pack(rows, device))
        assert abs(loss.item() - unpadded_loss.item()) < 1e-2 * max(1.0, abs(unpadded_loss.item()))
        with torch.no_grad():
            for a, b in zip(eager.parameters(), graphed.parameters()):
                a.sub_(1e-2 * a.grad)
                b.sub_(1e-2 * b.grad)  # in place: where the graphs read it
    # Without gradients (the reference's way, or a log-prob pass) the layers run eagerly.
    with torch.no_grad():
        batch = packing.pack(micro_batches[0], device, shape)
        kw = packing.model_kwargs(batch)
        assert torch.equal(graphed(input_ids=batch["input_ids"], **kw).logits,
                           eager(input_ids=batch["input_ids"], **kw).logits)


@pytest.mark.skipif(gpu_count() < 1, reason="needs a GPU")
def test_two_iterations_with_captured_layers(tmp_path):
    run = tmp_path / "run"
    run_gpu_small(run, "ranks=1", "data.prompts_per_iteration=32", "generate.max_new_tokens=64",
                  "tuning.train_graphs=true")
    for it in (0, 1):
        log = (run / "logs" / f"iter_{it:05d}" / "train" / "attempt_1" / "rank_00000.log").read_text()
        assert "captured CUDA graphs of 24 layers" in log, log[-3000:]
        # Started early, it rehearsed a micro-step before its turn (stages/rl/rehearsal.py), on the GPU.
        assert "rehearsed a micro-step" in log and "micro-step before the turn failed" not in log, log[-3000:]
        train = json.loads((run / f"iter_{it:05d}" / "markers" / "train.done").read_text())
        assert train["cuda_graphs_s"] > 0 and abs(train["loss_mean"]) < 10 and 0 < train["grad_norm_mean"] < 1e3, train


@pytest.mark.skipif(gpu_count() < 1, reason="needs a GPU")
def test_compiled_layers_take_packed_batches_of_any_length_without_recompiling():
    # train.compile=inductor under ZeRO 0-2 (modeling.compile_layers): one graph per layer class,
    # the length and row offsets symbolic. Micro-batches of other lengths and row counts reuse it,
    # and give the eager model's loss and gradient (bf16: two sets of kernels).
    import copy

    import torch
    import torch._dynamo

    from stages.rl import packing
    from stages.rl.modeling import compile_layers
    from tests.test_packing import loss_and_grads
    from tests.workers.step_gradients import train_rows

    eager = small_llama(layers=3)
    compiled = copy.deepcopy(eager)
    for m in (eager, compiled):
        packing.use_packed_attention(m)
    assert compile_layers(compiled, "inductor") == 3
    device = torch.device("cuda")
    torch._dynamo.reset()
    for i, n in enumerate((24, 17, 30)):
        batch = packing.pack(train_rows(n, seed=10 + i), device)
        want = loss_and_grads(eager, batch)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            got = loss_and_grads(compiled, batch)
        mask = batch["mask"].bool()
        assert (got[0][mask] - want[0][mask]).abs().max() < 0.05
        assert abs(got[1].item() - want[1].item()) < 1e-2 * max(1.0, abs(want[1].item()))
        flat = [torch.cat([g.float().flatten() for g in r[2].values()]) for r in (got, want)]
        assert torch.nn.functional.cosine_similarity(flat[0], flat[1], dim=0) > 0.99


@pytest.mark.skipif(gpu_count() < 1, reason="needs a GPU")
def test_a_deferred_checkpoint_snapshot_copies_every_byte():
    # tuning.deferred_checkpoint's copy to host memory goes through two page-locked buffers in chunks
    # (CPU tensors are kept as they are, so only a GPU exercises it): tensors larger and smaller than a
    # chunk, views, a tied pair, an empty and a 0-dim tensor, several dtypes.
    import torch

    from stages.rl import deferred_checkpoint as dc, serialization

    g = torch.Generator(device="cuda").manual_seed(0)
    big = torch.randn((dc.STAGING_BYTES // 4) * 2 + 12345, device="cuda", generator=g)
    weight = torch.randn(300, 70, device="cuda", generator=g).to(torch.bfloat16)
    state = {"module": {"a": weight, "tied": weight, "t": weight.t(), "slice": big[5:1000]},
             "optimizer": [{"flat": big, "step": torch.tensor(7, device="cuda"), "empty": torch.empty(0, device="cuda"),
                            "mask": torch.rand(999, device="cuda", generator=g) > 0.5,
                            "ints": torch.arange(77777, device="cuda", dtype=torch.int64)}],
             "host": torch.ones(3), "meta": ("x", 1)}
    host = dc.to_host(state)
    flat = [(a, b) for a, b in zip(serialization.tensors_in(state), serialization.tensors_in(host))]
    assert all(b.device.type == "cpu" and b.dtype == a.dtype and b.shape == a.shape and torch.equal(b, a.cpu())
               for a, b in flat)
    assert host["module"]["a"] is host["module"]["tied"] and host["host"] is state["host"]
    assert host["meta"] == ("x", 1)


@pytest.mark.skipif(gpu_count() < 1, reason="needs a GPU")
def test_a_loaded_checkpoint_moved_to_the_gpu_keeps_every_byte():
    # tuning.resume_to_gpu: the large contiguous host tensors of a loaded file go to the GPU through
    # page-locked buffers, in chunks over several threads; scalars (an optimizer's step), small and
    # non-contiguous tensors stay on the host; containers keep their types.
    from collections import OrderedDict

    import torch

    from stages.rl import serialization

    g = torch.Generator().manual_seed(3)
    flat = torch.randn(serialization.CHUNK_BYTES // 4 * 2 + 777, generator=g)
    weight = torch.randn(1024, 700, generator=g).to(torch.bfloat16)
    state = {"module": OrderedDict(w=weight, norm=torch.ones(3)), "t": weight.t(),
             "optimizer": [{"exp_avg": flat, "step": torch.tensor(5), "part": flat[100:300_000]}], "meta": ("x", 1)}
    out, moved = serialization.to_device(state, torch.device("cuda"), threads=3)
    assert type(out["module"]) is OrderedDict and out["meta"] == ("x", 1)
    assert out["module"]["w"].is_cuda and torch.equal(out["module"]["w"].cpu(), weight)
    assert out["optimizer"][0]["exp_avg"].is_cuda and torch.equal(out["optimizer"][0]["exp_avg"].cpu(), flat)
    assert out["optimizer"][0]["part"].is_cuda and torch.equal(out["optimizer"][0]["part"].cpu(), flat[100:300_000])
    assert not out["module"]["norm"].is_cuda and not out["optimizer"][0]["step"].is_cuda and not out["t"].is_cuda
    assert moved == weight.numel() * 2 + flat.numel() * 4 + (300_000 - 100) * 4


@pytest.mark.skipif(gpu_count() < 1, reason="needs a GPU")
def test_a_file_over_the_snapshot_budget_is_held_in_pieces_and_written_whole_after(tmp_path):
    # A file over the host-memory budget left: the pieces that fit are copied to host memory (the
    # layout records them for the next iteration's pool), the rest written now; the GPU tensors are
    # then overwritten (train frees and reuses them), and the file written after holds the state as saved.
    import torch
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    from stages.rl import deferred_checkpoint as dc
    from stages.rl.serialization import ThreadedWrites

    g = torch.Generator(device="cuda").manual_seed(2)
    state = {"m": torch.randn(3_000_000, device="cuda", generator=g), "step": torch.tensor(3, device="cuda"),
             "v": torch.randn(1_000_000, device="cuda", generator=g).to(torch.bfloat16)}
    expected = {k: v.cpu() for k, v in state.items()}
    writes = dc.DeferredWrites(ThreadedWrites(TorchCheckpointEngine(), 4), budget_bytes=5_000_000,
                               piece_bytes=1 << 20)
    writes.save(state, str(tmp_path / "optim_states.pt"))
    assert writes.layout == [["uint8", [1 << 20]]] * 4 and writes.held == 4 << 20
    assert writes.written_now == 12_000_000 - (4 << 20) + 8 + 2_000_000
    for t in state.values():
        t.zero_()
    writes.flush()
    loaded = torch.load(tmp_path / "optim_states.pt", map_location="cpu")  # saved from the GPU
    assert all(torch.equal(loaded[k], expected[k]) for k in expected)


@pytest.mark.skipif(gpu_count() < 1, reason="needs a GPU")
@pytest.mark.parametrize("locked", [True, False], ids=["page-locked", "pageable"])
def test_a_snapshot_fills_the_host_memory_prepared_by_its_layout(tmp_path, locked):
    # The next train prepares host memory by the layout a snapshot records (deferred_checkpoint.HostPool),
    # page-locked on CUDA (the GPU copies straight into it) or only faulted in: a second snapshot of
    # the same state copies into the prepared tensors, every byte.
    import torch

    from stages.rl import deferred_checkpoint as dc

    g = torch.Generator(device="cuda").manual_seed(1)
    state = {"w": torch.randn(dc.STAGING_BYTES // 2 + 7, device="cuda", generator=g).to(torch.bfloat16),
             "m": torch.randn(1000, 33, device="cuda", generator=g), "step": torch.tensor(3, device="cuda"),
             "norm": torch.randn(5, device="cuda", generator=g).to(torch.bfloat16)}  # less than a page
    layout = []
    dc.to_host(state, layout)
    (tmp_path / "layout.json").write_text(__import__("json").dumps(layout))
    pool = dc.HostPool()
    pool.prepare(tmp_path / "layout.json", budget_bytes=1 << 30, cuda_device=0 if locked else None)
    host = dc.to_host(state, pool=pool)
    size = sum(t.numel() * t.element_size() for t in state.values())
    assert pool.prepared_bytes == pool.taken_bytes == size
    assert pool.locked_bytes == (size if locked else 0)
    assert all(pool.page_locked(t) == locked and t.is_pinned() == locked for t in host.values())
    assert all(torch.equal(host[k], v.cpu()) for k, v in state.items())
    pool.close()  # unlocked: still readable host memory
    assert not any(pool.page_locked(t) or t.is_pinned() for t in host.values())
    assert all(torch.equal(host[k], v.cpu()) for k, v in state.items())


@pytest.mark.skipif(gpu_count() < 1, reason="needs a GPU")
def test_a_staged_resume_holds_exactly_what_the_checkpoint_saved(tmp_path):
    # tuning.resume_to_gpu on the GPU: each checkpoint file's tensors go to the GPU before DeepSpeed
    # copies them into the engine (without room for one more copy of the largest where ZeRO-2 copies
    # in place). Iteration 1's set-up, run again once the run is done, then holds exactly iteration
    # 0's exported weights and its checkpoint's fp32 master and Adam moments.
    import torch

    from tests.test_train_batching import run_workers_in_turn
    from tests.test_train_checkpoint import assert_resumed_state_is_iteration_0s

    run = tmp_path / "run"
    run_gpu_small(run, "ranks=1", "data.prompts_per_iteration=16", "generate.max_new_tokens=32",
                  "save.keep_checkpoints=2")
    got = run_workers_in_turn("tests.workers.resumed_weights", tmp_path, run, 1, {"resumed": []}, cpu=False)["resumed"]
    assert got["built"] and got["device"].startswith("cuda")
    assert_resumed_state_is_iteration_0s(got, run, optimizer=True, dtype=torch.bfloat16)
