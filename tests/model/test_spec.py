"""ModelSpec from Hugging Face config dicts: architectures, rope, validation, KV sizing."""

import json

import pytest

from dualpath.errors import DualPathError, ModelSpecError
from dualpath.model.spec import ModelSpec, RopeSpec, load_spec, spec_from_config


def _smollm2_config(**overrides):
    cfg = {
        "model_type": "llama",
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 8192,
        "rope_theta": 100000.0,
        "tie_word_embeddings": True,
        "eos_token_id": 0,
        "torch_dtype": "bfloat16",
    }
    cfg.update(overrides)
    return cfg


def _qwen2_config(**overrides):
    cfg = {
        "model_type": "qwen2",
        "vocab_size": 151936,
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "sliding_window": 32768,
        "use_sliding_window": False,
        "tie_word_embeddings": True,
        "eos_token_id": 151645,
    }
    cfg.update(overrides)
    return cfg


def _mistral_config(**overrides):
    cfg = {
        "model_type": "mistral",
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 32768,
        "rope_theta": 10000.0,
        "sliding_window": 4096,
        "eos_token_id": 2,
    }
    cfg.update(overrides)
    return cfg


# --- architectures ---------------------------------------------------------------------------


def test_llama_config():
    spec = spec_from_config(_smollm2_config())
    assert isinstance(spec, ModelSpec)
    assert spec.model_type == "llama"
    assert spec.vocab_size == 49152
    assert spec.hidden_size == 576
    assert spec.intermediate_size == 1536
    assert spec.num_layers == 30
    assert spec.num_heads == 9
    assert spec.num_kv_heads == 3
    assert spec.head_dim == 64
    assert spec.rms_norm_eps == pytest.approx(1e-5)
    assert spec.max_position == 8192
    assert spec.tie_word_embeddings is True
    assert spec.eos_token_ids == (0,)
    assert spec.qkv_bias is False
    assert spec.o_bias is False
    assert spec.sliding_window is None


def test_llama_attention_bias_sets_both_biases():
    spec = spec_from_config(_smollm2_config(attention_bias=True))
    assert spec.qkv_bias is True
    assert spec.o_bias is True


def test_qwen2_has_qkv_bias_but_no_o_bias():
    spec = spec_from_config(_qwen2_config())
    assert spec.model_type == "qwen2"
    assert spec.qkv_bias is True
    assert spec.o_bias is False
    assert spec.head_dim == 64


def test_qwen2_o_bias_stays_off_even_with_attention_bias():
    spec = spec_from_config(_qwen2_config(attention_bias=True))
    assert spec.qkv_bias is True
    assert spec.o_bias is False


def test_qwen2_sliding_window_ignored_when_use_sliding_window_false():
    assert spec_from_config(_qwen2_config()).sliding_window is None


def test_qwen2_sliding_window_ignored_when_use_sliding_window_absent():
    cfg = _qwen2_config(sliding_window=4096)
    del cfg["use_sliding_window"]
    assert spec_from_config(cfg).sliding_window is None


def test_mistral_sliding_window_is_honored():
    spec = spec_from_config(_mistral_config())
    assert spec.model_type == "mistral"
    assert spec.sliding_window == 4096
    assert spec.head_dim == 128


def test_mistral_sliding_window_none_when_use_sliding_window_false():
    spec = spec_from_config(_mistral_config(use_sliding_window=False))
    assert spec.sliding_window is None


def test_mistral_null_sliding_window():
    assert spec_from_config(_mistral_config(sliding_window=None)).sliding_window is None


def test_missing_kv_heads_defaults_to_attention_heads():
    cfg = _smollm2_config()
    del cfg["num_key_value_heads"]
    assert spec_from_config(cfg).num_kv_heads == 9


def test_eos_token_id_list():
    spec = spec_from_config(_smollm2_config(eos_token_id=[1, 2]))
    assert spec.eos_token_ids == (1, 2)


def test_no_eos_token_id():
    cfg = _smollm2_config()
    del cfg["eos_token_id"]
    assert spec_from_config(cfg).eos_token_ids == ()


@pytest.mark.parametrize(("key", "value"), [("torch_dtype", "float16"), ("dtype", "float32")])
def test_dtype_from_either_key(key, value):
    cfg = _smollm2_config()
    del cfg["torch_dtype"]
    cfg[key] = value
    assert spec_from_config(cfg).torch_dtype == value


# --- head_dim --------------------------------------------------------------------------------


def test_head_dim_from_hidden_over_heads():
    cfg = _smollm2_config(hidden_size=1024, num_attention_heads=16, num_key_value_heads=4)
    assert spec_from_config(cfg).head_dim == 64


def test_head_dim_from_config_wins():
    cfg = _smollm2_config(hidden_size=1024, num_attention_heads=16, num_key_value_heads=4,
                          head_dim=128)
    assert spec_from_config(cfg).head_dim == 128


def test_null_head_dim_falls_back_to_hidden_over_heads():
    assert spec_from_config(_smollm2_config(head_dim=None)).head_dim == 64


# --- rope ------------------------------------------------------------------------------------


def test_rope_defaults_without_any_rope_field():
    cfg = _smollm2_config()
    del cfg["rope_theta"]
    assert spec_from_config(cfg).rope == RopeSpec()
    assert RopeSpec().theta == 10000.0
    assert RopeSpec().rope_type == "default"


def test_legacy_rope_theta():
    rope = spec_from_config(_smollm2_config(rope_theta=500000.0)).rope
    assert rope.theta == 500000.0
    assert rope.rope_type == "default"
    assert rope.factor == 1.0


def test_legacy_rope_scaling_linear_with_type_key():
    cfg = _smollm2_config(rope_scaling={"type": "linear", "factor": 2.0})
    rope = spec_from_config(cfg).rope
    assert rope.rope_type == "linear"
    assert rope.factor == 2.0
    assert rope.theta == 100000.0


def test_legacy_rope_scaling_llama3():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    rope = spec_from_config(_smollm2_config(rope_theta=500000.0, rope_scaling=scaling)).rope
    assert rope == RopeSpec(theta=500000.0, rope_type="llama3", factor=8.0,
                            low_freq_factor=1.0, high_freq_factor=4.0,
                            original_max_position=8192)


def test_rope_parameters_transformers5_style():
    cfg = _smollm2_config()
    del cfg["rope_theta"]
    cfg["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                              "low_freq_factor": 2.0, "high_freq_factor": 8.0,
                              "original_max_position_embeddings": 64}
    rope = spec_from_config(cfg).rope
    assert rope.theta == 500000.0
    assert rope.rope_type == "llama3"
    assert rope.factor == 32.0
    assert rope.low_freq_factor == 2.0
    assert rope.high_freq_factor == 8.0
    assert rope.original_max_position == 64


def test_rope_parameters_default_type():
    cfg = _smollm2_config(rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    rope = spec_from_config(cfg).rope
    assert rope.theta == 1e6
    assert rope.rope_type == "default"


def test_rope_parameters_take_precedence_over_legacy_fields():
    cfg = _smollm2_config(rope_theta=1.0, rope_scaling={"type": "linear", "factor": 2.0},
                          rope_parameters={"rope_type": "default", "rope_theta": 20000.0})
    rope = spec_from_config(cfg).rope
    assert rope.theta == 20000.0
    assert rope.rope_type == "default"


def test_null_rope_type_means_default():
    rope = spec_from_config(_smollm2_config(rope_parameters={"rope_type": None})).rope
    assert rope.rope_type == "default"


@pytest.mark.parametrize("field", ["rope_scaling", "rope_parameters"])
def test_unsupported_rope_type_yarn(field):
    cfg = _smollm2_config(**{field: {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ModelSpecError, match="'yarn'"):
        spec_from_config(cfg)


# --- errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", ["gpt2", "gemma", None])
def test_unsupported_model_type(model_type):
    cfg = _smollm2_config(model_type=model_type)
    with pytest.raises(ModelSpecError, match=rf"model_type {model_type!r} is not supported"):
        spec_from_config(cfg)


def test_missing_model_type():
    cfg = _smollm2_config()
    del cfg["model_type"]
    with pytest.raises(ModelSpecError, match="model_type"):
        spec_from_config(cfg)


@pytest.mark.parametrize(
    "field",
    ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
     "num_attention_heads"],
)
def test_missing_required_field_is_named(field):
    cfg = _smollm2_config()
    del cfg[field]
    with pytest.raises(ModelSpecError, match=f"lacks the field '{field}'"):
        spec_from_config(cfg)


def test_heads_not_divisible_by_kv_heads():
    cfg = _smollm2_config(num_key_value_heads=2)
    with pytest.raises(ModelSpecError, match="multiple of num_key_value_heads"):
        spec_from_config(cfg)


def test_more_kv_heads_than_heads_is_rejected():
    cfg = _smollm2_config(num_key_value_heads=18)
    with pytest.raises(ModelSpecError, match="num_key_value_heads"):
        spec_from_config(cfg)


def test_mlp_bias_true_is_rejected():
    with pytest.raises(ModelSpecError, match="mlp_bias"):
        spec_from_config(_smollm2_config(mlp_bias=True))


def test_mlp_bias_false_is_accepted():
    assert spec_from_config(_smollm2_config(mlp_bias=False)).model_type == "llama"


def test_model_spec_error_is_a_dualpath_error():
    with pytest.raises(DualPathError):
        spec_from_config({"model_type": "bert"})


# --- KV sizing ------------------------------------------------------------------


def test_kv_bytes_per_token_smollm2_bfloat16():
    spec = spec_from_config(_smollm2_config())
    assert spec.kv_bytes_per_token_per_layer("bfloat16") == 2 * 3 * 64 * 2
    assert spec.kv_bytes_per_token("bfloat16") == 23_040


@pytest.mark.parametrize(("dtype", "expected"),
                         [("float32", 46_080), ("float16", 23_040), ("bfloat16", 23_040)])
def test_kv_bytes_per_token_per_dtype(dtype, expected):
    assert spec_from_config(_smollm2_config()).kv_bytes_per_token(dtype) == expected


def test_load_spec_missing_folder(tmp_path):
    with pytest.raises(ModelSpecError, match="does not exist"):
        load_spec(tmp_path / "no-such-model")


def test_load_spec_folder_without_config(tmp_path):
    with pytest.raises(ModelSpecError, match=r"config\.json"):
        load_spec(tmp_path)


def test_load_spec_reads_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_mistral_config()))
    assert load_spec(tmp_path) == spec_from_config(_mistral_config())
    assert load_spec(str(tmp_path)).sliding_window == 4096
