"""Draft vocabulary subsets (speculators / EAGLE-3 style): the draft scores only ``draft_token_ids``
with the target LM head's rows for them and proposes target ids. Verification keeps the output the
target's own, including tokens the draft can never propose."""
from __future__ import annotations

import pytest
import torch

from dflash import DFlashDraftModel, generate

from helpers.tiny_models import make_draft, make_target


def subset_draft(target, token_ids, **kwargs) -> DFlashDraftModel:
    """A draft over ``token_ids`` and ``full = make_draft(target, **kwargs)``: the draft has full's network weights."""
    full = make_draft(target, **kwargs)
    draft = make_draft(target, draft_vocab_size=len(token_ids), **kwargs)
    draft.load_state_dict({**full.state_dict(), "draft_token_ids": draft.draft_token_ids}, strict=True)
    draft.set_draft_vocab(torch.tensor(token_ids))
    return draft, full


def recording(draft):
    """Wraps ``draft.propose`` so that every round's proposals are kept in ``draft.seen``."""
    draft.seen = []
    propose = draft.propose

    def wrapped(hidden, head, out=None, **kwargs):
        out = propose(hidden, head, out=out, **kwargs)
        draft.seen.append(out.clone())
        return out

    draft.propose = wrapped
    return draft


def test_propose_is_argmax_over_the_subset():
    target = make_target("qwen3")
    ids = [3, 40, 7, 11, 0, 29, 47]
    draft, _ = subset_draft(target, ids)
    hidden = torch.randn(2, 6, target.config.hidden_size)
    full_logits = target.lm_head(hidden[:, 1:])
    expected = torch.tensor(ids)[full_logits[..., ids].argmax(-1)]
    assert torch.equal(draft.propose(hidden, target.lm_head), expected)
    assert draft.compute_logits(hidden[:, 1:], target.lm_head).shape[-1] == len(ids)


@pytest.mark.parametrize("backend", ["reference", "fast"])
def test_permuted_full_vocabulary_proposes_like_the_full_draft(backend):
    """A subset that is the whole vocabulary in another order must propose exactly what the full draft does."""
    target = make_target("qwen3")
    perm = torch.randperm(target.config.vocab_size).tolist()
    draft, full = subset_draft(target, perm, block_size=4)
    prompt = torch.randint(0, target.config.vocab_size, (1, 9))
    a = generate(target, recording(full), prompt, 20, backend=backend)
    b = generate(target, recording(draft), prompt, 20, backend=backend)
    assert torch.equal(a.sequences, b.sequences) and a.acceptance_lengths == b.acceptance_lengths
    assert len(full.seen) == len(draft.seen) > 0
    assert all(torch.equal(x, y) for x, y in zip(full.seen, draft.seen))


@pytest.mark.parametrize("backend", ["reference", "fast"])
@pytest.mark.parametrize("block", [2, 5])
def test_greedy_output_is_the_targets_with_tokens_outside_the_subset(backend, block):
    target = make_target("qwen3")
    vocab = target.config.vocab_size
    prompt = torch.randint(0, vocab, (1, 7))
    max_new = 24
    expected = target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_new,
                               do_sample=False)
    produced = expected[0, prompt.shape[1]:].unique().tolist()
    # The subset holds half of the produced tokens and some others: the rest can only come from the target.
    ids = produced[::2] + [t for t in range(vocab) if t not in produced][:10]
    outside = set(produced) - set(ids)
    assert outside, "the test needs target tokens the draft cannot propose"
    draft, _ = subset_draft(target, ids, block_size=block)
    draft = recording(draft)
    result = generate(target, draft, prompt, max_new, backend=backend)
    assert torch.equal(result.sequences, expected)
    assert set(expected[0, prompt.shape[1]:].tolist()) & outside
    proposed = torch.cat([p.flatten() for p in draft.seen])
    assert set(proposed.tolist()) <= set(ids)  # proposals are target ids from the subset, never draft indices


def test_checkpoint_round_trip(tmp_path):
    target = make_target("qwen3")
    ids = [45, 2, 17, 30, 8, 21, 39, 5]
    draft, _ = subset_draft(target, ids, block_size=4)
    draft.save_pretrained(tmp_path)
    loaded = DFlashDraftModel.from_pretrained(tmp_path)
    assert loaded.config.draft_vocab_size == len(ids)
    assert loaded.draft_token_ids.tolist() == ids
    prompt = torch.randint(0, target.config.vocab_size, (1, 6))
    a = generate(target, draft, prompt, 12, backend="reference")
    b = generate(target, loaded, prompt, 12, backend="reference")
    assert torch.equal(a.sequences, b.sequences) and a.acceptance_lengths == b.acceptance_lengths


def test_full_vocabulary_checkpoints_are_unchanged(tmp_path):
    target = make_target("qwen3")
    draft = make_draft(target)
    draft.save_pretrained(tmp_path)
    loaded = DFlashDraftModel.from_pretrained(tmp_path)
    assert loaded.config.draft_vocab_size is None and not hasattr(loaded, "draft_token_ids")
    assert set(loaded.state_dict()) == set(draft.state_dict())


@pytest.mark.parametrize("ids, message", [
    ([1, 2, 2, 3], "duplicates"),
    ([1, 2, -1, 3], "must lie in the target vocabulary"),
    ([1, 2, 3], "3 token ids for draft_vocab_size=4"),
    ([[1, 2], [3, 4]], "1-D integer tensor"),
], ids=["duplicate", "negative", "length", "shape"])
def test_bad_subsets_are_refused(ids, message):
    target = make_target("qwen3")
    draft = make_draft(target, draft_vocab_size=4)
    with pytest.raises(ValueError, match=message):
        draft.set_draft_vocab(torch.tensor(ids))


def test_subset_outside_the_target_vocabulary_is_refused_before_generating():
    target = make_target("qwen3")
    vocab = target.config.vocab_size
    draft = make_draft(target, draft_vocab_size=3)
    draft.set_draft_vocab(torch.tensor([0, 1, vocab + 2]))  # fine on its own: the draft does not know the target
    with pytest.raises(ValueError, match=rf"target vocabulary \[0, {vocab}\), found 0..{vocab + 2}"):
        generate(target, draft, torch.tensor([[1, 2, 3]]), 4, backend="reference")


def test_subset_on_a_full_vocabulary_draft_is_refused():
    target = make_target("qwen3")
    with pytest.raises(ValueError, match="full target vocabulary"):
        make_draft(target).set_draft_vocab(torch.tensor([1, 2]))


def test_checkpoint_subset_that_disagrees_with_its_config(tmp_path):
    from safetensors.torch import load_file, save_file

    target = make_target("qwen3")
    draft = make_draft(target, draft_vocab_size=4)
    draft.set_draft_vocab(torch.tensor([4, 3, 2, 1]))
    draft.save_pretrained(tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    state["draft_token_ids"] = torch.tensor([4, 3, 3, 1])
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="draft_token_ids: token ids contain duplicates"):
        DFlashDraftModel.from_pretrained(tmp_path)
    state["draft_token_ids"] = torch.tensor([4, 3, 2, 1, 0])
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"draft_token_ids: checkpoint \[5\], config implies \[4\]"):
        DFlashDraftModel.from_pretrained(tmp_path)


def test_bad_draft_vocab_size_in_config():
    target = make_target("qwen3")
    with pytest.raises(ValueError, match="draft_vocab_size must be a positive integer"):
        make_draft(target, draft_vocab_size=0)


def test_subset_draft_under_emulated_graphs_equals_the_target():
    """The gathered head rows and the id map are read by the captured draft step, not baked into it."""
    target = make_target("qwen3")
    vocab = target.config.vocab_size
    prompt = torch.randint(0, vocab, (1, 9))
    expected = target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=20, do_sample=False)
    draft, _ = subset_draft(target, list(range(0, vocab, 2)), block_size=4)
    for graphs in ("emulate", False):
        result = generate(target, draft, prompt, 20, backend="fast", use_cuda_graphs=graphs)
        assert torch.equal(result.sequences, expected), graphs


def saved_tensors(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vllm_form_holds_the_head_rows_and_offsets_and_loads_back(tmp_path, dtype):
    """Given the target's LM head, a subset is saved as vLLM / speculators read it (top-level draft_vocab_size,
    the draft's own lm_head rows, d2t offsets, no draft_token_ids) and loads back to the same draft."""
    import json

    target = make_target("qwen3")
    vocab = target.config.vocab_size
    ids = torch.randperm(vocab)[:13]
    draft, _ = subset_draft(target, ids.tolist(), block_size=4)
    draft = draft.to(dtype)
    draft.save_pretrained(tmp_path, output_head=target.lm_head)
    state = saved_tensors(tmp_path)
    assert "draft_token_ids" not in state
    assert torch.equal(state["lm_head.weight"], target.lm_head.weight.detach()[ids].to(dtype))
    assert state["d2t"].dtype == torch.int64 and torch.equal(state["d2t"] + torch.arange(13), ids)
    assert json.loads((tmp_path / "config.json").read_text())["draft_vocab_size"] == 13
    loaded = DFlashDraftModel.from_pretrained(tmp_path)
    assert loaded.fc.weight.dtype == dtype and torch.equal(loaded.draft_token_ids, ids)
    assert set(loaded.state_dict()) == set(draft.state_dict())
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in draft.state_dict().items())
    prompt = torch.randint(0, vocab, (1, 7))
    a = generate(target.to(dtype), draft, prompt, 12, backend="reference")
    b = generate(target, loaded, prompt, 12, backend="reference")
    assert torch.equal(a.sequences, b.sequences) and a.acceptance_lengths == b.acceptance_lengths


def test_checkpoint_with_both_vocabulary_forms_is_refused(tmp_path):
    from safetensors.torch import save_file

    target = make_target("qwen3")
    draft = make_draft(target, draft_vocab_size=4)
    draft.set_draft_vocab(torch.tensor([4, 3, 2, 1]))
    draft.save_pretrained(tmp_path, output_head=target.lm_head)
    state = saved_tensors(tmp_path)
    save_file({**state, "draft_token_ids": torch.tensor([4, 3, 2, 1])}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="both draft_token_ids and d2t"):
        DFlashDraftModel.from_pretrained(tmp_path)
    state["lm_head.weight"] = state["lm_head.weight"][:3]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="lm_head.weight has 3 rows but draft_vocab_size is 4"):
        DFlashDraftModel.from_pretrained(tmp_path)


def test_export_vllm_rewrites_an_old_form_draft(tmp_path):
    """``dflash export vllm`` turns a draft_token_ids checkpoint into the vLLM form with the target's head rows."""
    from dflash_apps.cli import main

    target = make_target("llama")
    target.save_pretrained(tmp_path / "target")
    ids = torch.randperm(target.config.vocab_size)[:9]
    draft, _ = subset_draft(target, ids.tolist())
    draft.save_pretrained(tmp_path / "old")
    assert "draft_token_ids" in saved_tensors(tmp_path / "old")
    with pytest.raises(SystemExit):  # a subset needs the target's head
        main(["export", "vllm", str(tmp_path / "old"), str(tmp_path / "new")])
    assert main(["export", "vllm", str(tmp_path / "old"), str(tmp_path / "new"), "--target",
                 str(tmp_path / "target")]) == 0
    state = saved_tensors(tmp_path / "new")
    assert "draft_token_ids" not in state
    assert torch.equal(state["lm_head.weight"], target.lm_head.weight.detach()[ids])
    assert torch.equal(DFlashDraftModel.from_pretrained(tmp_path / "new").draft_token_ids, ids)
