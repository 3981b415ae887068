"""Config parsing of released formats, and the default target layer ids."""

import json

import pytest

from dflash_trt.config import build_target_layer_ids, check_pair, load_drafter_config, load_target_config
from dflash_trt.errors import ConfigError

# SpecForge configs/qwen3-8b-dflash.json and configs/qwen3.6-27b-dflash.json (reference/dflash-peers.md §1), abridged to the keys we read.
QWEN3_8B_DFLASH = {
    "architectures": ["DFlashDraftModel"], "auto_map": {"AutoModel": "dflash.DFlashDraftModel"}, "model_type": "qwen3",
    "block_size": 16, "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]}, "num_target_layers": 36,
    "num_hidden_layers": 5, "hidden_size": 4096, "intermediate_size": 12288, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "rope_theta": 1000000, "max_position_embeddings": 40960, "vocab_size": 151936, "tie_word_embeddings": False,
    "layer_types": ["full_attention"] * 5, "use_sliding_window": False, "sliding_window": None, "rms_norm_eps": 1e-6, "hidden_act": "silu",
}
QWEN36_27B_DFLASH = {
    **QWEN3_8B_DFLASH, "block_size": None, "hidden_size": 5120, "rope_theta": 10000000, "max_position_embeddings": 262144,
    "dflash_config": {"mask_token_id": 248070, "target_layer_ids": [1, 16, 31, 46, 61], "block_size": 16}, "num_target_layers": 64,
    "layer_types": ["sliding_attention"] * 4 + ["full_attention"], "use_sliding_window": True, "sliding_window": 2048,
}


def _write(tmp_path, raw):
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return tmp_path


@pytest.mark.parametrize("raw", [QWEN3_8B_DFLASH, QWEN36_27B_DFLASH], ids=["qwen3-8b", "qwen3.6-27b-swa"])
def test_released_drafter_configs_parse_with_their_fields(tmp_path, raw):
    cfg = load_drafter_config(_write(tmp_path, raw))
    assert cfg.block_size == 16
    assert cfg.mask_token_id == raw["dflash_config"]["mask_token_id"]
    assert list(cfg.target_layer_ids) == raw["dflash_config"]["target_layer_ids"]
    assert cfg.head_dim == 128 and cfg.num_kv_heads == 8
    sliding = [cfg.layer_window(i) for i in range(5)]
    if raw["use_sliding_window"]:
        assert sliding == [2048] * 4 + [None]
        assert [cfg.layer_is_causal(i) for i in range(5)] == [True] * 4 + [False]
    else:
        assert sliding == [None] * 5 and not any(cfg.layer_is_causal(i) for i in range(5))


def test_default_target_layer_ids_follow_the_reference_formula():
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert build_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]
    assert build_target_layer_ids(30, 1) == [15]


def test_absent_layer_ids_are_derived_from_num_target_layers(tmp_path):
    raw = {**QWEN3_8B_DFLASH, "dflash_config": {"mask_token_id": 7}}
    assert list(load_drafter_config(_write(tmp_path, raw)).target_layer_ids) == [1, 9, 17, 25, 33]


def test_llama3_target_config_with_gqa_and_tied_embeddings(tmp_path):
    raw = {
        "architectures": ["LlamaForCausalLM"], "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152, "tie_word_embeddings": True,
        "rope_theta": 500000.0, "eos_token_id": [2, 5],
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    }
    cfg = load_target_config(_write(tmp_path, raw))
    assert (cfg.head_dim, cfg.num_kv_heads, cfg.tie_word_embeddings, cfg.eos_token_ids) == (64, 3, True, (2, 5))
    assert cfg.rope.type == "llama3" and cfg.rope.factor == 8.0 and not cfg.qk_norm


def test_pairing_checks_name_the_drafter_file_and_key(tmp_path):
    target_raw = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                  "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936}
    (tmp_path / "t").mkdir(), (tmp_path / "d").mkdir()
    target = load_target_config(_write(tmp_path / "t", target_raw))
    assert target.qk_norm
    drafter = load_drafter_config(_write(tmp_path / "d", QWEN3_8B_DFLASH))
    assert check_pair(target, drafter).target_layer_ids == (1, 9, 17, 25, 33)
    bad = load_drafter_config(_write(tmp_path / "d", {**QWEN3_8B_DFLASH, "num_target_layers": 32}))
    with pytest.raises(ConfigError, match=r"d/config.json: num_target_layers: drafter was built for 32"):
        check_pair(target, bad)
