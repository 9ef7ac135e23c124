"""`syncrl check`: every malformed config or override gives one line naming the key or file and the fix."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from jobs.check import check_files, precision_problems
from stages.runtime.config import dump_config, load_config
from stages.runtime.paths import STAGES

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "local_tiny.yaml")


@pytest.fixture
def files(tmp_path):
    (tmp_path / "run_file").write_text("not a dir")
    (tmp_path / "empty_model").mkdir()
    (tmp_path / "empty_model" / "tokenizer.json").write_text("{}")  # only config.json is missing
    (tmp_path / "bad.json").write_text('{"zero_optimization": {"stage": 2},\n "bf16": }')
    (tmp_path / "unknown_key.json").write_text(json.dumps({"zero_optimization": {"stage": 2}, "zero_optimisation": 1}))
    (tmp_path / "bad_nested.json").write_text(json.dumps({"zero_optimization": {"stage": 2, "overlap_com": True}}))
    (tmp_path / "stage0.json").write_text(json.dumps({"zero_optimization": {"stage": 0}}))
    (tmp_path / "rows.jsonl").write_text('{"question": "q", "answer": "no number"}\n')
    (tmp_path / "few.jsonl").write_text('{"question": "q", "answer": "#### 1"}\n')
    (tmp_path / "syntax.yaml").write_text("iterations: [1,\n")
    return tmp_path


CASES = [
    # (overrides, config file or None for local_tiny, expected fragments of the single line)
    (["iteratons=2"], None, ["unknown key 'iteratons'", "valid keys:"]),
    (["train.lrate=1"], None, ["unknown key 'train.lrate'", "valid keys:", "lr"]),
    (["iterations=two"], None, ["'iterations' must be an integer"]),
    (["generate.top_p=1.5"], None, ["generate.top_p must be in (0, 1]"]),
    (["train.lr=-1"], None, ["train.lr must be > 0"]),
    (["gather.advantage=ppo"], None, ["gather.advantage must be one of grpo, rloo, none"]),
    (["iterations"], None, ["override 'iterations' has no '='", "key=value"]),
    ([], "missing.yaml", ["missing.yaml not found"]),
    ([], "{d}/syntax.yaml", ["syntax.yaml: YAML syntax error at line"]),
    (["run_dir={d}/run_file"], None, ["run_file is a file", "choose another run_dir"]),
    (["model.path={d}/nope"], None, ["model.path", "nope not found", "Hugging Face model directory"]),
    (["model.path={d}/empty_model"], None, ["model.path", "has no config.json"]),
    (["train.deepspeed_config={d}/none.json"], None, ["train.deepspeed_config", "none.json not found"]),
    (["train.deepspeed_config={d}/bad.json"], None, ["bad.json: not valid JSON at line 2"]),
    (["train.deepspeed_config={d}/unknown_key.json"], None, ["key 'zero_optimisation' is not a DeepSpeed setting"]),
    (["train.deepspeed_config={d}/bad_nested.json"], None, ["DeepSpeed rejects this config", "overlap_com"]),
    (["train.deepspeed_config={d}/stage0.json"], None, ["zero_optimization.stage is 0", "use stage 1, 2 or 3"]),
    (["data.source={d}/missing.jsonl"], None, ["data.source", "missing.jsonl not found"]),
    (["data.source={d}/rows.jsonl"], None,
     ["rows.jsonl:1: 'answer' must be a worked solution ending with '#### <answer>'"]),
    (["data.source={d}/few.jsonl"], None, ["has 1 problems, fewer than data.prompts_per_iteration"]),
    (["ranks=3"], None, ["data.prompts_per_iteration (64) is not divisible by the 3 ranks", "use 63 or 66"]),
    (["generate.batch_size=12"], None, ["generate.batch_size (12) is not a multiple of generate.attempts (8)"]),
    # vLLM is not installed on the machines that run these tests (tests/standins/vllm says why).
    (["generate.backend=vllm"], None, ["generate.backend is vllm, but vllm is not installed", "generate.backend=hf"]),
    (["generate.vllm_memory_fraction=1.5"], None, ["generate.vllm_memory_fraction must be in (0, 1)"]),
    (["generate.persistent=true"], None, ["generate.persistent needs generate.backend=vllm (got hf)"]),
    (["generate.backend=vllm", "generate.persistent=true", "generate.engine_timeout_s=0"], None,
     ["generate.engine_timeout_s must be > 0"]),
]


@pytest.mark.parametrize("overrides,config,needles", CASES)
def test_each_problem_is_one_clear_line(files, overrides, config, needles):
    overrides = [o.format(d=files) for o in overrides]
    config = config.format(d=files) if config else TINY
    problems, _ = check_files(config, [*overrides, f"run_dir={files}/run"] if not any(
        o.startswith("run_dir=") for o in overrides) else overrides, launcher="local")
    assert len(problems) == 1, problems
    for needle in needles:
        assert needle in problems[0], problems[0]
    assert "\n" not in problems[0]


def test_changed_config_on_resume_is_refused_with_the_diff(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    from jobs.check import resolve_paths
    cfg = load_config(TINY, [f"run_dir={run}"])
    resolve_paths(cfg)
    (run / "config.yaml").write_text(dump_config(cfg))
    assert check_files(TINY, [f"run_dir={run}", "iterations=30"], "local")[0] == []  # how, not what: fine
    problems, _ = check_files(TINY, [f"run_dir={run}", "train.lr=0.5"], "local")
    assert len(problems) == 1 and "different config (train.lr: 0.003 -> 0.5)" in problems[0]


def test_shipped_configs_pass(tmp_path):
    for ds in sorted((ROOT / "configs").glob("ds_*.json")):
        # Each with the model dtype its mixed precision trains in (float32 where it has none).
        dtype = "bfloat16" if json.loads(ds.read_text()).get("bf16", {}).get("enabled") else "float32"
        assert check_files(TINY, [f"run_dir={tmp_path}/r", f"train.deepspeed_config={ds}", f"model.dtype={dtype}"],
                           "local")[0] == [], ds
    for config in ("rl_2node.yaml", "gpu_small.yaml", "rl_70b_2node.yaml"):  # the model.dtype each ships with
        cfg = load_config(str(ROOT / "configs" / config), [f"run_dir={tmp_path}/r"])
        assert precision_problems(json.loads((ROOT / cfg.train.deepspeed_config).read_text()), cfg, Path()) == []


@pytest.mark.parametrize("ds,dtype,says", [
    ({"bf16": {"enabled": True}}, "float32", "bf16.enabled is true, so DeepSpeed trains the model in bfloat16, "
                                             "but model.dtype is float32: set model.dtype: bfloat16"),
    ({"fp16": {"enabled": True}}, "bfloat16", "set model.dtype: float16, or turn fp16 off"),
    ({"bf16": {"enabled": False}}, "float32", None),
    ({"bf16": {"enabled": True}}, "bfloat16", None),
])
def test_the_model_dtype_is_the_one_deepspeed_trains_in(tmp_path, ds, dtype, says):
    # A mismatch used to surface only in save's layout check, after generate and train had run.
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}, **ds}))
    problems, _ = check_files(TINY, [f"run_dir={tmp_path}/r", f"train.deepspeed_config={path}", f"model.dtype={dtype}"],
                           "local")
    if says is None:
        assert problems == []
    else:
        assert len(problems) == 1 and says in problems[0] and str(path) in problems[0], problems


def test_cli_exit_status_and_no_traceback(tmp_path):
    bad = subprocess.run([sys.executable, "-m", "jobs.cli", "check", TINY, "ranks=3", "generate.batch_size=12",
                          f"run_dir={tmp_path}/r"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 2 and all(line.startswith("syncrl check: ") for line in lines), bad.stderr
    assert "Traceback" not in bad.stderr
    run = subprocess.run([sys.executable, "-m", "jobs.cli", "run", TINY, "iteratons=2", f"run_dir={tmp_path}/r"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "unknown key 'iteratons'" in run.stderr and "Traceback" not in run.stderr
    assert not (tmp_path / "r").exists()  # nothing was started


@pytest.mark.parametrize("name,text,needles", [
    ("dup.yaml", "train:\n  lr: 0.1\n  epochs: 3\niterations: 2\ntrain:\n  micro_batch_size: 8\n",
     ["key 'train' appears twice", "lines 1 and 5"]),
    ("latin1.yaml", "iterations: 2\n# caf\xe9\n", ["not UTF-8", "byte 0xe9 at offset 19", "line 2"]),
    ("field.yaml", "data:\n  prompt_template: '{question} {x}'\n", ["data.prompt_template", "other than {question}"]),
    ("brace.yaml", "data:\n  prompt_template: '{question} {'\n", ["data.prompt_template", "literal brace"]),
    ("huge.yaml", "iterations: 100000000000000000000000\n", ["iterations must be at most 1,000,000"]),
])
def test_config_files_that_yaml_or_python_would_accept_wrongly(tmp_path, name, text, needles):
    path = tmp_path / name
    path.write_bytes(text.encode("latin-1"))
    proc = subprocess.run([sys.executable, "-m", "jobs.cli", "check", str(path), f"run_dir={tmp_path}/r"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    for needle in needles:
        assert needle in proc.stderr, proc.stderr


def test_prompts_file_that_is_not_utf8_or_empty(tmp_path):
    bad, empty = tmp_path / "bad.jsonl", tmp_path / "empty.jsonl"
    bad.write_bytes(b'{"question": "q", "answer": "#### 1"}\n{"question": "\xff", "answer": "#### 2"}\n')
    empty.write_text("\n")
    for path, needle in ((bad, f"{bad}: not UTF-8 text: byte 0xff at offset 52 (line 2)"),
                         (empty, f"data.source {empty} is empty")):
        proc = subprocess.run([sys.executable, "-m", "jobs.cli", "check", TINY, f"data.source={path}",
                               f"run_dir={tmp_path}/r"], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and needle in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_status_of_a_long_run_lists_what_started_and_the_rest_in_one_row(tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    cfg = load_config(TINY, [f"run_dir={run}", "iterations=1000000"])
    (run / "config.yaml").write_text(dump_config(cfg))
    proc = subprocess.run([sys.executable, "-m", "jobs.cli", "status", str(run)], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "1-999999  all" in proc.stdout and "0/6000000 stages done" in proc.stdout
    assert len(proc.stdout.splitlines()) == 2 + len(STAGES) + 1 + 1


@pytest.mark.parametrize("backend,heads,kv_heads,tp,refused", [
    ("vllm", 6, 3, 4, "the model's 6 attention heads (num_attention_heads) over 4 GPUs with vLLM's"),
    ("vllm", 8, 2, 4, None),  # fewer K/V heads than GPUs, dividing them: each copied to 2 GPUs
    ("vllm", 8, 4, 8, None),
    ("vllm", 12, 6, 4, "the model's 6 K/V heads (num_key_value_heads) can be neither split over nor copied evenly"),
    ("vllm", 8, None, 8, None),  # no num_key_value_heads: as many as query heads
    # The compact sampler on transformers' plan: each GPU holds its own K/V heads, none copied.
    ("hf", 6, 3, 4, "the model's 6 attention heads (num_attention_heads) over 4 GPUs with transformers'"),
    ("hf", 8, 2, 4, "the model's 2 K/V heads (num_key_value_heads) do not split evenly over 4 GPUs"),
    ("hf", 8, 4, 4, None),
], ids=["query-heads", "kv-copied", "kv-split", "kv-neither", "mha", "hf-query-heads", "hf-kv-fewer", "hf-kv-split"])
def test_tensor_parallel_generation_needs_heads_that_divide_over_the_gpus(tmp_path, backend, heads, kv_heads, tp,
                                                                          refused):
    from jobs.check import check

    model = tmp_path / "model"
    model.mkdir()
    config = {"model_type": "llama", "num_attention_heads": heads, **({"num_key_value_heads": kv_heads} if kv_heads else {})}
    (model / "config.json").write_text(json.dumps(config))
    cfg = load_config(TINY, [f"run_dir={tmp_path}/run", f"model.path={model}", f"generate.backend={backend}",
                             f"generate.gpus_per_process={tp}", f"ranks={tp}", "data.prompts_per_iteration=64"])
    # vLLM is not installed here: check says so too; the layout's line is the one under test.
    problems = [p for p in check(cfg, "local") if "gpus_per_process" in p]
    if refused is None:
        assert problems == []
    else:
        assert len(problems) == 1 and refused in problems[0], problems
        assert "set generate.gpus_per_process to a divisor of" in problems[0]


def test_tensor_parallel_generation_reads_a_presets_heads_and_stays_in_a_node(tmp_path):
    from jobs.check import check

    def layout(*overrides, launcher="local"):
        cfg = load_config(TINY, [f"run_dir={tmp_path}/run", "generate.backend=vllm", "data.prompts_per_iteration=96",
                                 *overrides])
        return [p for p in check(cfg, launcher, env={}) if "gpus_per_process" in p]

    assert layout("model.preset=llama3-8b-shape", "generate.gpus_per_process=8", "ranks=8") == []
    assert "the model's 32 attention heads" in layout("model.preset=llama3-8b-shape", "generate.gpus_per_process=3",
                                              "ranks=3")[0]
    # More GPUs per engine than a node has (the local launcher's ranks; SLURM's tasks per node): the
    # fix is fewer GPUs per engine or bigger nodes, not more ranks.
    for overrides, launcher, name in ((["ranks=4"], "local", "ranks"),
                                      (["slurm.tasks_per_node=4"], "srun", "slurm.tasks_per_node")):
        problems = layout("model.preset=llama3-8b-shape", "generate.gpus_per_process=8", *overrides, launcher=launcher)
        assert len(problems) == 1, problems
        assert problems[0].startswith(f"generate.gpus_per_process (8) exceeds {name} (4), the GPUs of one node")
        assert "set generate.gpus_per_process to a divisor of 4" in problems[0]
    # Within a node but not dividing it: the group check's line.
    problems = layout("model.preset=llama3-8b-shape", "generate.gpus_per_process=4", "slurm.tasks_per_node=6",
                      launcher="srun")
    assert len(problems) == 1 and "slurm.tasks_per_node (6) is not a multiple of generate.gpus_per_process (4)" in \
        problems[0], problems
