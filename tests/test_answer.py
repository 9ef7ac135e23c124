"""Tests for stages.runtime.answer: final-answer extraction and grading."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stages.runtime import answer as answer_module
from stages.runtime.answer import extract_answer, is_correct, normalize_number

REPO_ROOT = Path(__file__).resolve().parents[1]
# The shared data directory sits next to the checkout on the cluster; users'
# clones have none, so every test that reads it skips when it is absent.
GSM8K_DIR = Path(
    os.environ.get("SYNCRL_GSM8K_DIR")
    or Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"
)
MODEL_KEYS = ("6b_finetuning", "6b_verification", "175b_finetuning", "175b_verification")

# A real GSM8K test-set answer field (first row of test.jsonl).
JANET_ANSWER = (
    "Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs a day.\n"
    "She makes 9 * 2 = $<<9*2=18>>18 every day at the farmer\u2019s market.\n"
    "#### 18"
)
COMMA_ANSWER = (
    "He sells 100 * 12 = <<100*12=1200>>1200 tickets.\n"
    "So he makes 1200 * 1.5 = $<<1200*1.5=1800>>1800.\n"
    "#### 1,800"
)


# --- extract_answer ----------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # GSM8K "####" marker
        ("#### 72", "72"),
        ("So the total is 70 + 2 = <<70+2=72>>72\n#### 72", "72"),
        ("#### $1,200", "1200"),
        ("#### 1,200", "1200"),
        ("#### 18.00", "18"),
        ("#### 12.50", "12.5"),
        ("#### -3", "-3"),
        ("####-3", "-3"),
        ("####72", "72"),
        ("#### 45%", "45"),
        ("#### 5 apples", "5"),
        ("#### $ 7", "7"),
        ("####    \n\n   12\n", "12"),
        ("####\t\t9", "9"),
        ("#### 1,234.5", "1234.5"),
        ("#### 007", "7"),
        ("#### +4", "4"),
        ("#### 5.", "5"),
        ("#### 0.50", "0.5"),
        ("#### .5", "0.5"),
        ("#### 1000000", "1000000"),
        # last marker wins, wherever the other numbers are
        ("#### 5\nWait, I made an error.\n#### 7", "7"),
        ("#### 5\nthen 9 more things", "5"),
        ("#### 3 then #### 4 then #### 5", "5"),
        # a trailing marker with no number (truncation) defers to the earlier one
        ("#### 5 and later 8\n####", "5"),
        ("#####", None),
        ("#### \n", None),
        # the marker beats \boxed and trailing numbers
        ("\\boxed{3}\n#### 4\nThat was 10 steps.", "4"),
        # \boxed
        ("\\boxed{42}", "42"),
        ("The answer is $\\boxed{42}$.", "42"),
        ("\\boxed{1,000}", "1000"),
        ("\\boxed{1{,}200}", "1200"),
        ("\\boxed{\\$3.50}", "3.5"),
        ("\\boxed{45\\%}", "45"),
        ("\\boxed{-7}", "-7"),
        ("\\boxed{ 12.0 }", "12"),
        ("\\boxed{5 \\text{ apples}}", "5"),
        ("\\boxed{x = 5}", "5"),
        ("\\boxed{{42}}", "42"),
        ("\\boxed 5", "5"),
        ("\\boxed{1} then \\boxed{2}, finally 3 items", "2"),
        # an explicit but non-numeric boxed answer is not graded as its last digit
        ("\\boxed{\\frac{1}{2}}", None),
        ("\\boxed{3/4}", None),
        ("\\boxed{2^{10}}", None),
        ("\\boxed{\\sqrt{2}}", None),
        ("\\boxed{3 and 4}", None),
        ("\\boxed{x}", None),
        # an unclosed trailing \boxed{ (truncation) defers to an earlier closed one
        ("\\boxed{6} but actually \\boxed{7", "6"),
        # an unclosed-only \boxed falls back to the last number
        ("so it is 9 \\boxed{7", "7"),
        ("\\boxedfoo 8 and 9", "9"),
        # last number in free text
        ("The answer is 5.", "5"),
        ("She pays $3.50 in total", "3.5"),
        ("The discount is 45%", "45"),
        ("It costs $1,234.56.", "1234.56"),
        ("The temperature fell to -3 degrees", "-3"),
        ("x = -12", "-12"),
        ("(-4)", "-4"),
        ("\u22125 degrees", "-5"),  # typographic minus
        ("She has 48/2 = <<48/2=24>>24 cookies", "24"),
        ("<<48/2=24>>24", "24"),
        ("48-24", "24"),  # binary minus, not a negative number
        ("a-5", "5"),
        ("f(2)-1", "1"),
        ("It took 3-5 days", "5"),
        ("The 3rd of 4 items", "4"),
        ("abc123", "123"),
        ("1,2,3", "3"),  # a list, not thousands separators
        ("1, 2, and 3", "3"),
        ("10,000 people", "10000"),
        ("1,2345", "2345"),
        ("12,345,6789", "6789"),
        ("12.", "12"),
        ("Total: 12.0.", "12"),
        ("costs .75", "0.75"),
        ("1.2.3.4", "3.4"),
        ("v1.2.3", "3"),
        ("A: 18", "18"),
        ("-0", "0"),
        ("0.000", "0"),
        ("0007.5000", "7.5"),
        ("\u0662\u0663 is not ASCII", None),  # Arabic-Indic digits are not graded
        # nothing numeric
        ("", None),
        ("no number here", None),
        ("The answer is five.", None),
        ("$ %, . -", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_extract_answer_on_gsm8k_answer_fields():
    assert extract_answer(JANET_ANSWER) == "18"
    assert extract_answer(COMMA_ANSWER) == "1800"


# --- normalize_number ----------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("72", "72"),
        (" 72 ", "72"),
        ("1,234", "1234"),
        ("1,234.5", "1234.5"),
        ("1,000,000", "1000000"),
        ("$1,200", "1200"),
        ("\\$5", "5"),
        ("$ 5", "5"),
        ("45%", "45"),
        ("45\\%", "45"),
        ("45%.", "45"),
        ("12.", "12"),
        ("12.0", "12"),
        ("12.00", "12"),
        ("12.50", "12.5"),
        ("0.5", "0.5"),
        (".5", "0.5"),
        ("+5", "5"),
        ("-3", "-3"),
        ("- 3", "-3"),
        ("\u22123", "-3"),
        ("-$3", "-3"),
        ("$-3", "-3"),
        ("007", "7"),
        ("000", "0"),
        ("-0", "0"),
        ("-0.00", "0"),
        ("00.10", "0.1"),
        ("123456789012345678901234567890", "123456789012345678901234567890"),
        # not a single number
        ("", None),
        ("   ", None),
        (".", None),
        ("$", None),
        ("-", None),
        ("--5", None),
        ("+-5", None),
        ("abc", None),
        ("5 apples", None),
        ("1/2", None),
        ("1,1,1", None),
        ("1,23", None),
        ("1.2.3", None),
        ("1e3", None),
        ("12 13", None),
    ],
)
def test_normalize_number(raw, expected):
    assert normalize_number(raw) == expected


def test_extract_returns_normalized_values():
    # Whatever extract_answer returns is a fixed point of normalize_number, so
    # both can be compared by string equality.
    for text in ["#### $1,200.50", "\\boxed{007}", "x = -0.0", "1,234.5000."]:
        value = extract_answer(text)
        assert value is not None
        assert normalize_number(value) == value


# --- is_correct ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("completion", "reference", "expected"),
    [
        # GSM8K answer fields as the reference
        ("She makes 9 * 2 = 18 dollars.\n#### 18", JANET_ANSWER, True),
        ("#### $18.00", JANET_ANSWER, True),
        ("The answer is \\boxed{18}.", JANET_ANSWER, True),
        ("So she makes 18 dollars a day.", JANET_ANSWER, True),
        ("#### 18\nActually no.\n#### 19", JANET_ANSWER, False),
        ("#### 26", JANET_ANSWER, False),
        ("#### 1800", COMMA_ANSWER, True),
        ("#### 1,800", COMMA_ANSWER, True),
        ("#### $1,800.00", COMMA_ANSWER, True),
        ("#### 180", COMMA_ANSWER, False),
        ("#### 1,8000", COMMA_ANSWER, False),
        # bare numbers as the reference
        ("#### 72", "72", True),
        ("#### 72", " 72\n", True),
        ("#### 72.0", "72", True),
        ("#### 12.5", "12.50", True),
        ("#### 12.50", "12.5", True),
        ("#### 1000", "1,000", True),
        ("#### 1,000", "1000", True),
        ("#### 5%", "5", True),
        ("#### -3", "-3", True),
        ("#### 3", "-3", False),
        ("#### 0", "-0", True),
        ("A: 5600", "5,600", True),  # as labelled in OpenAI's example solutions
        ("#### 72", "$72", True),
        ("#### 7", "72", False),
        ("#### 720", "72", False),
        ("#### 72.5", "72", False),
        ("no answer given", "72", False),
        ("", "72", False),
        # \frac is an explicit non-numeric answer, not "2"
        ("\\boxed{\\frac{1}{2}}", "2", False),
        # non-numeric references compare as text with the final answer text
        ("#### yes", "#### yes", True),
        ("#### no", "#### yes", False),
        ("#### 1/2", "1/2", True),
        ("#### 1/2", "#### 1/3", False),
        ("", "", False),
    ],
)
def test_is_correct(completion, reference, expected):
    assert is_correct(completion, reference) is expected


# --- real data -----------------------------------------------------------------


def _gsm8k_rows(name: str) -> list[dict]:
    path = GSM8K_DIR / name
    if not path.is_file():
        pytest.skip(f"{path} not present (set SYNCRL_GSM8K_DIR to the GSM8K data directory)")
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def test_gsm8k_test_answers_extract_to_their_own_marker():
    rows = _gsm8k_rows("test.jsonl")
    assert rows
    for row in rows:
        answer = row["answer"]
        marker_value = answer.rsplit("####", 1)[1].strip()
        expected = normalize_number(marker_value)
        assert expected is not None, marker_value
        assert extract_answer(answer) == expected, answer
        assert is_correct(answer, answer)
        assert is_correct(answer, marker_value)


def test_agrees_with_every_label_of_openai_example_solutions():
    """Every labelled completion in OpenAI's example_model_solutions.jsonl
    (1,319 problems x 4 models = 5,276) is graded as its label says.

    The rows carry ``ground_truth`` ending in ``A: N`` and model solutions
    that end the same way (a few are truncated); the labels were evidently
    produced by a numeric comparison, since ten correct labels pair e.g.
    ``A: 5600`` with ``5,600``.
    """
    rows = _gsm8k_rows("example_model_solutions.jsonl")
    answers = {row["question"]: row["answer"] for row in _gsm8k_rows("test.jsonl")}
    checked = 0
    disagreements = []
    for row in rows:
        # Grade against the GSM8K answer field of the same problem, and check
        # that it names the same value as this file's "A: N" ground truth.
        reference = answers[row["question"]]
        ground_truth = row["ground_truth"].rsplit("A:", 1)[1]
        assert normalize_number(ground_truth) == extract_answer(reference)
        for key in MODEL_KEYS:
            labelled = row[key]
            checked += 1
            # The GSM8K answer field, the bare "A: N" value, and the worked ground truth itself.
            for ref in (reference, ground_truth, row["ground_truth"]):
                if is_correct(labelled["solution"], ref) is not labelled["is_correct"]:
                    disagreements.append((key, labelled["solution"][-120:], ref[-40:]))
    assert checked == len(MODEL_KEYS) * len(rows)
    assert not disagreements, f"{len(disagreements)} disagreements, e.g. {disagreements[:5]}"


@pytest.mark.parametrize("reference,completion,expected", [
    ("She has 3 + 15 = 18 apples.\nA: 18", "so 18", True),   # a worked solution without ####
    ("She has 3 + 15 = 18 apples.\nA: 18", "so 17", False),
    ("The total is \\boxed{1,200}.", "#### 1200", True),
    ("A: 18", "the answer is 18.", True),
    ("yes", "yes", True),                                  # a bare non-numeric answer: text
    ("#### yes", "no", False),
])
def test_is_correct_reads_every_reference_as_extract_answer_does(reference, completion, expected):
    assert is_correct(completion, reference) is expected
    if extract_answer(reference) is not None and "####" not in reference:
        assert is_correct(reference, reference)  # a worked solution is right about itself


# --- robustness -------------------------------------------------------------------

_N = 200_000
ADVERSARIAL = {
    "comma list": "1," * (_N // 2),
    "one huge grouped number": "1" + ",111" * (_N // 4),
    "grouped number ending badly": "1" + ",111" * (_N // 4) + "1",
    "markers": "####" * (_N // 4),
    "markers with spaces": "#### " * (_N // 5),
    "markers with long whitespace": ("####" + " " * 1000) * (_N // 1004),
    "markers with dollar and minus": "#### $ -" * (_N // 8),
    "unclosed boxed": "\\boxed{" * (_N // 7),
    "many closed boxed": "\\boxed{1}" * (_N // 9),
    "nested boxed": "\\boxed{" * (_N // 14) + "}" * (_N // 14),
    "bare boxed": "\\boxed $" * (_N // 8),
    "open braces then boxed": "{" * _N + "\\boxed{",
    "boxed with many numbers": "\\boxed{" + "1 " * (_N // 2) + "}",
    "digits with periods": "1." * (_N // 2),
    "periods between digits": "1" + "." * _N + "1",
    "lone fractions": ".1" * (_N // 2),
    "digits": "9" * _N,
    "zeros": "0" * _N + "." + "0" * _N,
    "minus signs": "-" * _N + "1",
    "minus digits": "-1" * (_N // 2),
    "dollars": "$" * _N,
    "whitespace": " " * _N + "x",
    "percent period": "5%." * (_N // 3),
}


@pytest.mark.parametrize("text", ADVERSARIAL.values(), ids=ADVERSARIAL.keys())
def test_adversarial_inputs_finish(text):
    # No timing assertion: quadratic behaviour on 200k characters would take
    # minutes per case and so shows up as a hung suite, not a flaky failure.
    extract_answer(text)
    normalize_number(text)
    is_correct(text, text)
    is_correct(text, "#### 5")
    is_correct("#### 5", text)


def test_adversarial_results_are_sensible():
    assert extract_answer(ADVERSARIAL["comma list"]) == "1"
    assert extract_answer(ADVERSARIAL["one huge grouped number"]) == "1" * (1 + 3 * (_N // 4))
    assert extract_answer(ADVERSARIAL["markers"]) is None
    assert extract_answer(ADVERSARIAL["unclosed boxed"]) is None
    assert extract_answer(ADVERSARIAL["many closed boxed"]) == "1"
    assert extract_answer(ADVERSARIAL["boxed with many numbers"]) is None
    assert extract_answer(ADVERSARIAL["zeros"]) == "0"
    assert extract_answer(ADVERSARIAL["digits"]) == "9" * _N
    assert is_correct(ADVERSARIAL["digits"], "9" * _N)
    assert not is_correct(ADVERSARIAL["digits"], "9" * (_N - 1))


# --- import hygiene -------------------------------------------------------------------

HEAVY_MODULES = ("torch", "numpy", "transformers", "deepspeed", "wandb", "safetensors", "tokenizers")


def test_import_does_not_pull_in_heavy_modules():
    code = (
        "import sys\n"
        "import stages.runtime.answer\n"
        f"heavy = [m for m in {HEAVY_MODULES!r} if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"importing stages.runtime.answer imported {result.stdout.strip()}"


def test_module_imports_only_the_standard_library():
    # Catches a heavy import in answer.py itself even where torch is not
    # installed, which the subprocess check above cannot.
    tree = ast.parse(Path(answer_module.__file__).read_text(encoding="utf-8"))
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").split(".")[0])
    assert imported <= set(sys.stdlib_module_names) | {"__future__"}, imported
