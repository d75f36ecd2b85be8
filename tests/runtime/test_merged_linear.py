"""merged_weight: one buffer per layer for q/k/v (gate/up), the modules' parameters re-pointed at its rows."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from dflash.merged_linear import merged_weight
from helpers.tiny_models import make_target


def _merge_layers(model):
    for layer in model.model.layers:
        a = layer.self_attn
        merged_weight([a.q_proj, a.k_proj, a.v_proj], a, "_dflash_qkv")
        merged_weight([layer.mlp.gate_proj, layer.mlp.up_proj], layer.mlp, "_dflash_gate_up")


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_model_unchanged_and_views_shared(arch, tmp_path):
    model = make_target(arch)
    ids = torch.randint(0, 48, (2, 9))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ref = model(ids).logits
    _merge_layers(model)
    assert torch.equal(model(ids).logits, ref)
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    a = model.model.layers[1].self_attn
    w, b = merged_weight([a.q_proj, a.k_proj, a.v_proj], a, "_dflash_qkv")
    assert b is None
    assert w.shape == (a.q_proj.out_features + a.k_proj.out_features + a.v_proj.out_features, a.q_proj.in_features)
    # The parameters ARE the merged rows: writing one shows in the other.
    with torch.no_grad():
        a.k_proj.weight[0, 0] = 123.0
    assert w[a.q_proj.out_features, 0] == 123.0
    # Saving and loading still round-trip.
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path)
    assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_idempotent_and_remerged_after_replacement():
    model = make_target("qwen3", layers=1)
    a = model.model.layers[0].self_attn
    first = merged_weight([a.q_proj, a.k_proj, a.v_proj], a, "_dflash_qkv")
    again = merged_weight([a.q_proj, a.k_proj, a.v_proj], a, "_dflash_qkv")
    assert again[0] is first[0]
    # load_state_dict copies in place: the buffer stays valid and sees the new values.
    sd = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    model.load_state_dict(sd)
    assert merged_weight([a.q_proj, a.k_proj, a.v_proj], a, "_dflash_qkv")[0] is first[0]
    assert torch.equal(first[0][: a.q_proj.out_features], sd["model.layers.0.self_attn.q_proj.weight"])
    # A replaced parameter is no longer a view: merge again, with its values.
    new = torch.randn_like(a.v_proj.weight)
    a.v_proj.weight = nn.Parameter(new.clone())
    w, _ = merged_weight([a.q_proj, a.k_proj, a.v_proj], a, "_dflash_qkv")
    assert w is not first[0]
    assert torch.equal(w[-a.v_proj.out_features:], new)


def test_bias_merged_and_bad_input():
    owner = nn.Module()
    lins = [nn.Linear(8, 3), nn.Linear(8, 5)]
    x = torch.randn(4, 8)
    ref = torch.cat([lin(x) for lin in lins], -1)
    w, b = merged_weight(lins, owner, "_m")
    assert torch.allclose(torch.nn.functional.linear(x, w, b), ref, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="dtype, device and input size"):
        merged_weight([nn.Linear(8, 3), nn.Linear(7, 3)], owner, "_n")
    with pytest.raises(ValueError, match="some projections have a bias"):
        merged_weight([nn.Linear(8, 3), nn.Linear(8, 3, bias=False)], owner, "_o")


def test_row_blocks_are_the_parameters_in_place():
    """row_blocks: the projections' own tensors (no copy, nothing re-pointed), the same checks as merged_weight."""
    from dflash.merged_linear import row_blocks

    lins = [nn.Linear(8, 3), nn.Linear(8, 5)]
    blocks, bias = row_blocks(lins, "_m")
    assert bias is None and blocks.out_features == 8
    assert [w.data_ptr() for w in blocks.weights] == [lin.weight.data_ptr() for lin in lins]
    assert [b.data_ptr() for b in blocks.biases] == [lin.bias.data_ptr() for lin in lins]
    assert all(isinstance(lin.weight, nn.Parameter) and not hasattr(lin, "_m") for lin in lins)
    assert row_blocks([nn.Linear(8, 3, bias=False)], "_n")[0].biases is None
    with pytest.raises(ValueError, match="dtype, device and input size"):
        row_blocks([nn.Linear(8, 3), nn.Linear(7, 3)], "_n")
    with pytest.raises(ValueError, match="some projections have a bias"):
        row_blocks([nn.Linear(8, 3), nn.Linear(8, 3, bias=False)], "_o")


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_lean_target_copies_weights_off_the_cpu_backend_only(backend):
    """The lean target's "cpu" backend reads q/k/v and gate/up where they are; the others merge them once."""
    from dflash.lean_target import LeanTarget

    model = make_target("llama", layers=2)
    a = model.model.layers[0].self_attn
    q_ptr = a.q_proj.weight.data_ptr()
    lean = LeanTarget(model, [0], batch=1, capacity=16, backend=backend)
    if backend == "cpu":
        assert a.q_proj.weight.data_ptr() == q_ptr and "_dflash_qkv" not in a.__dict__
        assert lean.qkv[0][0].weights[0].data_ptr() == q_ptr and len(lean.gate_up[0][0].weights) == 2
    else:
        assert lean.qkv[0][0].data_ptr() == a.q_proj.weight.data_ptr() != q_ptr
