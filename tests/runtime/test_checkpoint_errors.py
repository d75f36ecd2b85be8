"""A draft checkpoint that disagrees with its config.json raises ValueError naming the tensor, both
shapes and the config fields behind the expected one, before any weight is copied into a model."""
from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash import DFlashConfig, DFlashDraftModel

BASE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            intermediate_size=48, target_layer_ids=[1, 3], block_size=4, mask_token_id=5)


@pytest.mark.parametrize("overrides", [
    {},
    {"attention_bias": True},
    {"num_key_value_heads": 1, "head_dim": 16, "num_hidden_layers": 3, "target_layer_ids": [0, 2, 4]},
    {"num_key_value_heads": 4, "num_hidden_layers": 1, "target_layer_ids": [2]},
], ids=["gqa", "bias", "mqa-3taps", "mha-1layer"])
def test_expected_shapes_are_the_models(overrides):
    config = DFlashConfig(**{**BASE, **overrides})
    model = {k: tuple(v.shape) for k, v in DFlashDraftModel(config).state_dict().items()}
    assert {k: shape for k, (shape, _) in config.expected_weight_shapes().items()} == model


@pytest.fixture
def checkpoint(tmp_path):
    DFlashDraftModel(DFlashConfig(**BASE)).save_pretrained(tmp_path)
    return tmp_path


def edit_config(folder, **changes):
    path = folder / "config.json"
    raw = json.loads(path.read_text())
    for key, value in changes.items():
        if key in raw.get("dflash_config", {}):
            raw["dflash_config"][key] = value
        else:
            raw[key] = value
    path.write_text(json.dumps(raw))


def edit_weights(folder, drop=(), add=None):
    state = load_file(str(folder / "model.safetensors"))
    for name in drop:
        state.pop(name)
    state.update(add or {})
    save_file(state, str(folder / "model.safetensors"))


@pytest.fixture
def no_copy(monkeypatch):
    """Fails the test if a mismatching checkpoint reaches load_state_dict."""
    def refuse(*args, **kwargs):
        raise AssertionError("weights were copied before the checkpoint was checked")
    monkeypatch.setattr(torch.nn.Module, "load_state_dict", refuse)


def load_error(folder) -> str:
    with pytest.raises(ValueError) as info:
        DFlashDraftModel.from_pretrained(folder)
    return str(info.value)


def test_kv_heads_mismatch_names_tensor_shapes_and_fields(checkpoint, no_copy):
    edit_config(checkpoint, num_key_value_heads=4)
    msg = load_error(checkpoint)
    assert str(checkpoint) in msg and "4 tensor shape(s) disagree" in msg  # k_proj and v_proj of 2 layers
    for layer in (0, 1):
        for proj in ("k_proj", "v_proj"):
            assert (f"layers.{layer}.self_attn.{proj}.weight: checkpoint [16, 32], config implies [32, 32] "
                    f"(num_key_value_heads=4 × head_dim=8, hidden_size=32)") in msg
    assert "q_proj" not in msg


def test_count_and_head_dim_mismatch(checkpoint, no_copy):
    edit_config(checkpoint, head_dim=16)
    msg = load_error(checkpoint)
    assert re.search(r"^\S+: 12 tensor shape\(s\) disagree", msg), msg  # q, k, v, o, q_norm, k_norm × 2 layers
    assert ("layers.0.self_attn.q_norm.weight: checkpoint [8], config implies [16] (head_dim=16)") in msg
    assert ("layers.0.self_attn.o_proj.weight: checkpoint [32, 32], config implies [32, 64] "
            "(hidden_size=32, num_attention_heads=4 × head_dim=16)") in msg
    assert "+4 more" in msg


def test_tap_count_mismatch_names_fc(checkpoint, no_copy):
    edit_config(checkpoint, target_layer_ids=[0, 1, 2])
    msg = load_error(checkpoint)
    assert ("fc.weight: checkpoint [32, 64], config implies [32, 96] "
            "(hidden_size=32, len(target_layer_ids)=3 × hidden_size=32)") in msg
    assert msg.count("checkpoint [") == 1


def test_missing_and_unexpected_tensors(checkpoint, no_copy):
    edit_weights(checkpoint, drop=["layers.1.mlp.up_proj.weight"], add={"lm_head.weight": torch.zeros(3, 32)})
    msg = load_error(checkpoint)
    assert "missing tensors ['layers.1.mlp.up_proj.weight']" in msg
    assert "unexpected tensors ['lm_head.weight']" in msg


def test_fewer_layers_in_config(checkpoint, no_copy):
    edit_config(checkpoint, num_hidden_layers=1, layer_types=["full_attention"])
    msg = load_error(checkpoint)
    assert "unexpected tensors ['layers.1." in msg and "(+3 more)" in msg and "num_hidden_layers=1" in msg
    assert "missing" not in msg


def test_bias_in_config_not_in_checkpoint(checkpoint, no_copy):
    edit_config(checkpoint, attention_bias=True)
    msg = load_error(checkpoint)
    assert "missing tensors ['layers.0.self_attn.q_proj.bias'" in msg and "attention_bias=true" in msg


def test_matching_checkpoint_still_loads(checkpoint):
    draft = DFlashDraftModel.from_pretrained(checkpoint)
    assert draft.config.num_key_value_heads == 2


@pytest.fixture
def sharded(tmp_path):
    """A sharded draft in tmp_path/draft, and a valid copy of its first shard outside the folder."""
    folder = tmp_path / "draft"
    DFlashDraftModel(DFlashConfig(**BASE)).save_pretrained(folder, max_shard_size=20_000)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    (tmp_path / "outside.safetensors").write_bytes((folder / first).read_bytes())
    return folder, index, first


def point_index(folder, index, first, name):
    weight_map = {k: (name if v == first else v) for k, v in index["weight_map"].items()}
    (folder / "model.safetensors.index.json").write_text(json.dumps({**index, "weight_map": weight_map}))


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink"])
def test_index_may_not_point_outside_the_folder(sharded, how):
    folder, index, first = sharded
    outside = folder.parent / "outside.safetensors"
    if how == "dotdot":
        point_index(folder, index, first, "../outside.safetensors")
    elif how == "absolute":
        point_index(folder, index, first, str(outside))
    else:
        (folder / first).unlink()
        (folder / first).symlink_to(outside)
    with pytest.raises(ValueError, match="outside the draft folder|not a file name inside the draft folder"):
        DFlashDraftModel.from_pretrained(folder)


def test_index_links_inside_the_folder_and_hf_snapshots_load(sharded, tmp_path):
    folder, index, first = sharded
    want = DFlashDraftModel.from_pretrained(folder).state_dict()
    (folder / "sub").mkdir()
    (folder / first).rename(folder / "sub" / first)
    (folder / first).symlink_to(folder / "sub" / first)  # a link inside the folder
    got = DFlashDraftModel.from_pretrained(folder).state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    # a Hugging Face cache snapshot: snapshots/<rev>/<file> -> ../../blobs/<hash>
    repo = tmp_path / "models--x--draft"
    snap, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for i, f in enumerate(sorted(p for p in folder.iterdir() if p.is_file())):
        (blobs / f"blob{i}").write_bytes(f.read_bytes())
        (snap / f.name).symlink_to(f"../../blobs/blob{i}")
    got = DFlashDraftModel.from_pretrained(snap).state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
