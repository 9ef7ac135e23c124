"""Generation is reproducible, and train's recomputed log-probs match the sampling log-probs.

If the two disagreed, the PPO ratio would start away from 1 and clipping would bias every update.
"""

import pytest
import torch

from stages.generate import sample_rows, sample_seed
from stages.rl import prompts
from stages.rl.batches import collate, sequence_logprobs
from stages.rl.modeling import load_policy, load_tokenizer, token_logprobs
from stages.rl.tiny_model import create_base_model
from stages.runtime.config import DataConfig, GenerateConfig, TuningConfig


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    path = create_base_model(tmp_path_factory.mktemp("m") / "base", "tiny-llama", seed=0)
    return load_policy(path, "float32").eval(), load_tokenizer(path)


ITEMS = [{"prompt_id": f"0-{i}", "problem_index": i, "question": q, "answer": f"#### {a}", "prompt": q}
         for i, (q, a) in enumerate([("1+2=", 3), ("12+30=", 42), ("4+4=", 8)])]


def sample(policy, seed, g, logprobs="auto"):
    model, tok = policy
    torch.manual_seed(seed)
    items = [dict(it) for it in ITEMS]
    prompts.encode(tok, items, DataConfig(), "the tiny preset's")  # as generate does, before sampling
    return sample_rows(model, tok, items, g, torch.device("cpu"), tuning=TuningConfig(logprobs=logprobs))[0]


@pytest.mark.parametrize("cache", ["dynamic", "compact"])
def test_sampling_is_deterministic_per_seed(policy, cache):
    g = GenerateConfig(attempts=4, max_new_tokens=6, temperature=1.0, cache=cache)
    a = sample(policy, sample_seed(0, 3, 1), g)
    b = sample(policy, sample_seed(0, 3, 1), g)
    c = sample(policy, sample_seed(0, 3, 0), g)
    assert [r["completion_ids"] for r in a] == [r["completion_ids"] for r in b]
    assert [r["completion_ids"] for r in a] != [r["completion_ids"] for r in c]
    assert len(a) == 12 and [r["sample_index"] for r in a[:4]] == [0, 1, 2, 3]
    assert all(r["prompt_id"] == "0-1" for r in a[4:8])


@pytest.mark.parametrize("temperature,cache,logprobs", [
    (1.0, "dynamic", "auto"), (0.7, "dynamic", "auto"), (1.0, "static", "auto"),
    (0.7, "compact", "auto"),  # recorded by the sampler as it draws
    (0.7, "compact", "recompute"),
])
def test_train_recomputes_the_sampling_logprobs(policy, temperature, cache, logprobs):
    model, tok = policy
    g = GenerateConfig(attempts=3, max_new_tokens=6, temperature=temperature, cache=cache)
    rows = sample(policy, 1, g, logprobs)
    for r in rows:
        r["advantage"] = 1.0
        assert r["prompt_ids"] == tok(r["prompt"], add_special_tokens=False)["input_ids"]  # padding stripped
    batch = collate(rows + [None], torch.device("cpu"))  # padding slots (None) carry no tokens
    with torch.no_grad():
        logp = sequence_logprobs(model, batch, temperature)  # train's own call: no attention mask
        masked = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    mask = batch["mask"].bool()
    assert int(mask.sum()) == sum(len(r["completion_ids"]) for r in rows) == batch["tokens"]
    assert batch["lengths"] == [len(r["prompt_ids"]) + len(r["completion_ids"]) for r in rows]
    assert torch.allclose(logp[mask], batch["old_logp"][mask], atol=2e-4)
    # Right padding under causal attention: the mask changes nothing the loss reads.
    with_mask = token_logprobs(masked[:, :-1], batch["input_ids"][:, 1:], temperature)
    assert torch.allclose(logp[mask], with_mask[mask], atol=1e-5)


def test_completion_logprobs_do_not_depend_on_how_rows_are_batched(policy, monkeypatch):
    import stages.rl.batches as batches

    model, _ = policy
    rows = sample(policy, 2, GenerateConfig(attempts=3, max_new_tokens=6), "recompute")
    whole = batches.completion_logprobs(model, rows, 1.0, torch.device("cpu"))
    widest = max(len(r["prompt_ids"]) + len(r["completion_ids"]) for r in rows)
    monkeypatch.setattr(batches, "LOGIT_BUDGET", 2 * widest * model.config.vocab_size)  # 1-2 rows per pass
    chunked = batches.completion_logprobs(model, rows, 1.0, torch.device("cpu"))
    assert [len(x) for x in chunked] == [len(r["completion_ids"]) for r in rows]
    for a, b in zip(whole, chunked):
        assert a == pytest.approx(b, abs=1e-5)
    assert [r["logprobs"] for r in rows] == [[round(x, 6) for x in a] for a in whole]


def test_compact_sampling_follows_the_same_policy_as_generate(policy):
    """Near-greedy temperature: the compact loop must pick the tokens HF generate() picks."""
    g = dict(attempts=2, max_new_tokens=8, temperature=1e-4)
    compact = sample(policy, 5, GenerateConfig(cache="compact", **g))
    plain = sample(policy, 5, GenerateConfig(cache="dynamic", **g))
    assert [r["completion_ids"] for r in compact] == [r["completion_ids"] for r in plain]
    assert [r["prompt_ids"] for r in compact] == [r["prompt_ids"] for r in plain]
