import json

import pytest

from stages.runtime.config import ConfigError, DataConfig
from stages.runtime.data import iteration_prompts, load_problems, read_jsonl_problems, shard, synthetic_problems


@pytest.mark.parametrize("n,world", [(10, 3), (7, 2), (1, 4), (64, 8)])
def test_shards_partition_the_prompts(n, world):
    items = list(range(n))
    shards = [shard(items, r, world) for r in range(world)]
    assert sorted(x for s in shards for x in s) == items
    sizes = [len(s) for s in shards]
    assert max(sizes) - min(sizes) <= 1


def test_iteration_prompts_are_deterministic_and_vary_by_iteration():
    cfg = DataConfig(prompts_per_iteration=16)
    probs = synthetic_problems(100, 4, seed=0)
    a = iteration_prompts(cfg, probs, 0, 3)
    assert a == iteration_prompts(cfg, probs, 0, 3)
    assert [x["problem_index"] for x in a] != [x["problem_index"] for x in iteration_prompts(cfg, probs, 0, 4)]
    assert len({x["prompt_id"] for x in a}) == 16
    assert len({x["problem_index"] for x in a}) == 16  # no repeats within an iteration


def test_small_dataset_is_cycled():
    cfg = DataConfig(prompts_per_iteration=10)
    items = iteration_prompts(cfg, synthetic_problems(3, 4, 0), 0, 0)
    assert len(items) == 10


def test_synthetic_task_is_gsm8k_format():
    for p in synthetic_problems(50, 4, seed=1):
        a, b = p["question"].rstrip("=").split("+")
        assert p["answer"].endswith(f"#### {int(a) + int(b)}")


def test_jsonl_reader_names_file_and_line(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"question": "q", "answer": "a #### 3"}) + "\n{oops\n")
    with pytest.raises(ConfigError, match=r"d.jsonl:2: not valid JSON"):
        read_jsonl_problems(p)
    p.write_text(json.dumps({"question": "q", "answer": "no marker"}) + "\n")
    with pytest.raises(ConfigError, match=r"d.jsonl:1: 'answer' must be a worked solution ending with '#### <answer>'"):
        read_jsonl_problems(p)
    p.write_text("")
    with pytest.raises(ConfigError, match="is empty: it holds no problems"):
        read_jsonl_problems(p)


def test_local_jsonl_source(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps({"question": f"q{i}", "answer": f"#### {i}"}) + "\n" for i in range(5)))
    assert len(load_problems(DataConfig(source=str(p)), 0)) == 5
