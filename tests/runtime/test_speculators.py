"""speculators (vllm-project/speculators) DFlash checkpoints load through DFlashDraftModel.from_pretrained
and run exactly like the same weights in z-lab form. The checkpoints are written here the way
speculators saves them (schema in dflash/speculators.py): a config with ``speculators_model_type``,
``transformer_layer_config`` as a diff against Qwen3Config's defaults, ``aux_hidden_state_layer_ids`` =
z-lab ids + 1, and weights with frozen target copies plus ``d2t`` offsets / ``t2d`` mask."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import Qwen3Config

from dflash import DFlashDraftModel, generate

from helpers.tiny_models import make_draft, make_target


def write_speculators(folder, draft: DFlashDraftModel, target, token_ids=None, *, sample_from_anchor=False,
                      sliding_window_non_causal=False, config_edits=None, weight_edits=None):
    """Save ``draft`` (z-lab form, full vocabulary) as a speculators DFlash checkpoint over ``token_ids``."""
    cfg = draft.config
    vocab = target.config.vocab_size
    layer_cfg = Qwen3Config(
        vocab_size=vocab, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings, rope_parameters=dict(cfg.rope_parameters),
        layer_types=cfg.layer_types, sliding_window=cfg.sliding_window,
        use_sliding_window=cfg.sliding_window is not None,
    ).to_diff_dict()
    draft_vocab = vocab if token_ids is None else len(token_ids)
    raw = {
        "architectures": ["DFlashSpeculator"], "speculators_model_type": "dflash", "speculators_version": "0.7.0",
        "transformer_layer_config": layer_cfg, "draft_vocab_size": draft_vocab, "block_size": cfg.block_size,
        "target_hidden_size": None, "aux_hidden_state_layer_ids": [i + 1 for i in cfg.target_layer_ids],
        "mask_token_id": cfg.mask_token_id, "sliding_window_non_causal": sliding_window_non_causal,
        "sample_from_anchor": sample_from_anchor,
        "speculators_config": {"algorithm": "dflash", "default_proposal_method": "greedy",
                               "proposal_methods": [{"proposal_type": "greedy",
                                                     "speculative_tokens": cfg.block_size - 1}],
                               "verifier": {"name_or_path": "tiny-qwen3", "architectures": ["Qwen3ForCausalLM"]}},
        "dtype": "float32", "transformers_version": "5.17.0",
    }
    raw.update(config_edits or {})
    state = {k: v.detach().clone() for k, v in draft.state_dict().items()}
    head = target.lm_head.weight.detach()
    state["embed_tokens.weight"] = target.get_input_embeddings().weight.detach().clone()
    if token_ids is None:
        state["lm_head.weight"] = head.clone()
    else:
        ids = torch.tensor(sorted(token_ids))
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[ids] = True
        state.update({"lm_head.weight": head[t2d].clone(), "t2d": t2d, "d2t": ids - torch.arange(len(ids))})
    state.update(weight_edits or {})
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(raw))
    save_file({k: v.contiguous() for k, v in state.items() if v is not None}, str(folder / "model.safetensors"))
    return folder


def zlab_subset(draft: DFlashDraftModel, token_ids) -> DFlashDraftModel:
    config = type(draft.config)(**{**draft.config.__dict__, "draft_vocab_size": len(token_ids)})
    sub = DFlashDraftModel(config)
    sub.load_state_dict({**draft.state_dict(), "draft_token_ids": sub.draft_token_ids})
    sub.set_draft_vocab(torch.tensor(token_ids))
    return sub.eval()


def same_run(target, a, b, backend, prompt_len=7, max_new=20):
    prompt = torch.randint(0, target.config.vocab_size, (1, prompt_len))
    ra = generate(target, a, prompt, max_new, backend=backend)
    rb = generate(target, b, prompt, max_new, backend=backend)
    assert torch.equal(ra.sequences, rb.sequences) and ra.acceptance_lengths == rb.acceptance_lengths
    expected = target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_new,
                               do_sample=False)
    assert torch.equal(ra.sequences, expected)


@pytest.fixture
def pair():
    target = make_target("qwen3", layers=4)
    return target, make_draft(target, layers=2, taps=[0, 2, 3], block_size=4)


@pytest.mark.parametrize("backend", ["reference", "fast"])
def test_full_vocabulary_checkpoint_equals_zlab_form(tmp_path, pair, backend):
    target, draft = pair
    loaded = DFlashDraftModel.from_pretrained(write_speculators(tmp_path / "spec", draft, target))
    assert loaded.config.target_layer_ids == [0, 2, 3]  # aux ids [1, 3, 4] - 1
    assert loaded.config.draft_vocab_size is None and loaded.config.block_size == 4
    assert loaded.config.num_key_value_heads == 2 and loaded.config.head_dim == 8
    ref = draft.state_dict()
    assert set(loaded.state_dict()) == set(ref)
    assert all(torch.equal(loaded.state_dict()[k], ref[k]) for k in ref)
    same_run(target, draft, loaded, backend)


@pytest.mark.parametrize("backend", ["reference", "fast"])
def test_draft_vocabulary_checkpoint_equals_zlab_form(tmp_path, pair, backend):
    target, draft = pair
    ids = sorted(torch.randperm(target.config.vocab_size)[:20].tolist())
    loaded = DFlashDraftModel.from_pretrained(write_speculators(tmp_path / "spec", draft, target, ids))
    assert loaded.config.draft_vocab_size == 20 and loaded.draft_token_ids.tolist() == ids
    same_run(target, zlab_subset(draft, ids), loaded, backend)
    # and it saves in z-lab form and loads back the same
    loaded.save_pretrained(tmp_path / "zlab")
    again = DFlashDraftModel.from_pretrained(tmp_path / "zlab")
    assert again.draft_token_ids.tolist() == ids
    same_run(target, loaded, again, backend)


def test_sliding_window_non_causal(tmp_path):
    target = make_target("qwen3")
    draft = make_draft(target, layers=2, layer_types=["sliding_attention", "full_attention"], sliding_window=6,
                       block_size=4)
    loaded = DFlashDraftModel.from_pretrained(
        write_speculators(tmp_path, draft, target, sliding_window_non_causal=True))
    assert loaded.config.layer_types == ["sliding_attention", "full_attention"] and loaded.config.sliding_window == 6
    assert loaded.config.is_causal is False
    zlab = make_draft(target, layers=2, layer_types=["sliding_attention", "full_attention"], sliding_window=6,
                      block_size=4, is_causal=False)
    zlab.load_state_dict(draft.state_dict())
    same_run(target, zlab, loaded, "reference", prompt_len=12)


@pytest.mark.parametrize("backend", ["reference", "fast"])
def test_sample_from_anchor(tmp_path, pair, backend):
    target, draft = pair
    loaded = DFlashDraftModel.from_pretrained(write_speculators(tmp_path / "spec", draft, target,
                                                               sample_from_anchor=True))
    assert loaded.config.sample_from_anchor is True
    hidden = torch.randn(1, 4, target.config.hidden_size)
    assert torch.equal(loaded.propose(hidden, target.lm_head), target.lm_head(hidden[:, :-1]).argmax(-1))
    loaded.save_pretrained(tmp_path / "zlab")
    again = DFlashDraftModel.from_pretrained(tmp_path / "zlab")
    assert again.config.sample_from_anchor is True
    same_run(target, loaded, again, backend)


@pytest.mark.parametrize("edit, message", [
    (dict(config_edits={"speculators_model_type": "eagle3"}), "'eagle3'; dflash-kernels loads speculators 'dflash'"),
    (dict(config_edits={"aux_hidden_state_layer_ids": [0, 2]}), "must be integers >= 1"),
    (dict(config_edits={"aux_hidden_state_layer_ids": None}), "aux_hidden_state_layer_ids is missing"),
    (dict(config_edits={"target_hidden_size": 64}), "target_hidden_size=64 != draft hidden_size=32"),
    (dict(weight_edits={"lm_head.weight": torch.zeros(7, 32)}), "lm_head.weight has 7 rows but draft_vocab_size is 6"),
    (dict(weight_edits={"d2t": None}), "has no d2t tensor"),
    (dict(weight_edits={"t2d": torch.ones(48, dtype=torch.bool)}), "d2t and t2d describe different draft vocabularies"),
    (dict(weight_edits={"d2t": torch.tensor([0, 0, 0, 0, 0, 100])}), "d2t and t2d describe different"),
], ids=["not-dflash", "aux-zero", "aux-missing", "target-hidden", "head-rows", "no-d2t", "t2d", "d2t-range"])
def test_bad_checkpoints(tmp_path, pair, edit, message):
    target, draft = pair
    folder = write_speculators(tmp_path, draft, target, [1, 4, 9, 16, 25, 36], **edit)
    with pytest.raises(ValueError, match=message):
        DFlashDraftModel.from_pretrained(folder)
