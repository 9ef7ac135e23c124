"""The generation benchmarks' roofline (tests/benchmarks/decode_bound.py), checked by hand on small cases."""

import pytest

from tests.benchmarks.decode_bound import HBM_BYTES_PER_S, Shape, bound, hbm_bandwidth, roofline

# 1e9 parameters in bf16, 2 layers of 4 query and 2 K/V heads of 8: K/V bytes per position
# 2 (K and V) x 2 layers x 2 heads x 8 x 2 bytes = 128.
SHAPE = Shape(params=10**9, weight_bytes=2 * 10**9, layers=2, q_heads=4, kv_heads=2, head_dim=8, itemsize=2)


def test_each_phase_is_the_larger_of_its_compute_and_its_memory_time():
    # One prompt of 10 tokens, two attempts: completions of 3 and 5 new tokens.
    rf = roofline([(10, 3), (10, 5)], attempts=2, shape=SHAPE, peak_flops=1.5e12, bandwidth=1e12)
    attn = 4 * 2 * 4 * 8  # FLOPs per (token, position attended)
    prefill = rf["phases"]["prefill"]
    assert prefill["compute_s"] == pytest.approx((2 * 10**9 * 10 + attn * 55) / 1.5e12)  # the prompt once
    assert prefill["memory_s"] == pytest.approx((2 * 10**9 + 128 * 10) / 1e12)
    assert prefill["bound_s"] == prefill["compute_s"]  # 10 tokens x 2 FLOPs a parameter beat one weight read
    # Steps 1-2: both sequences running; steps 3-4: only the longer one.
    full, tail = rf["phases"]["full"], rf["phases"]["tail"]
    assert (full["steps"], tail["steps"]) == (2, 2)
    attended = {1: 2 * (10 + 2), 2: 2 * (10 + 3), 3: 10 + 4, 4: 10 + 5}
    rows = {1: 2, 2: 2, 3: 1, 4: 1}

    def step(k):
        return max((2 * 10**9 * rows[k] + attn * attended[k]) / 1.5e12, (2 * 10**9 + 128 * attended[k]) / 1e12)
    assert full["bound_s"] == pytest.approx(step(1) + step(2))
    assert tail["bound_s"] == pytest.approx(step(3) + step(4))
    assert full["compute_bound_steps"] == 2 and tail["compute_bound_steps"] == 0  # 2 rows: 4e9 FLOPs at 1.5e12 > 2e9 bytes at 1e12; 1 row: <
    assert rf["bound_s"] == pytest.approx(prefill["bound_s"] + full["bound_s"] + tail["bound_s"])
    assert rf["new_tokens_per_s"] == pytest.approx(8 / rf["bound_s"])


def test_a_step_that_runs_its_projections_then_its_attention_is_bound_by_the_sum_of_their_roofs():
    # One prompt of 10 tokens, two attempts: completions of 3 and 5 new tokens (as above).
    rf = roofline([(10, 3), (10, 5)], attempts=2, shape=SHAPE, peak_flops=1.5e12, bandwidth=1e12)
    attn = 4 * 2 * 4 * 8
    attended = {1: 2 * (10 + 2), 2: 2 * (10 + 3), 3: 10 + 4, 4: 10 + 5}
    rows = {1: 2, 2: 2, 3: 1, 4: 1}

    def serial(k):  # the weights' read hides under 2 rows' FLOPs, not under 1's; the attention is K/V-bound
        return (max(2 * 10**9 * rows[k] / 1.5e12, 2 * 10**9 / 1e12)
                + max(attn * attended[k] / 1.5e12, 128 * attended[k] / 1e12))
    full, tail, prefill = rf["phases"]["full"], rf["phases"]["tail"], rf["phases"]["prefill"]
    assert full["serial_s"] == pytest.approx(serial(1) + serial(2))
    assert tail["serial_s"] == pytest.approx(serial(3) + serial(4))
    assert prefill["serial_s"] == pytest.approx(2 * 10**9 * 10 / 1.5e12 + max(attn * 55 / 1.5e12, 128 * 10 / 1e12))
    for ph in (prefill, full, tail):
        assert ph["bound_s"] <= ph["serial_s"] <= ph["compute_s"] + ph["memory_s"]
    assert rf["serial_s"] == pytest.approx(prefill["serial_s"] + full["serial_s"] + tail["serial_s"])


def test_with_shared_prompts_a_step_reads_each_live_prompt_once():
    # Two prompts of 10 and 20 tokens, two attempts each: completions 3 and 5, 2 and 2.
    pairs = [(10, 3), (10, 5), (20, 2), (20, 2)]
    own = roofline(pairs, attempts=2, shape=SHAPE, peak_flops=1e30, bandwidth=1e12)
    shared = roofline(pairs, attempts=2, shape=SHAPE, peak_flops=1e30, bandwidth=1e12, shared_prompts=True)
    # Step 1: all four live (prompt positions read 10 + 10 + 20 + 20, or 10 + 20 shared); steps 2-4: the first
    # prompt's attempts, then one of them (20 or 10 at step 2; 10 at steps 3 and 4 either way).
    generated = {1: 4 * 2, 2: 2 * 3, 3: 4, 4: 5}
    prompt_own, prompt_shared = {1: 60, 2: 20, 3: 10, 4: 10}, {1: 30, 2: 10, 3: 10, 4: 10}

    def memory(prompt, k):
        return (2 * 10**9 + 128 * (prompt[k] + generated[k])) / 1e12
    assert own["phases"]["full"]["memory_s"] == pytest.approx(memory(prompt_own, 1))
    assert shared["phases"]["full"]["memory_s"] == pytest.approx(memory(prompt_shared, 1))
    assert shared["phases"]["tail"]["memory_s"] == pytest.approx(sum(memory(prompt_shared, k) for k in (2, 3, 4)))
    assert own["phases"]["tail"]["memory_s"] == pytest.approx(sum(memory(prompt_own, k) for k in (2, 3, 4)))
    assert shared["phases"]["full"]["compute_s"] == own["phases"]["full"]["compute_s"]  # every row still attends


def test_a_decode_bound_workload_sits_on_the_memory_roof():
    # Many short rows on a large model: every step reads the weights, few FLOPs per byte.
    pairs = [(100, 200)] * 8
    rf = roofline(pairs, attempts=8, shape=SHAPE)
    steps = rf["phases"]["full"]["steps"]
    assert steps == 199 and rf["phases"]["full"]["compute_bound_steps"] == 0
    memory_only = bound(pairs, SHAPE.weight_bytes, SHAPE.kv_per_position)
    # The same bytes as the bandwidth bound, within a step's weights (it counts the prefill's token too).
    assert rf["phases"]["full"]["memory_s"] == pytest.approx(memory_only["seconds"], rel=0.01)


@pytest.mark.parametrize("name, expected", [
    ("NVIDIA H200", (4.8e12, "H200")),
    ("NVIDIA H100 80GB HBM3", (3.35e12, "H100")),
    ("NVIDIA H100 PCIe", (2.0e12, "H100 PCIe")),
    ("NVIDIA H100 NVL", (3.9e12, "H100 NVL")),
])
def test_the_roofline_takes_the_bandwidth_of_the_card_it_runs_on(name, expected):
    assert hbm_bandwidth(name) == expected


def test_an_unknown_card_or_none_takes_the_h200_figure_and_says_so():
    assert hbm_bandwidth("") == (HBM_BYTES_PER_S, "H200, for no GPU")
    assert hbm_bandwidth("Tesla T4") == (HBM_BYTES_PER_S, "H200, for Tesla T4")
    assert hbm_bandwidth("NVIDIA H200", given=2e12) == (2e12, "--bandwidth")  # a benchmark's --bandwidth
