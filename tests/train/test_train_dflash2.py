"""Training DFlash2 drafts (``fit --arch dflash2``) on a tiny random target: the selector's training rule, the
loss falling over a few steps, warm starts from a DFlash draft, the exported folder (the official layout, exact
weights), its greedy decoding in both runtimes, the evaluation's τ against the runtime's, and the refusals
(draft vocabulary subsets, tree estimates)."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from dflash import DFlash2DraftModel, DFlashDraftModel, generate
from dflash.config import DFlash2Settings
from dflash.dflash2 import CODEBOOKS, GroupedDynamicCausalConv
from dflash_apps.train import main as train_main
from dflash_apps.train.blocks import draft_forward_dense, pack_batch
from dflash_apps.train.data import compute_features
from dflash_apps.train.selector import teacher_forced_predecessors, training_candidates
from dflash_apps.train.trainer import (
    Trainer, _save_atomic, build_draft, init_from_draft, init_from_target, make_draft_config,
)
from dflash_apps.train.vocab import with_draft_vocab
from helpers.tiny_models import make_target

B, MASK, TAPS = 4, 3, [1, 2]
D2 = DFlash2Settings(conv_kernel_size=2, conv_group_size=8, selector_rank=8, selector_top_k=6)


def tiny_config(target, dflash2: DFlash2Settings | None = D2):
    return make_draft_config(target.config, num_layers=1, block_size=B, mask_token_id=MASK, target_layer_ids=TAPS,
                             dflash2=dflash2)


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    model = make_target("qwen3")
    with torch.no_grad():  # an expressive head: confident, varied greedy continuations
        model.lm_head.weight.normal_(0.0, 0.5)
    return model


@pytest.fixture(scope="module")
def records(target):
    """Prompts of 5 random tokens and the target's greedy responses (20 tokens), with their features."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(3):
        prompt = torch.randint(MASK + 1, 48, (1, 5), generator=g)
        ids = target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=20, do_sample=False)[0]
        out.append({"ids": ids.int(), "prompt_len": 5, "features": compute_features(target, ids, TAPS)})
    return out


def make_trainer(draft, target, **kwargs):
    return Trainer(draft, target.get_input_embeddings().weight, target.lm_head.weight, **kwargs)


@pytest.fixture(scope="module")
def trained(target, records):
    """A DFlash2 draft after 60 steps on the records, and the losses of its first and last steps."""
    torch.manual_seed(2)
    trainer = make_trainer(build_draft(tiny_config(target)), target, lr=3e-3, total_steps=60, num_anchors=16, seed=0)
    first = trainer.train_step(records)
    for _ in range(59):
        last = trainer.train_step(records)
    return trainer, first, last


def test_teacher_forced_predecessors_and_candidates():
    """Row k's predecessor is the anchor (k = 1) or row k-1's label; the candidates are the top-k, best first, with
    the weakest replaced by the label where it is missing, and the label's place among them."""
    block_ids = torch.tensor([[7, MASK, MASK, MASK, 9, MASK, MASK, MASK]])
    labels = torch.tensor([[-100, 11, 12, 13, -100, 21, -100, -100]])
    assert teacher_forced_predecessors(block_ids, labels)[0, [1, 2, 3, 5, 6]].tolist() == [7, 11, 12, 9, 21]
    logits = torch.tensor([[[0.0, 5.0, 4.0, 3.0, 2.0, 1.0]] * 3])
    candidates, place = training_candidates(logits, torch.tensor([[2, 5, -100]]), top_k=3)
    assert candidates.tolist() == [[[1, 2, 3], [1, 2, 5], [1, 2, 3]]]
    assert place.tolist() == [[1, 2, -100]]


def test_fitting_reduces_the_loss_and_trains_every_dflash2_part(trained, target):
    trainer, first, last = trained
    assert last["loss"] < first["loss"] / 5, (first["loss"], last["loss"])
    assert last["selector_loss"] < first["selector_loss"] / 5, (first["selector_loss"], last["selector_loss"])
    fresh = build_draft(tiny_config(target))
    draft = trainer.draft
    for name in ("layers.0.attention_conv.kernel_projection.weight", "layers.0.mlp_conv.base_kernel",
                 "candidate_selector.predecessor_codebook", "candidate_selector.hidden_projection.weight"):
        assert not torch.equal(draft.state_dict()[name], fresh.state_dict()[name]), name
    assert not trainer.lm_head_weight.requires_grad and not trainer.embed_weight.requires_grad


def test_init_from_a_dflash_draft_starts_as_that_draft(target, records, tmp_path):
    """A DFlash2 draft warm-started from a DFlash draft's folder copies every shared tensor, and its identity
    convolutions give exactly that draft's hidden states; a DFlash draft refuses a DFlash2 folder."""
    source = build_draft(tiny_config(target, dflash2=None))
    source.reset_parameters(std=0.2)
    source.save_pretrained(tmp_path / "dflash")
    draft = build_draft(tiny_config(target))
    init_from_draft(draft, str(tmp_path / "dflash"))
    for name, weight in source.state_dict().items():
        assert torch.equal(draft.state_dict()[name], weight), name
    batch = pack_batch(records, [torch.tensor([5, 8, 11])] * len(records), B, MASK)
    emb = target.get_input_embeddings().weight
    assert torch.equal(draft_forward_dense(draft, batch, emb), draft_forward_dense(source, batch, emb))
    draft.save_pretrained(tmp_path / "dflash2")
    with pytest.raises(ValueError, match="DFlash draft from a DFlash draft"):
        init_from_draft(build_draft(tiny_config(target, dflash2=None)), str(tmp_path / "dflash2"))


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    """The trained draft's run folder (last.pt, as fit writes it) exported with ``dflash train export``."""
    trainer = trained[0]
    run, out = tmp_path_factory.mktemp("run"), tmp_path_factory.mktemp("export") / "draft"
    _save_atomic({**trainer.state_dict(), "config": trainer.draft.config.to_dict()}, str(run / "last.pt"))
    assert train_main(["export", str(run), str(out)]) == 0
    return out


def test_export_writes_the_official_layout_and_round_trips_exactly(trained, exported):
    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"]
    assert {k: config["dflash_config"][k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank",
                                                    "selector_top_k")} == {"conv_kernel_size": 2, "conv_group_size": 8,
                                                                           "selector_rank": 8, "selector_top_k": 6}
    stored = load_file(str(exported / "model.safetensors"))
    assert {"candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook"} <= set(stored)
    assert not any(name.endswith("codebook.weight") for name in stored)
    loaded = DFlash2DraftModel.from_pretrained(exported)
    want = {k: v.to(torch.bfloat16) for k, v in trained[0].draft.state_dict().items()}
    got = loaded.state_dict()
    assert set(got) == set(want)
    for name, weight in want.items():
        assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], weight), name


@pytest.mark.parametrize("backend", ["reference", "fast"])
def test_exported_draft_decodes_as_the_target(target, records, exported, backend):
    """Greedy output == the target's own; the trained draft's proposals are accepted (not only bonus tokens)."""
    draft = DFlash2DraftModel.from_pretrained(exported, dtype=torch.float32)
    accepted = []
    for rec in records:
        prompt = rec["ids"][None, :rec["prompt_len"]].long()
        out = generate(target, draft, prompt, 16, backend=backend)
        expected = target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=16, do_sample=False)
        assert torch.equal(out.sequences, expected)
        accepted += out.acceptance_lengths
    assert max(accepted) > 1, accepted


def test_evaluate_walks_the_selector_as_the_runtime_does(trained, target, records):
    """The τ estimate at each record's first response position equals the runtime's first round (the selector's
    greedy walk, verified by the target), for the trained draft and, with other acceptance lengths, for the
    same draft under a selector that overrides its logits' argmax."""
    trainer = trained[0]
    draft = trainer.draft.eval()
    first_rounds = []
    for rec in records:
        ev = trainer.evaluate([rec], stride=100, max_anchors=1)
        prompt = rec["ids"][None, :rec["prompt_len"]].long()
        first_rounds.append(generate(target, draft, prompt, 16, backend="reference").acceptance_lengths[0])
        assert ev["eval_blocks"] == 1 and ev["tau_est"] == first_rounds[-1]
    saved = {name: getattr(draft.candidate_selector, name).detach().clone() for name in CODEBOOKS}
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # a selector that overrides the logits: the walk, not their argmax, is measured
        for name in CODEBOOKS:
            getattr(draft.candidate_selector, name).copy_(torch.randn(saved[name].shape, generator=g) * 3)
    try:
        ev = trainer.evaluate(records, stride=100, max_anchors=1)
        walked = [generate(target, draft, rec["ids"][None, :rec["prompt_len"]].long(), 16,
                           backend="reference").acceptance_lengths[0] for rec in records]
    finally:
        with torch.no_grad():
            for name in CODEBOOKS:
                getattr(draft.candidate_selector, name).copy_(saved[name])
    assert ev["tau_est"] == pytest.approx(sum(walked) / len(walked))
    assert walked != first_rounds


def test_decode_walk_gives_the_runtimes_rounds(trained, target, records):
    """The teacher-forced decode walk (the selector's proposals, blocks cut short near the end) gives the rounds
    the runtime makes, round for round, for the whole response and for a decode that ends inside it."""
    trainer = trained[0]
    longest = 1
    for tokens in (20, 9):
        for rec in records:
            walked = trainer.walk_rounds(rec, tokens)
            prompt = rec["ids"][None, :rec["prompt_len"]].long()
            out = generate(target, trainer.draft.eval(), prompt, tokens, backend="reference")
            assert out.acceptance_lengths == walked
            longest = max(longest, *walked)
    assert longest > 1


def test_vocabulary_subsets_and_tree_estimates_are_refused(trained, exported, tmp_path, capsys):
    draft = trained[0].draft
    with pytest.raises(ValueError, match="a DFlash2 draft keeps the full target vocabulary"):
        with_draft_vocab(draft, torch.arange(10))
    # refused before any data is read: the data folder does not exist
    assert train_main(["vocab", str(exported), str(tmp_path / "sub"), "--data", str(tmp_path / "none")]) == 2
    assert "a DFlash2 draft keeps the full target vocabulary" in capsys.readouterr().err
    assert not (tmp_path / "sub").exists()
    with pytest.raises(ValueError, match="tree budgets need a DFlash draft"):
        trained[0].evaluate([], tree_budgets=(7,))


def test_build_draft_starts_dflash2_convolutions_as_identities(target):
    """Fresh DFlash2 convolutions are identities, also after ``--init target`` copies a target layer in."""
    draft = build_draft(tiny_config(target))
    init_from_target(draft, target, [3])
    assert torch.equal(draft.layers[0].mlp.down_proj.weight, target.model.layers[3].mlp.down_proj.weight)
    convs = [m for m in draft.modules() if isinstance(m, GroupedDynamicCausalConv)]
    assert len(convs) == 2
    for conv in convs:
        assert torch.equal(conv.kernel_projection.weight, torch.zeros_like(conv.kernel_projection.weight))
        assert conv.base_kernel[:, 0].eq(1).all() and conv.base_kernel[:, 1:].eq(0).all()
    assert isinstance(build_draft(tiny_config(target, dflash2=None)), DFlashDraftModel)
    assert not isinstance(build_draft(tiny_config(target, dflash2=None)), DFlash2DraftModel)
