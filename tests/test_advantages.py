import math

import pytest

from stages.rl.advantages import advantages, build_train_set


def test_grpo_hand_computed():
    # rewards 1,0,0,1: mean 0.5, sample std sqrt(4 * 0.25 / 3) = 0.57735
    adv = advantages([1, 0, 0, 1], "grpo")
    assert adv == pytest.approx([0.866025, -0.866025, -0.866025, 0.866025], rel=1e-5)
    assert advantages([1, 0, 0, 1], "grpo", normalize_std=False) == [0.5, -0.5, -0.5, 0.5]


def test_rloo_hand_computed():
    # leave-one-out baseline: 1 - mean(0, 0, 1) = 2/3; 0 - mean(1, 0, 1) = -2/3
    assert advantages([1, 0, 0, 1], "rloo") == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])
    assert advantages([3.0], "rloo") == [0.0]


def test_none_and_zero_variance():
    assert advantages([0.2, 1.1], "none") == [0.2, 1.1]
    assert advantages([1, 1, 1], "grpo") == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        advantages([1], "ppo")


def rows():
    out = []
    for pid, rewards in (("a", [1, 0, 0, 0]), ("b", [1, 1, 1, 1]), ("c", [0.1, 1.1, 0.1, 0.1])):
        out += [{"prompt_id": pid, "sample_index": i, "rank": 0, "reward": r} for i, r in enumerate(rewards)]
    return out


def test_train_set_and_filters():
    kept, counts = build_train_set(rows(), "grpo")
    assert len(kept) == 12 and counts["groups"] == 3
    assert sum(r["advantage"] for r in kept) == pytest.approx(0.0, abs=1e-9)
    kept, counts = build_train_set(rows(), "grpo", drop_zero_variance=True)
    assert {r["prompt_id"] for r in kept} == {"a", "c"} and counts["dropped_zero_variance"] == 4
    kept, counts = build_train_set(rows(), "grpo", rejection_sampling=True)
    assert [(r["prompt_id"], r["sample_index"]) for r in kept] == [("a", 0), ("c", 1)]
    assert all(math.isfinite(r["advantage"]) for r in kept)
