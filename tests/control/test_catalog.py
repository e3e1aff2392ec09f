"""The catalog: built-in models and accelerators, aliases, Hugging Face configs."""

import json

import pytest

from distserve.catalog import get_accelerator, get_model, known_models


@pytest.mark.parametrize(
    ("name", "billions"),
    [
        ("facebook/opt-13b", 12.9),
        ("opt-66b", 65.7),
        ("OPT-175B", 174.6),
        ("meta-llama/Llama-2-7b-hf", 6.74),
        ("llama-2-70b", 69.0),
        ("meta-llama/Meta-Llama-3-8B", 8.03),
        ("llama-3-70b", 70.6),
    ],
)
def test_builtin_models_have_their_published_sizes(name, billions):
    assert get_model(name).param_count / 1e9 == pytest.approx(billions, rel=0.01)


def test_smollm2_is_135m_with_grouped_query_attention():
    model = get_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert model.param_count == pytest.approx(134.5e6, rel=0.01)
    assert (model.num_heads, model.num_kv_heads, model.head_dim) == (9, 3, 64)


def test_kv_bytes_match_the_paper_for_opt_66b():
    # paper-settings.md: one 512-token request on OPT-66B holds about 1.13 GB of KV.
    kv_bytes = 512 * get_model("opt-66b").kv_bytes_per_token
    assert kv_bytes / 2**30 == pytest.approx(1.13, rel=0.01)


def test_grouped_query_attention_shrinks_kv_but_not_weights():
    llama2, llama3 = get_model("llama-2-70b"), get_model("llama-3-70b")
    assert llama2.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2
    assert llama3.weight_bytes > llama2.weight_bytes  # bigger vocabulary


def test_unknown_model_lists_known_names():
    with pytest.raises(ValueError, match="opt-66b") as err:
        get_model("gpt-5")
    assert "config.json" in str(err.value)


def test_hf_config_with_gqa_is_read(tmp_path):
    config = {
        "model_type": "mistral",
        "_name_or_path": "acme/tiny-gqa",
        "hidden_size": 1024,
        "num_hidden_layers": 8,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "intermediate_size": 2816,
        "vocab_size": 32000,
        "max_position_embeddings": 8192,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = get_model(tmp_path)  # a folder holding config.json
    assert model.name == "acme/tiny-gqa"
    assert (model.num_kv_heads, model.head_dim, model.gated_ffn) == (4, 64, True)
    assert model.kv_bytes_per_token == 2 * 8 * 4 * 64 * 2
    assert get_model(tmp_path / "config.json") == model


def test_opt_config_matches_builtin(tmp_path):
    config = {
        "model_type": "opt",
        "hidden_size": 5120,
        "num_hidden_layers": 40,
        "num_attention_heads": 40,
        "ffn_dim": 20480,
        "vocab_size": 50272,
        "max_position_embeddings": 2048,
        "_name_or_path": "facebook/opt-13b",
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert get_model(path) == get_model("opt-13b")


def test_config_missing_a_field_names_it(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(ValueError, match="num_attention_heads"):
        get_model(path)


def test_known_models_include_aliases():
    names = known_models()
    assert "facebook/opt-66b" in names and "opt-66b" in names


@pytest.mark.parametrize(("alias", "canonical"), [
    ("A100", "A100-80GB"), ("a100-80gb", "A100-80GB"), ("H100", "H100-80GB"),
    ("h200", "H200-141GB"), ("L40S", "L40S"), ("nvidia_l40s", "L40S"), ("cpu", "CPU"),
    (" a100 80gb ", "A100-80GB"),
])
def test_accelerator_aliases(alias, canonical):
    assert get_accelerator(alias) is get_accelerator(canonical)
    assert get_accelerator(alias).name == canonical


def test_accelerators_rank_as_expected():
    a100, h100, h200 = (get_accelerator(n) for n in ("A100-80GB", "H100-80GB", "H200-141GB"))
    assert h100.peak_flops > a100.peak_flops
    assert h200.mem_bandwidth_bytes_per_s > h100.mem_bandwidth_bytes_per_s
    assert h200.memory_bytes > h100.memory_bytes
    assert not get_accelerator("L40S").has_nvlink


def test_unknown_accelerator_lists_known_names():
    with pytest.raises(ValueError, match="H100-80GB"):
        get_accelerator("tpu-v5")
