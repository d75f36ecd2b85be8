"""Config parsing (both z-lab schemas), defaults, DFlash2 keys, checkpoint round trips."""
from __future__ import annotations

import json

import pytest
import torch

from dflash import DFlashConfig, DFlashDraftModel, build_target_layer_ids

OLD_SCHEMA = {  # GitHub-era Qwen3-8B-DFlash-b16 style: block_size and rope_theta at the top level
    "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 4096, "block_size": 16,
    "num_target_layers": 36, "vocab_size": 1000, "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
    "dflash_config": {"mask_token_id": 151669},
}
NEW_SCHEMA = {  # newer: dflash_config.block_size, rope_parameters, sliding layers
    "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 1, "intermediate_size": 96, "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e7}, "use_sliding_window": True,
    "sliding_window": 2048, "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
    "dflash_config": {"block_size": 8, "mask_token_id": 7, "target_layer_ids": [1, 6, 11, 16, 22, 27, 32, 37],
                      "input_embedding_scale": 2.0, "output_multiplier": 0.5, "final_logit_softcapping": 20.0},
}


def test_build_target_layer_ids():
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert build_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]
    assert build_target_layer_ids(36, 1) == [18]


def test_old_schema():
    cfg = DFlashConfig.from_dict(OLD_SCHEMA)
    assert cfg.block_size == 16 and cfg.mask_token_id == 151669
    assert cfg.rope_parameters == {"rope_type": "default", "rope_theta": 1e6}
    assert cfg.target_layer_ids == build_target_layer_ids(36, 2)
    assert cfg.layer_types == ["full_attention"] * 2
    assert not cfg.layer_is_causal(0) and cfg.layer_window(0) is None
    assert (cfg.input_embedding_scale, cfg.output_multiplier, cfg.final_logit_softcapping) == (1.0, 1.0, None)


def test_new_schema():
    cfg = DFlashConfig.from_dict(NEW_SCHEMA)
    assert cfg.block_size == 8 and cfg.mask_token_id == 7 and cfg.num_taps == 8
    assert cfg.head_dim == 16 and cfg.rope_parameters["rope_theta"] == 1e7
    assert [cfg.layer_is_causal(i) for i in range(3)] == [True, True, False]
    assert [cfg.layer_window(i) for i in range(3)] == [2048, 2048, None]
    assert (cfg.input_embedding_scale, cfg.output_multiplier, cfg.final_logit_softcapping) == (2.0, 0.5, 20.0)
    overridden = DFlashConfig.from_dict({**NEW_SCHEMA, "is_causal": False})
    assert not overridden.layer_is_causal(0)


def test_rope_scaling_legacy_key():
    raw = {**OLD_SCHEMA, "rope_scaling": {"type": "linear", "factor": 2.0}}
    assert DFlashConfig.from_dict(raw).rope_parameters == {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}


def test_rejects_dflash2_without_its_keys_and_missing_keys(tmp_path):
    with pytest.raises(ValueError, match=r"DFlash2DraftModel config needs dflash_config keys.*conv_kernel_size"):
        DFlashConfig.from_dict({**NEW_SCHEMA, "architectures": ["DFlash2DraftModel"]})
    with pytest.raises(ValueError, match="intermediate_size"):
        DFlashConfig.from_dict({k: v for k, v in NEW_SCHEMA.items() if k != "intermediate_size"})
    with pytest.raises(ValueError, match="num_target_layers"):
        DFlashConfig.from_dict({k: v for k, v in OLD_SCHEMA.items() if k != "num_target_layers"})
    with pytest.raises(ValueError, match="sliding_window"):
        DFlashConfig.from_dict({**NEW_SCHEMA, "sliding_window": None})
    with pytest.raises(FileNotFoundError, match="config.json"):
        DFlashConfig.from_json_file(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        DFlashConfig.from_json_file(tmp_path)


@pytest.mark.parametrize("raw", [OLD_SCHEMA, NEW_SCHEMA], ids=["old", "new"])
@pytest.mark.parametrize("shard", [None, 20_000])
def test_checkpoint_round_trip(tmp_path, raw, shard):
    draft = DFlashDraftModel(DFlashConfig.from_dict(raw)).to(torch.bfloat16)
    draft.save_pretrained(tmp_path, max_shard_size=shard)
    if shard:
        assert (tmp_path / "model.safetensors.index.json").exists()
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["dflash_config"]["block_size"] == saved["block_size"] == draft.config.block_size
    loaded = DFlashDraftModel.from_pretrained(tmp_path)
    assert loaded.config.to_dict() == draft.config.to_dict()
    a, b = draft.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


def test_state_dict_keys_are_zlab():
    draft = DFlashDraftModel(DFlashConfig.from_dict(OLD_SCHEMA))
    keys = set(draft.state_dict())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight"} <= keys
    per_layer = {"input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
                 "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                 "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate_proj.weight",
                 "mlp.up_proj.weight", "mlp.down_proj.weight"}
    assert keys == {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
        f"layers.{i}.{k}" for i in range(2) for k in per_layer}


def test_from_pretrained_errors(tmp_path):
    draft = DFlashDraftModel(DFlashConfig.from_dict(OLD_SCHEMA))
    draft.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        DFlashDraftModel.from_pretrained(tmp_path)
    from safetensors.torch import save_file

    state = draft.state_dict()
    state.pop("norm.weight")
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="norm.weight"):
        DFlashDraftModel.from_pretrained(tmp_path)
