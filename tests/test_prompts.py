"""Models, data and rewards as users bring them: a subword tokenizer with a BOS and a chat template
(tests/bpe_model.py trains one here), data files with their own field names and answer formats.
The prompt's token ids are made once, in generate, and train learns from exactly those."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from jobs.check import check
from stages.rl import prompts
from stages.rl.modeling import load_tokenizer
from stages.rl.tiny_model import build_tokenizer
from stages.runtime.answer import boxed_text, is_correct, reference_answer
from stages.runtime.config import ConfigError, DataConfig, ScoreConfig, load_config
from stages.runtime.data import load_problems, read_jsonl_problems
from stages.score import reward_fields
from tests.bpe_model import BOS, EOS, GSM8K_TEST, corpus, create_bpe_model, train_tokenizer

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    return create_bpe_model(tmp_path_factory.mktemp("bpe") / "model")


@pytest.fixture(scope="module")
def bpe_no_template_dir(tmp_path_factory):
    return create_bpe_model(tmp_path_factory.mktemp("bpe_plain") / "model", chat_template=False)


def encoded(tokenizer, text: str, data: DataConfig, where="tok") -> dict:
    item = {"prompt": text}
    prompts.encode(tokenizer, [item], data, where)
    return item


def test_a_plain_prompt_starts_with_the_tokenizers_bos_once_and_never_ends_with_its_eos(bpe_dir):
    tok = load_tokenizer(bpe_dir)
    item = encoded(tok, "Question: 2+3?\nAnswer:", DataConfig())
    assert item["prompt_ids"][0] == tok.bos_token_id and item["prompt_ids"].count(tok.bos_token_id) == 1
    assert item["prompt_ids"][1:] == tok("Question: 2+3?\nAnswer:", add_special_tokens=False)["input_ids"]
    assert item["prompt"] == "Question: 2+3?\nAnswer:"
    # A tokenizer that appends its EOS to every text (as some do): the prompt keeps none of it.
    from tokenizers import processors

    appends = train_tokenizer(corpus(50), chat_template=False)
    eos = appends.convert_tokens_to_ids(EOS)
    appends.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A {EOS}", special_tokens=[(BOS, appends.bos_token_id), (EOS, eos)])
    assert appends("2", add_special_tokens=True)["input_ids"][-1] == eos
    ids = encoded(appends, "2+3", DataConfig())["prompt_ids"]
    assert ids[0] == appends.bos_token_id and eos not in ids
    # The built-in character tokenizer puts nothing first: prompts are the text's characters.
    char = build_tokenizer()
    assert encoded(char, "2+3=", DataConfig())["prompt_ids"] == char("2+3=", add_special_tokens=False)["input_ids"]


def test_a_chat_prompt_is_the_tokenizers_template_with_one_bos(bpe_dir):
    tok = load_tokenizer(bpe_dir)
    data = DataConfig(chat_template=True, system_prompt="Answer in \\boxed{}.", prompt_template="Q: {question}")
    item = encoded(tok, data.prompt_template.format(question="2+3?"), data)
    expected = tok.apply_chat_template([{"role": "system", "content": "Answer in \\boxed{}."},
                                        {"role": "user", "content": "Q: 2+3?"}], tokenize=False,
                                       add_generation_prompt=True)
    assert item["prompt"] == expected
    assert expected.startswith(BOS) and expected.endswith("assistant<|end_header_id|>\n\n")
    assert item["prompt_ids"] == tok(expected, add_special_tokens=False)["input_ids"]
    assert item["prompt_ids"].count(tok.bos_token_id) == 1  # the template's own, not one more
    assert tok.pad_token_id == tok.eos_token_id  # no pad token: the EOS pads, as for Llama-3
    assert any(len(tok.decode([i])) > 1 for i in item["prompt_ids"])  # subwords, not characters


def test_a_chat_setting_without_a_template_is_refused_before_the_run_and_in_the_stage(
        bpe_dir, bpe_no_template_dir, tmp_path):
    def problems(*overrides):
        cfg = load_config(ROOT / "configs" / "local_tiny.yaml", [f"run_dir={tmp_path / 'run'}", *overrides])
        return [p for p in check(cfg, "local") if "chat template" in p]

    assert problems("data.chat_template=true", f"model.path={bpe_dir}") == []
    [missing] = problems("data.chat_template=true", f"model.path={bpe_no_template_dir}")
    assert f"the tokenizer in {bpe_no_template_dir} has no chat template" in missing
    assert "set data.chat_template=false and write the model's prompt format in data.prompt_template" in missing
    [builtin] = problems("data.chat_template=true")
    assert "the built-in preset's character tokenizer has no chat template" in builtin
    assert problems(f"model.path={bpe_no_template_dir}") == []
    with pytest.raises(ConfigError, match="the tokenizer in /models/x has no chat template"):
        encoded(load_tokenizer(bpe_no_template_dir), "q", DataConfig(chat_template=True), "/models/x")


def test_data_settings_are_checked_when_the_config_loads():
    with pytest.raises(ConfigError, match="data.system_prompt is set but data.chat_template is false"):
        DataConfig(system_prompt="Be brief.")
    with pytest.raises(ConfigError, match="data.answer_format must be one of gsm8k, boxed, plain, custom"):
        DataConfig(answer_format="latex")
    with pytest.raises(ConfigError, match="both 'text'"):
        DataConfig(question_field="text", answer_field="text")
    with pytest.raises(ConfigError, match="the synthetic task's answers are GSM8K's"):
        DataConfig(answer_format="boxed")
    with pytest.raises(ConfigError, match="score.reward_fn is empty: name the reward function that reads them"):
        load_config(ROOT / "configs" / "local_tiny.yaml", ["data.answer_format=custom"])


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_data_file_with_its_own_field_names_and_answer_format(tmp_path):
    math = write_rows(tmp_path / "math.jsonl", [
        {"problem": "Half of 1?", "solution": "It is $\\boxed{\\frac{1}{2}}$.", "level": "Level 1"},
        {"problem": "2+2?", "solution": "2+2 = \\boxed{4}"},
    ])
    data = DataConfig(source=str(math), question_field="problem", answer_field="solution", answer_format="boxed")
    problems = load_problems(data, 0)
    assert problems[0] == {"question": "Half of 1?", "answer": "It is $\\boxed{\\frac{1}{2}}$.",
                           "fields": {"level": "Level 1"}}
    with pytest.raises(ConfigError, match=r"math.jsonl:1: no string field 'question' or 'answer' \(data.question_field "
                                          r"is 'question', data.answer_field 'answer'; the row's other fields: level, "
                                          r"problem, solution\)"):
        read_jsonl_problems(math)
    with pytest.raises(ConfigError, match=r"math.jsonl:1: 'solution' must be a worked solution ending with '#### "):
        read_jsonl_problems(math, DataConfig(source=str(math), question_field="problem", answer_field="solution"))
    no_box = write_rows(tmp_path / "nobox.jsonl", [{"problem": "2+2?", "solution": "four"}])
    with pytest.raises(ConfigError, match=r"nobox.jsonl:1: 'solution' must be a solution with its answer in "
                                          r"\\boxed\{...\} \(data.answer_format 'boxed'\)"):
        read_jsonl_problems(no_box, data)
    plain = write_rows(tmp_path / "plain.jsonl", [{"q": "2+2?", "a": "4"}, {"q": "Capital of France?", "a": "Paris"}])
    assert len(read_jsonl_problems(plain, DataConfig(source=str(plain), question_field="q", answer_field="a",
                                                     answer_format="plain"))) == 2
    custom = write_rows(tmp_path / "custom.jsonl", [{"question": "q", "answer": ""}])
    assert read_jsonl_problems(custom, DataConfig(answer_format="custom"))[0]["answer"] == ""


@pytest.mark.parametrize("fmt,answer,completion,correct", [
    ("boxed", "so $\\boxed{\\frac{1}{2}}$", "It is \\boxed{\\frac{1}{ 2}}", True),
    ("boxed", "so $\\boxed{\\frac{1}{2}}$", "It is \\boxed{\\frac{1}{3}}", False),
    ("boxed", "2+2 = \\boxed{4}", "The answer is \\boxed{4.0}.", True),
    ("boxed", "2+2 = \\boxed{4}", "#### 4", True),
    ("plain", "1,000", "It is 1000", True),
    ("plain", "Paris", "\\boxed{Paris}", True),
    ("plain", "Paris", "\\boxed{Lyon}", False),
    ("gsm8k", "3 + 4 = 7\n#### 7", "so 7", True),
])
def test_the_built_in_reward_reads_each_answer_format(fmt, answer, completion, correct):
    reference = reference_answer(answer, fmt)
    assert is_correct(completion, reference) is correct
    fields = reward_fields(completion, reference, False, ScoreConfig())
    assert fields["correct"] is correct and fields["formatted"]
    assert fields["reward"] == pytest.approx(1.1 if correct else 0.1)
    assert reward_fields(completion, None, False, ScoreConfig())["correct"] is False  # custom: the plug-in's call


def test_boxed_text_reads_the_last_complete_box():
    assert boxed_text("\\boxed{1} then \\boxed{\\frac{a}{b}} and \\boxed{") == "\\frac{a}{b}"
    assert boxed_text("\\boxed 42") == "42" and boxed_text("no box") is None


def test_a_run_with_a_chat_template_and_a_boxed_data_file_end_to_end(bpe_dir, tmp_path):
    """`syncrl run`, one iteration, two ranks: subword tokens, a chat template with a system turn, BOS
    once, pad equal to EOS, and a MATH-style data file; train learns from exactly generate's ids."""
    if GSM8K_TEST.is_file():
        source = [json.loads(line) for line in GSM8K_TEST.read_text().splitlines()[:8]]
    else:
        source = [{"question": f"What is {a} plus {a}?", "answer": f"#### {2 * a}"} for a in range(8)]
    rows = [{"problem": r["question"], "source": "gsm8k",
             "solution": f"... so the answer is $\\boxed{{{r['answer'].split('####')[-1].strip()}}}$"} for r in source]
    data = write_rows(tmp_path / "math.jsonl", rows)
    run = tmp_path / "run"
    settings = [f"model.path={bpe_dir}", f"data.source={data}", "data.question_field=problem",
                "data.answer_field=solution", "data.answer_format=boxed", "data.chat_template=true",
                "data.system_prompt=Reason, then put the answer in \\boxed{}.", 'data.prompt_template="{question}"',
                "data.prompts_per_iteration=4", "generate.attempts=4", "generate.max_new_tokens=12",
                "train.micro_batch_size=16"]
    proc = subprocess.run([sys.executable, "-m", "jobs.cli", "run", "configs/local_tiny.yaml", f"run_dir={run}",
                           "iterations=1", "start_early=never", *settings, "--launcher", "local"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]

    tok = load_tokenizer(bpe_dir)
    it = run / "iter_00000"
    generated = [json.loads(line) for rank in (0, 1)
                 for line in (it / "generate" / f"rank_{rank:05d}.jsonl").read_text().splitlines()]
    assert len(generated) == 16
    for r in generated:
        expected = tok.apply_chat_template(
            [{"role": "system", "content": "Reason, then put the answer in \\boxed{}."},
             {"role": "user", "content": r["question"]}], tokenize=False, add_generation_prompt=True)
        assert r["prompt"] == expected
        assert r["prompt_ids"] == tok(expected, add_special_tokens=False)["input_ids"]
        assert r["prompt_ids"].count(tok.bos_token_id) == 1
        assert r["fields"] == {"source": "gsm8k"}
        assert r["answer"].startswith("... so the answer is $\\boxed{")
    assert any(len(tok.decode([i])) > 1 for r in generated for i in r["completion_ids"])
    scored = [json.loads(line) for rank in (0, 1)
              for line in (it / "score" / f"rank_{rank:05d}.jsonl").read_text().splitlines()]
    assert all(isinstance(r["correct"], bool) for r in scored)
    # Train's rows are generate's ids, untouched: nothing re-tokenizes a prompt after generate.
    by_key = {(r["prompt_id"], r["sample_index"]): r for r in generated}
    train_rows = [json.loads(line) for line in (it / "gather" / "train.jsonl").read_text().splitlines()]
    assert train_rows
    for r in train_rows:
        g = by_key[(r["prompt_id"], r["sample_index"])]
        assert (r["prompt_ids"], r["completion_ids"]) == (g["prompt_ids"], g["completion_ids"])
    # Train ran on those ids: every position of every row, once per epoch (local_tiny.yaml: 2).
    train = json.loads((it / "markers" / "train.rank_00000.done").read_text())
    assert train["positions"] == 2 * sum(len(r["prompt_ids"]) + len(r["completion_ids"]) for r in train_rows)
    assert train["tokens"] == 2 * sum(len(r["completion_ids"]) for r in train_rows)
    # The policy that save exports keeps the tokenizer's chat template for the next iteration and for serving.
    assert (run / "models" / "iter_00000" / "chat_template.jinja").read_text() == \
        (bpe_dir / "chat_template.jinja").read_text()
