"""generate.backend=vllm through a stand-in for vLLM's offline API (tests/standins/vllm).

vLLM cannot run here (no GPU in CI, and its wheels are too large to reach the GPU machines), so
these tests check syncrl's side of it, for real: the arguments it passes, the rows it builds, the
end-of-sequence handling, seeding, and that the old log-probs match what train recomputes.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stages.generate import sample_rows
from stages.rl import prompts
from stages.rl.batches import collate, sequence_logprobs
from stages.rl.modeling import load_policy, load_tokenizer
from stages.rl.tiny_model import create_base_model
from stages.rl.vllm_sampler import VllmSampler
from stages.runtime.config import DataConfig, GenerateConfig

ROOT = Path(__file__).resolve().parents[1]
STANDINS = Path(__file__).parent / "standins"
ITEMS = [{"prompt_id": f"0-{i}", "problem_index": i, "question": q, "answer": "#### 1", "prompt": q}
         for i, q in enumerate(["1+2=", "12+30=", "4+4="])]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return create_base_model(tmp_path_factory.mktemp("m") / "base", "tiny-llama", seed=0)


@pytest.fixture
def vllm(monkeypatch):
    monkeypatch.syspath_prepend(str(STANDINS))
    import vllm

    vllm.CALLS.clear()
    yield vllm
    sys.modules.pop("vllm", None)


def sample(base, sampler, seed, g):
    torch.manual_seed(seed)
    tokenizer, items = load_tokenizer(base), [dict(it) for it in ITEMS]
    prompts.encode(tokenizer, items, DataConfig(), base)
    rows, _ = sample_rows(load_policy(base, "float32").eval(), tokenizer, items, g, torch.device("cpu"), sampler)
    return rows


def test_vllm_rows_are_what_train_expects(base, vllm):
    g = GenerateConfig(backend="vllm", attempts=4, max_new_tokens=40, temperature=0.8, gpus_per_process=2)
    g.vllm_memory_fraction = 0.4
    sampler = VllmSampler(base, base, "float32", g, seed=7)
    rows = sample(base, sampler, 1, g)
    call = vllm.CALLS[0]
    assert len(call["results"]) == 1, "every prompt of the shard goes to the engine in one call"
    assert sampler.figures()["weights_s"] == 0.25  # read from vLLM's own log line
    assert (call["tensor_parallel_size"], call["gpu_memory_utilization"], call["dtype"], call["seed"]) == (2, 0.4,
                                                                                                        "float32", 7)
    assert call["enable_prefix_caching"] and call["model"] == str(base)
    params = call["sampling"][0]
    assert (params.n, params.temperature, params.top_p, params.max_tokens) == (4, 0.8, 1.0, 40)

    tok = load_tokenizer(base)
    assert len(rows) == 12 and [r["sample_index"] for r in rows] == [0, 1, 2, 3] * 3
    assert [r["prompt_id"] for r in rows] == [it["prompt_id"] for it in ITEMS for _ in range(4)]
    outputs = [o for request in call["results"][0] for o in request.outputs]
    stops = [o for o in outputs if o.finish_reason == "stop"]
    assert any(tok.eos_token_id not in o.token_ids for o in stops), "no stop without its token: pick another seed"
    assert sum(not r["truncated"] for r in rows) == len(stops)
    for r in rows:
        assert r["prompt_ids"] == tok(r["prompt"], add_special_tokens=False)["input_ids"]
        assert 0 < len(r["completion_ids"]) <= 40
        # A stopped sequence ends with exactly one end-of-sequence token, whether or not vLLM listed it.
        assert r["completion_ids"].count(tok.eos_token_id) == (0 if r["truncated"] else 1)
        assert r["truncated"] or r["completion_ids"][-1] == tok.eos_token_id

    for r in rows:
        r["advantage"] = 1.0
    batch = collate(rows, torch.device("cpu"))
    with torch.no_grad():
        logp = sequence_logprobs(load_policy(base, "float32").eval(), batch, 0.8)
    mask = batch["mask"].bool()
    assert torch.allclose(logp[mask], batch["old_logp"][mask], atol=2e-4)

    again = sample(base, sampler, 1, g)
    other = sample(base, sampler, 2, g)
    assert [r["completion_ids"] for r in again] == [r["completion_ids"] for r in rows]
    assert [r["completion_ids"] for r in other] != [r["completion_ids"] for r in rows]


def test_without_vllm_the_error_names_the_setting_and_the_fix(base, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # as if not installed, whatever this machine has
    with pytest.raises(RuntimeError, match="generate.backend is vllm.*pip install vllm.*generate.backend=hf"):
        VllmSampler(base, base, "float32", GenerateConfig(backend="vllm"), seed=0)


@pytest.mark.slow
def test_one_iteration_with_the_vllm_backend(tmp_path):
    run = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(STANDINS), str(ROOT)]))
    proc = subprocess.run([sys.executable, "-m", "jobs.cli", "run", "configs/local_tiny.yaml", f"run_dir={run}",
                           "iterations=1", "generate.backend=vllm", "data.prompts_per_iteration=4",
                           "generate.attempts=2", "generate.max_new_tokens=6", "--launcher", "local"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = (run / "logs" / "iter_00000" / "generate" / "attempt_1" / "rank_00000.log").read_text()
    assert "vLLM engine on 1 GPU(s) per process, 50% of each GPU's memory" in log
    rows = [json.loads(line) for line in (run / "iter_00000" / "generate" / "rank_00000.jsonl").open()]
    assert len(rows) == 4 and all(len(r["logprobs"]) == len(r["completion_ids"]) for r in rows)
    assert (run / "models" / "iter_00000" / "config.json").is_file()


def test_every_iteration_gives_the_engine_the_same_model_path(base, vllm, tmp_path, monkeypatch):
    # vLLM keys its compile artifacts on the model's path: every iteration's export reaches the
    # engine through one link in the rank's cache folder, which is also vLLM's cache root.
    monkeypatch.delenv("VLLM_CACHE_ROOT", raising=False)
    export = tmp_path / "models" / "iter_00003"
    shutil.copytree(base, export)
    cache = tmp_path / "cache" / "vllm" / "rank_00000"
    g = GenerateConfig(backend="vllm")
    try:
        first = VllmSampler(base, base, "float32", g, seed=0, cache_dir=cache)
        assert (cache / "policy").resolve() == Path(base).resolve()
        second = VllmSampler(export, export, "float32", g, seed=1, cache_dir=cache)
        assert os.environ["VLLM_CACHE_ROOT"] == str(cache)
    finally:
        os.environ.pop("VLLM_CACHE_ROOT", None)
    assert [c["model"] for c in vllm.CALLS] == [str(cache / "policy")] * 2
    assert (cache / "policy").resolve() == export.resolve() and not list(cache.glob(".policy*"))
    # What the engine serves is still named by its real path (the marker records it).
    assert (first.model_path, second.model_path) == (Path(base), export)


def test_the_built_in_base_model_has_the_config_save_exports(tmp_path):
    # vLLM's compile cache is keyed on the model's config: iteration 0's engine (the base model) and
    # later ones (save's exports) share its entry only if both configs are the same, dtype included.
    from safetensors.torch import load_file

    from stages.save import export

    base = create_base_model(tmp_path / "base", "tiny-llama", seed=0, dtype="bfloat16")
    weights = load_file(base / "model.safetensors")
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    export(base, weights, "bfloat16", tmp_path / "export", base)
    config = json.loads((base / "config.json").read_text())
    assert config == json.loads((tmp_path / "export" / "config.json").read_text())
    # The weights are the fp32 initialisation rounded once, as a run in bf16 loaded them before.
    fp32 = create_base_model(tmp_path / "fp32", "tiny-llama", seed=0)
    assert all(torch.equal(t.to(torch.bfloat16), weights[k]) for k, t in load_file(fp32 / "model.safetensors").items())
