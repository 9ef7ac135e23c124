from pathlib import Path

import pytest

from stages.runtime.config import ConfigError, config_diff, config_hash, load_config, to_dict

ROOT = Path(__file__).resolve().parents[1]


def write(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_defaults_and_file_and_overrides(tmp_path):
    p = write(tmp_path, "iterations: 3\ntrain:\n  lr: 1.0e-4\n")
    cfg = load_config(p, ["run_dir=/x/y", "iterations=2", "train.micro_batch_size=4", "generate.top_p=0.9",
                          "gather.drop_zero_variance=true", "train.lr=1e-5"])
    assert cfg.iterations == 2 and cfg.run_dir == "/x/y"
    assert cfg.train.micro_batch_size == 4 and cfg.train.lr == 1e-5
    assert cfg.generate.top_p == 0.9 and cfg.gather.drop_zero_variance is True
    assert cfg.model.preset == "tiny-llama"  # untouched default


def test_shipped_local_tiny_config_loads():
    cfg = load_config("configs/local_tiny.yaml", ["iterations=2"])
    assert cfg.ranks == 2 and cfg.iterations == 2


@pytest.mark.parametrize("text,override,needle", [
    ("iteratons: 2\n", (), "unknown key 'iteratons'"),
    ("train:\n  lrate: 1\n", (), "unknown key 'train.lrate'"),
    ("iterations: two\n", (), "'iterations' must be an integer"),
    ("iterations: 0\n", (), "iterations must be > 0"),
    ("generate:\n  top_p: 1.5\n", (), "generate.top_p must be in (0, 1]"),
    ("gather:\n  advantage: ppo\n", (), "gather.advantage must be one of grpo, rloo, none"),
    ("train: 3\n", (), "'train' is a section"),
    ("gather:\n  normalize_std: maybe\n", (), "must be true or false"),
    ("iterations: [1, 2\n", (), "YAML syntax error at line"),
    ("- a\n- b\n", (), "top level must be a mapping"),
    ("", ("iterations",), "has no '='"),
    ("", ("=3",), "empty key"),
    ("", ("train.nope=1",), "unknown key 'train.nope'"),
    ("", ("train.lr=fast",), "'train.lr' must be a number"),
    ("", ("train.lr=.inf",), "finite number"),
    ("", ("train.compile=max",), "train.compile must be one of eager, inductor, aot_eager"),
    ("", ("generate.cache=flash",), "generate.cache must be one of compact, static, dynamic"),
    ("", ("save.export_dtype=fp8",), "save.export_dtype must be one of model, float32, bfloat16, float16"),
    ("", ("iterations.x=1",), "'iterations' must be an integer"),
    ("iterations: 2\n", ("iterations.x=1",), "'iterations' is a value"),
])
def test_bad_input_is_one_clear_line(tmp_path, text, override, needle):
    p = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_config(p, override)
    msg = str(e.value)
    assert needle in msg
    assert "\n" not in msg


def test_unknown_key_lists_valid_keys(tmp_path):
    with pytest.raises(ConfigError, match="valid keys: .*micro_batch_size"):
        load_config(write(tmp_path, "train:\n  micro_batch: 2\n"))


def test_missing_file_is_named():
    with pytest.raises(ConfigError, match="nope.yaml not found"):
        load_config("nope.yaml")


def test_hash_ignores_how_not_what():
    a = load_config(None, ["run_dir=/a", "iterations=1"])
    b = load_config(None, ["run_dir=/b", "iterations=5", "retry.attempts=4"])
    c = load_config(None, ["train.lr=0.5"])
    assert config_hash(a) == config_hash(b)
    assert config_hash(a) != config_hash(c)
    assert config_diff(to_dict(a), to_dict(c)) == ["train.lr: 0.001 -> 0.5"]


def test_hash_leaves_out_values_at_their_default():
    # A run made before an option existed stays valid once the option appears at its default.
    plain = load_config(None, ["train.lr=0.5"])
    explicit = load_config(None, ["train.lr=0.5", "generate.gpus_per_process=1", "train.compile=eager"])
    changed = load_config(None, ["train.lr=0.5", "train.compile=aot_eager"])
    assert config_hash(plain) == config_hash(explicit) != config_hash(changed)
    import hashlib
    empty = hashlib.sha256(b"{}").hexdigest()[:16]
    assert config_hash(load_config(None, ["run_dir=/r", "iterations=9"])) == empty  # nothing at a default counts


def test_sampler_logprobs_need_the_compact_sampler():
    from stages.runtime.config import ConfigError, GenerateConfig, TuningConfig

    assert TuningConfig().logprobs_from_sampler(GenerateConfig())
    assert not TuningConfig().logprobs_from_sampler(GenerateConfig(cache="static"))
    assert not TuningConfig(logprobs="recompute").logprobs_from_sampler(GenerateConfig())
    with pytest.raises(ConfigError, match="tuning.logprobs=sampler needs generate.cache=compact"):
        load_config(None, ["generate.cache=dynamic", "tuning.logprobs=sampler"])
    with pytest.raises(ConfigError, match="tuning.logprobs must be one of"):
        TuningConfig(logprobs="vllm")


def test_a_key_that_moved_to_tuning_is_named_with_its_new_place(tmp_path):
    from stages.runtime.config import ConfigError

    with pytest.raises(ConfigError, match="'train.remove_padding' is now 'tuning.remove_padding'"):
        load_config(None, ["train.remove_padding=false"])
    old = tmp_path / "old.yaml"
    old.write_text("generate:\n  cuda_graphs: false\n")
    with pytest.raises(ConfigError, match=r"old.yaml: 'generate.cuda_graphs' is now 'tuning.decode_graphs'"):
        load_config(old)
    with pytest.raises(ConfigError, match="'start_early_wait_s' is now 'tuning.start_early_wait_s'"):
        load_config(None, ["start_early_wait_s=5"])
    # The waits change how a run is coordinated, not what it computes: a resume may change them.
    a, b = load_config(None, ["run_dir=/r"]), load_config(None, ["run_dir=/r", "tuning.exit_grace_s=5",
                                                                 "tuning.marker_wait_s=1"])
    assert config_hash(a) == config_hash(b) and config_diff(to_dict(a), to_dict(b)) == []
    assert config_hash(a) != config_hash(load_config(None, ["run_dir=/r", "tuning.remove_padding=false"]))


def test_the_multinode_zero3_config_gathers_each_decoder_layer_at_once():
    # configs/ds_zero3_multinode.json names the decoder layer classes as ZeRO-3 leaf modules: one
    # gathering hook pair per layer instead of one per submodule. A class renamed by transformers
    # would be skipped silently by DeepSpeed, so the built-in presets' layers are checked here.
    import json

    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.utils.z3_leaf_module import apply_zero_leaf_module_config
    from transformers import LlamaForCausalLM

    from stages.rl.tiny_model import llama_config
    from stages.runtime.presets import PRESETS

    zero = json.loads((ROOT / "configs" / "ds_zero3_multinode.json").read_text())["zero_optimization"]
    model = LlamaForCausalLM(llama_config(PRESETS["tiny-llama"]))
    leaves = apply_zero_leaf_module_config(model, DeepSpeedZeroConfig(**zero).leaf_module)
    assert leaves == list(model.model.layers)
