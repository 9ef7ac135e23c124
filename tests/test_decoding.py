"""The compact sampling loop (stages/rl/decoding.py) samples from the policy and records what it sampled.

On CPU with the tiny model in float32, and on a GPU (`pytest -m gpu`) with the ~0.48B small-llama in
bf16 through CUDA graphs. Each test checks one promise:
- every sampled token's log-prob at its decode step equals a teacher-forced pass over the finished
  sequence (the KV buffer, positions, masks and compaction hold the same context the model would see);
- the token frequencies agree with softmax(logits / T), and with the top-p nucleus, under a chi-square
  test that also rejects a sampler at the wrong temperature;
- the same seed gives the same completions, another seed others;
- sequences stop at their first end-of-sequence token (kept) or at exactly max_new_tokens;
- with fewer K/V positions than every sequence needs, all start at once and the ones whose row fills
  continue in a later round from their tokens so far, keeping every promise above.
"""

from collections import Counter

import pytest
import torch
from scipy.stats import chisquare

from stages.rl.decoding import APART_FROM, CompactDecoder, SamplingParams, buffer_length, ladder
from stages.rl.modeling import load_policy, load_tokenizer, token_logprobs
from stages.rl.tiny_model import create_base_model
from tests.devices import DEVICES

PROMPTS = ["1+2=", "12+30=", "4+4=", "100+2000=", "7+1="]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Per device: (model, tokenizer, a frequent token used as end-of-sequence to make sequences end early)."""
    cache = {}

    def get(device: str):
        if device not in cache:
            preset, dtype = ("tiny-llama", "float32") if device == "cpu" else ("small-llama", "bfloat16")
            path = create_base_model(tmp_path_factory.mktemp(device) / "base", preset, seed=0)
            model = load_policy(path, dtype, torch.device(device)).eval()
            tok = load_tokenizer(path)
            # The model's most likely next token after a prompt ends sequences often: compaction runs.
            with torch.no_grad():
                ids = torch.tensor([tok(PROMPTS[0], add_special_tokens=False)["input_ids"]], device=device)
                frequent = int(model(input_ids=ids).logits[0, -1].argmax())
            cache[device] = (model, tok, frequent)
        return cache[device]
    return get


def prompt_ids(tok, prompts=PROMPTS):
    return [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]


def decode(model, prompts, attempts, params, seed, rows=None, record=False, graphs=True, positions=None, kernel=True):
    device = next(model.parameters()).device
    rows = rows or len(prompts) * attempts
    dec = CompactDecoder(model, rows, buffer_length(max(map(len, prompts)), params.max_new_tokens), cuda_graphs=graphs,
                         positions=positions, decode_kernel=kernel)
    gen = torch.Generator(device).manual_seed(seed)
    return dec.sample(prompts, attempts, params, gen, record_logprobs=record), dec


def teacher_forced(model, prompt, completion, temperature):
    device = next(model.parameters()).device
    x = torch.tensor([prompt + completion], device=device)
    with torch.no_grad():
        logits = model(input_ids=x).logits
    return token_logprobs(logits[:, len(prompt) - 1:-1], x[:, len(prompt):], temperature)[0].cpu()


def assert_teacher_forced(model, prompts, attempts, ids, lps, temperature, device):
    """Every recorded log-prob equals the teacher-forced pass's over its finished sequence."""
    diffs = torch.cat([(teacher_forced(model, prompts[j // attempts], c, temperature) - torch.tensor(lp)).abs()
                       for j, (c, lp) in enumerate(zip(ids, lps))])
    assert diffs.numel() == sum(len(c) for c in ids)
    if device == "cpu":  # float32: the same arithmetic up to summation order
        assert diffs.max() < 1e-4, diffs.max()
    else:  # bf16 activations, different kernels (decode vs full-sequence attention)
        assert diffs.mean() < 0.02 and torch.quantile(diffs.float(), 0.99) < 0.1, (diffs.mean(), diffs.max())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_decode_logprobs_equal_a_teacher_forced_pass(models, device, temperature):
    model, tok, frequent = models(device)
    prompts = prompt_ids(tok)
    params = SamplingParams(max_new_tokens=48, temperature=temperature, eos_token_id=frequent,
                            pad_token_id=tok.pad_token_id)
    # 10 rows for 5 prompts x 6 attempts: two calls, each compacting as sequences end.
    (ids, lps), dec = decode(model, prompts, 6, params, seed=1, rows=12, record=True)
    assert dec.stats.calls == 3 and dec.stats.compactions > 0
    # The phases' own times (the benchmarks' roofline shares): sequences ended in every call, so
    # the steps with all of a call's sequences running took part of the decoding, not all of it.
    assert 0 < dec.stats.full_s < dec.stats.decode_s and dec.stats.prefill_s > 0
    if device == "cuda":
        assert dec.stats.graphs > 0
    assert_teacher_forced(model, prompts, 6, ids, lps, temperature, device)


@pytest.mark.parametrize("device", DEVICES)
def test_prompts_prefilled_packed_in_several_passes_give_the_policys_log_probs(models, device, monkeypatch):
    """The prompts are prefilled packed (no padding), in passes of at most PREFILL_TOKENS tokens, their K/V
    written where each row's left-padded prompt lies: the log-probs still equal a teacher-forced pass."""
    from stages.rl import decoding

    monkeypatch.setattr(decoding, "PREFILL_TOKENS", 16)
    model, tok, frequent = models(device)
    prompts = prompt_ids(tok)
    assert len(decoding.prefill_passes(sorted(map(len, prompts)))) > 1
    params = SamplingParams(max_new_tokens=24, temperature=1.0, eos_token_id=frequent, pad_token_id=tok.pad_token_id)
    (ids, lps), dec = decode(model, prompts, 3, params, seed=2, record=True, kernel=False)
    assert dec.stats.calls == 1
    assert_teacher_forced(model, prompts, 3, ids, lps, 1.0, device)


def test_a_model_whose_layers_drop_the_packed_offsets_is_refused_with_the_setting_to_use(models):
    """A model whose layers do not hand attention keywords on would run the packed prompts' attention
    across prompts (causal over the whole pack), silently: the prefill refuses it instead."""
    import functools

    model, tok, _ = models("cpu")
    dropping = {}

    def without_offsets(forward, *args, **kwargs):
        dropping["calls"] = dropping.get("calls", 0) + 1
        return forward(*args, **{k: v for k, v in kwargs.items() if not k.startswith(("cu_seq_lens", "max_length"))})

    layers = [m for m in model.modules() if hasattr(m, "q_proj")]  # the attention modules
    own = [m.__dict__.get("forward") for m in layers]  # a forward set on the instance (the fused layers')
    for m in layers:
        m.forward = functools.partial(without_offsets, m.forward)
    try:
        params = SamplingParams(max_new_tokens=4, eos_token_id=-1, pad_token_id=tok.pad_token_id)
        with pytest.raises(ValueError, match="packed prompts' offsets.*generate.cache=static"):
            decode(model, prompt_ids(tok), 2, params, seed=0, kernel=False, graphs=False)
    finally:
        for m, forward in zip(layers, own):
            if forward is None:
                del m.forward
            else:
                m.forward = forward
    assert dropping["calls"] == 1  # the first layer's attention refused it
    ids, _ = decode(model, prompt_ids(tok), 2, params, seed=0, kernel=False, graphs=False)  # the model as it was
    assert all(len(c) == 4 for c in ids)


def test_prefill_passes_take_as_many_prompts_as_their_tokens_allow(monkeypatch):
    from stages.rl import decoding

    monkeypatch.setattr(decoding, "PREFILL_TOKENS", 16)
    assert decoding.prefill_passes([4, 4, 4, 6, 9]) == [(0, 3), (3, 5)]
    assert decoding.prefill_passes([20, 3, 3]) == [(0, 1), (1, 3)]  # one prompt past the budget: alone
    assert decoding.prefill_passes([2] * 8) == [(0, 8)] and decoding.prefill_passes([]) == []


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (1.0, 0.8)])
def test_token_frequencies_follow_the_policy(models, device, temperature, top_p):
    model, tok, _ = models(device)
    prompt = prompt_ids(tok, ["12+30="])
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(prompt, device=device)).logits[0, -1].float().cpu()
    n = 20000
    params = SamplingParams(max_new_tokens=1, temperature=temperature, top_p=top_p, eos_token_id=tok.eos_token_id,
                            pad_token_id=tok.pad_token_id)
    ids, _ = decode(model, prompt, n, params, seed=3, rows=4000)  # on GPU: 5 calls
    counts = Counter(c[0] for c in ids)

    def p_value(temp):
        probs = torch.softmax(logits / temp, -1)
        if top_p < 1:  # HF's nucleus: drop the least likely tokens whose total stays within 1 - top_p
            sorted_p, order = probs.sort()
            drop = sorted_p.cumsum(0) <= 1 - top_p
            probs[order[drop]] = 0
            probs /= probs.sum()
        support = [t for t in range(len(probs)) if probs[t] * n >= 5]  # chi-square needs expected counts >= 5
        assert sum(counts[t] for t in range(len(probs)) if probs[t] == 0) == 0, "a token outside the nucleus"
        observed = [counts[t] for t in support] + [n - sum(counts[t] for t in support)]
        expected = [float(probs[t]) * n for t in support] + [n - sum(float(probs[t]) * n for t in support)]
        if expected[-1] < 5:
            observed = observed[:-2] + [observed[-2] + observed[-1]]
            expected = expected[:-2] + [expected[-2] + expected[-1]]
        return chisquare(observed, expected).pvalue

    assert p_value(temperature) > 1e-3
    # The test has the power to catch a sampler at another temperature.
    assert p_value(temperature * 1.5) < 1e-6


@pytest.mark.parametrize("device", DEVICES)
def test_same_seed_same_completions(models, device):
    model, tok, frequent = models(device)
    params = SamplingParams(max_new_tokens=32, eos_token_id=frequent, pad_token_id=tok.pad_token_id)
    a, dec = decode(model, prompt_ids(tok), 4, params, seed=7, rows=8)
    b, _ = decode(model, prompt_ids(tok), 4, params, seed=7, rows=8)
    c, _ = decode(model, prompt_ids(tok), 4, params, seed=8, rows=8)
    assert a == b and a != c and len(a) == 20
    # The same decoder again (graphs already captured) samples the same.
    again = dec.sample(prompt_ids(tok), 4, params, torch.Generator(device).manual_seed(7))
    assert again == a


@pytest.mark.parametrize("device", DEVICES)
def test_sequences_stop_at_eos_or_exactly_max_new_tokens(models, device):
    model, tok, frequent = models(device)
    params = SamplingParams(max_new_tokens=20, eos_token_id=frequent, pad_token_id=tok.pad_token_id)
    ids, _ = decode(model, prompt_ids(tok), 8, params, seed=2)
    ended = [c for c in ids if c[-1] == frequent]
    assert ended and len(ended) < len(ids)  # both kinds occur
    for c in ids:
        assert frequent not in c[:-1]  # nothing after the first end-of-sequence token
        assert len(c) == 20 or c[-1] == frequent


@pytest.mark.parametrize("device", DEVICES)
def test_sequences_whose_rows_fill_continue_in_a_later_round(models, device):
    model, tok, frequent = models(device)
    prompts = prompt_ids(tok)
    # 30 sequences of up to 200 new tokens need rows of 256 positions; the buffer holds rows of 128
    # for all 30: every sequence starts at once, and those still going after ~120 tokens spill. (The
    # decode kernel's layout lays full rows out again longer instead, where it can: the next test.)
    params = SamplingParams(max_new_tokens=200, temperature=1.5, eos_token_id=frequent, pad_token_id=tok.pad_token_id)
    (ids, lps), dec = decode(model, prompts, 6, params, seed=4, record=True, positions=30 * 128, kernel=False)
    st = dec.stats
    assert st.spilled > 0 and st.rounds >= 2 and st.calls >= 2, st
    # A spilled sequence drew 128 - width + 1 tokens in its first row, then went on in another.
    assert max(len(c) for c in ids) > 128 - max(map(len, prompts)) + 1 and any(c[-1] == frequent for c in ids)
    for c, lp in zip(ids, lps):
        assert frequent not in c[:-1] and (len(c) == 200 or c[-1] == frequent) and len(lp) == len(c)
    assert_teacher_forced(model, prompts, 6, ids, lps, params.temperature, device)
    again, _ = decode(model, prompts, 6, params, seed=4, positions=30 * 128, kernel=False)
    assert again == ids


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (Triton's interpreter on the host is "
                    "too slow for sequences long enough to fill their rows)")
def test_full_rows_go_on_longer_in_the_room_of_ended_ones_with_the_policys_tokens(models):
    # Prompts wide enough for the decode kernel to hold them apart (decoding.APART_FROM), so the 30 rows
    # get 64 positions of their own each: when they are full, most sequences have ended and the live
    # ones go on in longer rows, in the same call.
    model, tok, _ = models("cuda")
    words = "Add the two numbers below and give only their sum, with no words: "
    prompts = prompt_ids(tok, [words + p for p in PROMPTS])
    assert APART_FROM <= min(map(len, prompts)) and max(map(len, prompts)) < 80
    with torch.no_grad():  # the model's most likely token after these prompts: sequences end often
        frequent = int(model(input_ids=torch.tensor([prompts[0]], device="cuda")).logits[0, -1].argmax())
    params = SamplingParams(max_new_tokens=200, temperature=1.5, eos_token_id=frequent, pad_token_id=tok.pad_token_id)
    (ids, lps), dec = decode(model, prompts, 6, params, seed=4, record=True, positions=5 * 80 + 30 * 87)
    st = dec.stats
    assert dec.decode_kernel and st.widenings > 0 and max(len(c) for c in ids) > 64, st
    for c, lp in zip(ids, lps):
        assert frequent not in c[:-1] and (len(c) == 200 or c[-1] == frequent) and len(lp) == len(c)
    assert_teacher_forced(model, prompts, 6, ids, lps, params.temperature, "cuda")


def test_rounds_are_planned_from_the_buffer():
    from types import SimpleNamespace

    from stages.rl.decoding import CompactDecoder as D

    def decoder(rows, positions, apart=False):  # what _plan reads of a decoder (apart: the decode kernel's layout)
        dec = SimpleNamespace(rows=rows, positions=positions, decode_kernel=apart)
        dec._calls_by_width = lambda groups, remaining: D._calls_by_width(dec, groups, remaining)
        dec.holds_apart = lambda width: D.holds_apart(dec, width)
        return dec

    def plan(rows, positions, groups, remaining, apart=False):
        dec = decoder(rows, positions, apart)
        return [(sum(len(q) for _, q in g), r, n) for g, r, n, _ in D._plan(dec, groups, remaining)]

    prompts = [([1] * 60, list(range(i * 8, i * 8 + 8))) for i in range(256)]  # 2,048 sequences
    assert plan(2048, 2048 * 576, prompts, 512) == [(2048, 2048, 576)]  # all fit at full length
    # Room for rows of 384: all at once, each with 324 of its 512 tokens before it may spill.
    assert plan(2048, 2048 * 400, prompts, 512) == [(2048, 2048, 384)]
    # Prompts narrower than APART_FROM stay in their rows with the decode kernel too.
    assert len(prompts[0][0]) < APART_FROM and plan(2048, 2048 * 400, prompts, 512, apart=True) == [(2048, 2048, 384)]
    # Rows of 128 would give 68 tokens (< 512 / 4): calls of full-length rows instead, each as many as fit.
    assert plan(2048, 2048 * 130, prompts, 512) == [(462, 462, 576)] * 4 + [(200, 462, 576)]
    # A row cap splits a prompt's attempts over two calls.
    assert plan(12, 10**6, prompts[:3], 64) == [(12, 12, 128), (12, 12, 128)]
    # Several calls take the prefixes shortest first, so each call pads to a width near its own prompts'.
    mixed = [([1] * n, [i]) for i, n in enumerate([90, 10, 70, 30, 50, 20])]
    dec = decoder(2, 10**6)
    assert [[len(p) for p, _ in g] for g, _, _, _ in D._plan(dec, mixed, 8)] == [[10, 20], [30, 50], [70, 90]]
    # Each call's rows as long as its own prompts need: 1,000 sequences of 100-token prompts and 24 of
    # 600 take two calls where rows sized for the longest prompt (1,152 positions) would take three.
    gsm = [([1] * 100, list(range(i * 8, i * 8 + 8))) for i in range(125)] + \
        [([1] * 600, list(range(1000 + i * 8, 1008 + i * 8))) for i in range(3)]
    positions = 400 * 1152
    assert positions // 1152 * 2 < 1024
    assert plan(1024, positions, gsm, 512) == [(720, 720, 640), (304, 400, 1152)]
    with pytest.raises(ValueError, match="not one row of a 600-token prefix"):
        plan(1024, 1000, gsm, 512)
    # Each prompt's K/V held once, apart from the rows: the 128 prompts take 128 x 600 positions, and the
    # rest gives every row 320 of its own (>= 512 / 4): all 1,024 at once.
    assert plan(1024, positions, gsm, 512, apart=True) == [(1024, 1024, 920)]
    # With less room, calls of full-length rows, each with its prompts once: rows of the 100-token
    # prompts hold 540 positions (39 prompts, 312 rows: 39 x 100 + 312 x 540 <= 172,800).
    calls = plan(1024, 150 * 1152, gsm, 512, apart=True)
    assert calls[0] == (312, 312, 640) and sum(n for n, _, _ in calls) == 1024
    assert len(calls) < len(plan(1024, 150 * 1152, gsm, 512))


def test_ladder_and_buffer_shapes():
    assert ladder(2048)[:4] == [2048, 1536, 1152, 864] and ladder(2048)[-3:] == [4, 2, 1]
    assert all(b % 8 == 0 for b in ladder(2048)[1:-3])
    assert buffer_length(10, 512) == 576 and buffer_length(1, 64) == 64
    # A sequence spilled with one token to go, its prefix a whole number of steps: still a row past it.
    assert buffer_length(128, 1) == 192 and buffer_length(127, 1) == 128


def test_sliding_window_models_are_refused(models):
    from stages.rl.decoding import check_supported
    model, _, _ = models("cpu")
    config = model.config.__class__(**{**model.config.to_dict(), "layer_types": ["sliding_attention"] * 2})
    with pytest.raises(ValueError, match="generate.cache=static"):
        check_supported(config)


def test_grouped_query_attention_takes_the_products_at_every_prefix(models, monkeypatch):
    """With grouped-query attention every decode step goes through decode_attention, past the prefix
    length where a model with one K/V head per query head switches to SDPA (which would repeat K/V per
    group), and the log-probs still equal a teacher-forced pass."""
    from transformers import AutoModelForCausalLM

    from stages.rl import decoding

    base, tok, frequent = models("cpu")
    config = base.config.__class__(**{**base.config.to_dict(), "num_key_value_heads": 2})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    monkeypatch.setattr(decoding, "MATMUL_ATTENTION_BELOW", 16)
    prefixes = []
    real = decoding.decode_attention

    def counted(module, query, key, *args, **kwargs):
        prefixes.append(key.shape[2])
        return real(module, query, key, *args, **kwargs)

    monkeypatch.setattr(decoding, "decode_attention", counted)
    prompts = prompt_ids(tok)
    params = SamplingParams(max_new_tokens=40, temperature=1.0, eos_token_id=-1, pad_token_id=tok.pad_token_id)
    (ids, lps), dec = decode(model, prompts, 2, params, seed=3, record=True)
    # Every layer of every step after the prefill attended through the products, most of them past 16.
    assert len(prefixes) == config.num_hidden_layers * dec.stats.steps > 0
    assert max(prefixes) > 16
    assert_teacher_forced(model, prompts, 2, ids, lps, 1.0, "cpu")
