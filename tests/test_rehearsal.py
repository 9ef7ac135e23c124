"""train's rehearsal before its turn (stages/rl/rehearsal.py): the micro-step path of a one-layer model
of the policy's architecture, the fused layers' kernels included (interpreted here, as in
tests/test_fused_layers.py). That it saves the first micro-batch its kernel loads is measured on a GPU
(docs/benchmarks.md); here: that it runs every piece train's first step runs, for each setting that
changes which pieces those are."""

from pathlib import Path

import pytest
import torch

from stages.rl import fused_layers, rehearsal
from stages.runtime.config import TrainConfig, TuningConfig

ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("triton")


def config(kind: str = "llama"):
    from transformers import Qwen2Config

    from stages.rl.tiny_model import build_tokenizer, llama_config

    dims = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256)
    if kind == "llama":
        return llama_config(dims)
    return Qwen2Config(vocab_size=len(build_tokenizer()), **dims)


@pytest.mark.parametrize("packed,kl", [(True, 0.0), (False, 0.1)], ids=["packed", "padded-kl"])
def test_the_rehearsal_runs_the_micro_steps_pieces(kernels_on, monkeypatch, packed, kl):
    ran = []
    for name in ("RotaryQKV", "SwiGLU"):
        fn = getattr(fused_layers, name).apply
        monkeypatch.setattr(getattr(fused_layers, name), "apply", lambda *a, fn=fn, name=name: ran.append(name) or fn(*a))
    steps = []
    original = torch.optim.AdamW.step
    monkeypatch.setattr(torch.optim.AdamW, "step", lambda self, *a: steps.append(self) or original(self, *a))
    before = torch.random.get_rng_state()
    seconds = rehearsal.rehearse(config(), torch.float32, TuningConfig(remove_padding=packed), TrainConfig(kl_coef=kl),
                                 1.0, "cpu")
    assert seconds > 0
    assert torch.equal(torch.random.get_rng_state(), before)  # train's own draws are not moved
    assert ran.count("RotaryQKV") == 1 and ran.count("SwiGLU") == 1  # one layer, fused
    (adam,) = steps
    params = adam.param_groups[0]["params"]
    assert all(p.dtype == torch.float32 and p.grad is not None and torch.isfinite(p.grad).all() for p in params)
    assert any(p.grad.abs().sum() > 0 for p in params)


def test_one_layer_keeps_the_architecture_and_cuts_per_layer_lists():
    qwen = config("qwen2")
    assert len(qwen.layer_types) == 3
    small = rehearsal.one_layer(qwen)
    assert small.num_hidden_layers == 1 and small.layer_types == qwen.layer_types[:1]
    assert (small.hidden_size, small.vocab_size, small.num_key_value_heads) == (64, qwen.vocab_size, 2)
    assert qwen.num_hidden_layers == 3  # a copy
    rows = rehearsal.synthetic_rows(qwen.vocab_size)
    assert all(max(r["prompt_ids"] + r["completion_ids"]) < qwen.vocab_size for r in rows)
    assert {r["advantage"] for r in rows} == {1.0, -1.0}


def shape_config(preset: str):
    from stages.rl.tiny_model import PRESETS, llama_config

    return llama_config(PRESETS[preset])


ZERO2 = {"zero_optimization": {"stage": 2}}
H200 = 141 * 10**9


def test_the_rehearsal_is_skipped_where_it_cannot_pay():
    cfg = shape_config("llama3-3b-shape")
    assert rehearsal.skip_reason(cfg, torch.bfloat16, ZERO2, H200) is None
    assert "ZeRO-3" in rehearsal.skip_reason(cfg, torch.bfloat16, {"zero_optimization": {"stage": 3}}, H200)
    offload = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    assert "offloaded" in rehearsal.skip_reason(cfg, torch.bfloat16, offload, H200)
    on_gpu = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none"}}}
    assert rehearsal.skip_reason(cfg, torch.bfloat16, on_gpu, H200) is None


def test_the_rehearsal_is_skipped_where_one_layer_would_take_more_than_its_share():
    from stages.rl.tiny_model import llama_config

    seventy = llama_config(dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                num_attention_heads=64, num_key_value_heads=8))
    # A 70B layer: ~0.86B parameters at 20 bytes each (bf16 weight and gradient, fp32 master, gradient, Adam).
    assert 16e9 < rehearsal.memory_bytes(seventy, torch.bfloat16) < 19e9
    reason = rehearsal.skip_reason(seventy, torch.bfloat16, ZERO2, H200)
    assert "over 5% of the GPU's 141 GB" in reason
    eight = shape_config("llama3-8b-shape")
    assert rehearsal.memory_bytes(eight, torch.bfloat16) < rehearsal.GPU_SHARE * H200
    # An 80 GB GPU still rehearses the 3B shape (2 GB), not the 8B one (4.4 GB).
    assert rehearsal.skip_reason(shape_config("llama3-3b-shape"), torch.bfloat16, ZERO2, 80 * 10**9) is None
    assert rehearsal.skip_reason(eight, torch.bfloat16, ZERO2, 80 * 10**9) is not None


@pytest.fixture
def gpu():
    """GPU 0, its allocator's cache emptied and its peak statistics reset (the test skips without one)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    device = torch.device("cuda", 0)
    torch.zeros(1, device=device)  # the allocator's statistics exist once it has served the device
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return device


@pytest.mark.gpu
def test_the_rehearsal_stays_inside_its_share_of_the_gpu(gpu):
    device = gpu
    held = torch.cuda.memory_reserved(device)  # what earlier tests in this process left (their workspaces)
    cfg = shape_config("llama3-3b-shape")
    rehearsal.rehearse(cfg, torch.bfloat16, TuningConfig(), TrainConfig(), 1.0, device)
    peak = torch.cuda.max_memory_allocated(device)
    total = torch.cuda.get_device_properties(device).total_memory
    assert peak <= rehearsal.GPU_SHARE * total
    assert peak <= rehearsal.memory_bytes(cfg, torch.bfloat16)  # the estimate that decides does not undercount
    # Handed back before the turn, but for the workspaces the process keeps for its math libraries
    # (0.45 GiB on an H200, measured 2026-12-04).
    assert torch.cuda.memory_reserved(device) - held < 2**30
    # The cap is lifted: the process may take more than the share once the rehearsal is over.
    big = torch.empty(int(rehearsal.GPU_SHARE * total) + 2**30, dtype=torch.uint8, device=device)
    del big
    torch.cuda.empty_cache()


@pytest.mark.gpu
def test_the_sampling_rehearsal_stays_inside_its_share_of_the_gpu(gpu):
    from stages.runtime.config import GenerateConfig

    device = gpu
    held = torch.cuda.memory_reserved(device)
    cfg = shape_config("llama3-3b-shape")
    cfg.vocab_size, cfg.tie_word_embeddings = 128256, True  # the real one's
    seconds = rehearsal.rehearse_sampling(cfg, torch.bfloat16, TuningConfig(), GenerateConfig(), device)
    total = torch.cuda.get_device_properties(device).total_memory
    assert seconds > 0 and torch.cuda.max_memory_allocated(device) <= rehearsal.GPU_SHARE * total
    assert rehearsal.sampling_skip_reason(cfg, torch.bfloat16, total) is None
    assert torch.cuda.memory_reserved(device) - held < 2**30  # handed back before the turn


def test_a_preload_sees_its_turn_come_and_skips_what_only_saves_time(tmp_path):
    # stages/runtime/stage.py wait_for_turn: a process started early runs its preload before waiting for
    # the turn's file; train's preload rehearses only while the turn has not come (the rehearsal saves
    # the first micro-batch less time than it takes, so it is no use to a stage already late).
    from stages.runtime.stage import StageContext, wait_for_turn

    turn = tmp_path / "generate.done"
    ctx = StageContext(stage="train", iteration=1, cfg=None, paths=None, info=None, attempt=1, config_hash="",
                       inputs="")
    seen = []

    def preload(c):
        seen.append(c.turn_came())
        turn.write_text("{}")
        seen.append(c.turn_came())
        return "preloaded"

    assert wait_for_turn(ctx, str(turn), timeout_s=5, preload=preload) is not None
    assert seen == [False, True] and ctx.preloaded == "preloaded" and ctx.late_s >= 0
    # A process started at its turn (not early) has it already.
    assert StageContext(stage="train", iteration=1, cfg=None, paths=None, info=None, attempt=1, config_hash="",
                        inputs="").turn_came()


FREEZE_CHECK = """
import gc, sys, weakref
from stages.runtime.stage import StageContext, then_frozen, wait_for_turn

class Node:
    pass

dead = []

def preload(ctx):
    node = Node()
    node.me = node  # a cycle, garbage before the freeze
    dead.append(weakref.ref(node))
    open(sys.argv[1], "w").write("{}")

ctx = StageContext(stage="train", iteration=1, cfg=None, paths=None, info=None, attempt=1, config_hash="", inputs="")
assert wait_for_turn(ctx, sys.argv[1], timeout_s=5, preload=then_frozen(preload)) is not None
assert dead[0]() is None, "garbage of the preload frozen"
assert gc.get_freeze_count() > 1000 and "freeze_objects" in ctx.preload_phases
later = Node()
later.me = later
gone = weakref.ref(later)
del later
gc.collect()
assert gone() is None, "a cycle made after the freeze not collected"
print("checked")
"""


def test_a_process_started_early_leaves_what_its_preload_loaded_out_of_later_collections(tmp_path):
    # stages/runtime/stage.py then_frozen, the preload a stage started early runs: once preloaded, one
    # collection and gc.freeze; the turn's own collections (release_cached_memory) then walk only what
    # the stage made since. In a process of its own: the freeze is for the rest of the process.
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", FREEZE_CHECK, str(tmp_path / "gather.done")], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "checked" in out.stdout, out.stderr[-2000:]


def test_the_sampling_rehearsal_runs_both_kinds_of_call_and_leaves_the_generators(monkeypatch):
    # generate's rehearsal before its turn: the compact sampler's calls (prefill, decode steps) on a
    # one-layer model, one with short prompts and one with prompts the decode kernel reads once for
    # their attempts; what it saves the first call is measured on a GPU.
    from stages.rl import decoding
    from stages.runtime.config import GenerateConfig

    calls = []
    original = decoding.CompactDecoder.sample

    def sample(self, prompts, attempts, params, generator, record_logprobs=False):
        out = original(self, prompts, attempts, params, generator, record_logprobs=record_logprobs)
        calls.append((sorted(len(p) for p in prompts), attempts, self.stats.steps, record_logprobs,
                      len(self.model.model.layers)))
        return out

    monkeypatch.setattr(decoding.CompactDecoder, "sample", sample)
    before = torch.random.get_rng_state()
    # The fused layers' kernels go through Triton's interpreter here, minutes for these prompts: the
    # rehearsal's use of them is train's (test_the_rehearsal_runs_the_micro_steps_pieces).
    tuning = TuningConfig(fused_layers=False)
    seconds = rehearsal.rehearse_sampling(config(), torch.float32, tuning, GenerateConfig(top_p=0.9), "cpu")
    assert seconds > 0
    assert torch.equal(torch.random.get_rng_state(), before)  # generate's seeded draws are not moved
    share = decoding.SHARE_PROMPTS_FROM
    assert [c[0] for c in calls] == [[11, 16], [share - 5, share]]
    assert all(c[1] == rehearsal.ATTEMPTS and c[2] == rehearsal.NEW_TOKENS - 1 and c[3] and c[4] == 1 for c in calls)


def test_the_sampling_rehearsal_is_skipped_where_one_layer_would_take_more_than_its_share():
    eight = shape_config("llama3-8b-shape")
    eight.vocab_size, eight.tie_word_embeddings = 128256, False  # the real one's: ~2.5 GB, mostly the embeddings
    assert rehearsal.sampling_skip_reason(eight, torch.bfloat16, 80 * 10**9) is None
    assert rehearsal.sampling_skip_reason(eight, torch.bfloat16, H200) is None
    assert "over 5% of the GPU's 40 GB" in rehearsal.sampling_skip_reason(eight, torch.bfloat16, 40 * 10**9)


def test_generate_rehearses_only_with_the_compact_sampler_on_a_gpu_before_its_turn(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from stages import generate
    from stages.runtime.config import GenerateConfig

    ran = []
    monkeypatch.setattr(generate, "preload_model_code", lambda ctx: "config")
    monkeypatch.setattr(generate, "rehearse_sampler", lambda ctx, config: ran.append(config))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # this machine has none: the choice alone
    turn = []

    def ctx(**g):
        return SimpleNamespace(cfg=SimpleNamespace(generate=GenerateConfig(**g)), turn_came=lambda: bool(turn),
                               preload_phases={})

    c = ctx()
    assert generate.preload(c) == "config" and ran == ["config"] and "rehearsal" in c.preload_phases
    for other in (dict(backend="vllm"), dict(cache="static"), dict(gpus_per_process=2)):
        assert generate.preload(ctx(**other)) == "config"
    turn.append(1)
    assert generate.preload(ctx()) == "config"
    assert ran == ["config"]


def test_a_rehearsal_before_the_turn_logs_what_came_of_it_and_never_fails_the_stage(caplog):
    # The lines a rank's log ends at while it waits for its turn (README, "When things go wrong").
    caplog.set_level("INFO")

    def broken():
        raise RuntimeError("no kernels")

    rehearsal.before_turn("the sampler", "on", "the first call", None, lambda: 1.25)
    rehearsal.before_turn("a micro-step", "of", "the first micro-batch", None, broken)
    rehearsal.before_turn("the sampler", "on", "the first call", "too big", broken)
    assert [r.getMessage() for r in caplog.records] == [
        "rehearsed the sampler on a one-layer model before the turn in 1.2s: its kernels are loaded",
        "rehearsing a micro-step before the turn failed (RuntimeError: no kernels); the first micro-batch loads its "
        "kernels itself",
        "no rehearsal of the sampler before the turn: too big"]
    assert caplog.records[1].levelname == "WARNING"
