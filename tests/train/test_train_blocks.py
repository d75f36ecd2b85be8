"""Training recipe on tiny random models: loss weights, block mask, dense vs Flex paths, overfitting."""
import math

import pytest
import torch

from dflash.model import DFlashDraftModel
from dflash_apps.train.blocks import (
    build_block_mask,
    default_gamma,
    draft_forward_dense,
    draft_forward_flex,
    loss_weights,
    pack_batch,
    sample_anchors,
    weighted_block_loss,
)
from dflash_apps.train.data import compute_features
from dflash_apps.train.teacher import TailTeacher, soft_targets
from dflash_apps.train.trainer import Trainer, lr_at, make_draft_config

V, H = 96, 64
MASK = 3


def tiny_target(layers: int = 4):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                      rope_theta=10000.0, tie_word_embeddings=True, rms_norm_eps=1e-5)
    return LlamaForCausalLM(cfg).eval()


def tiny_draft(target, block_size=4, layers=1):
    cfg = make_draft_config(target.config, num_layers=layers, block_size=block_size, mask_token_id=MASK,
                            target_layer_ids=[1, 2])
    return DFlashDraftModel(cfg)


def record(target, ids, prompt_len, layer_ids=(1, 2)):
    ids = torch.as_tensor(ids, dtype=torch.int32)
    return {"ids": ids, "prompt_len": prompt_len, "features": compute_features(target, ids, list(layer_ids)),
            "layer_ids": list(layer_ids)}


def logits_of(draft, target, batch):
    h = draft_forward_dense(draft, batch, target.get_input_embeddings().weight)
    return draft.compute_logits(h, target.lm_head)


def test_loss_weights_match_formula():
    for B, g in ((16, 7.0), (10, 5.0), (8, 4.0)):
        assert default_gamma(B) == g
        w = loss_weights(B)
        assert w.shape == (B - 1,)
        for k in range(1, B):
            assert math.isclose(float(w[k - 1]), math.exp(-(k - 1) / g), rel_tol=1e-6)
    assert torch.allclose(loss_weights(8, gamma=2.0), torch.exp(-torch.arange(7.0) / 2.0))


def test_weighted_loss_is_weighted_mean_of_ce():
    B = 4
    logits = torch.randn(1, 2 * B, 11)
    labels = torch.tensor([[-100, 1, 2, 3, -100, 4, 5, -100]])
    loss, _ = weighted_block_loss(logits, labels, B, gamma=2.0)
    w = torch.exp(-torch.arange(3.0) / 2.0)
    ce = torch.nn.functional.cross_entropy(logits[0], labels[0].clamp(min=0), reduction="none")
    ws = torch.tensor([0, w[0], w[1], w[2], 0, w[0], w[1], 0])
    assert torch.allclose(loss, (ce * ws).sum() / ws.sum(), atol=1e-6)


def test_dense_mask_structure():
    anchors = torch.tensor([[2, 5, -1]])
    m = build_block_mask(anchors, ctx_len=8, block_size=2)[0, 0]
    assert m.shape == (6, 14)
    assert m[0, :8].tolist() == [True, True] + [False] * 6        # block 0 sees positions < 2
    assert m[2, :8].tolist() == [True] * 5 + [False] * 3          # block 1 sees positions < 5
    assert not m[4, :8].any()                                     # padding block sees no context
    blk = m[:, 8:]
    assert blk.tolist() == [[i // 2 == j // 2 for j in range(6)] for i in range(6)]


def test_anchors_inside_response(seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(50):
        a = sample_anchors(5, 20, 6, g)
        assert len(a) == 6 and a.min() >= 5 and a.max() <= 18 and len(set(a.tolist())) == 6
    assert len(sample_anchors(5, 8, 10, g)) == 2  # only positions 5 and 6 have a label after them


def test_block_logits_ignore_later_tokens_and_other_blocks():
    target = tiny_target()
    draft = tiny_draft(target, block_size=4).eval()
    ids = torch.randint(10, V, (30,))
    prompt_len, anchors = 6, torch.tensor([9, 15, 21])
    base = pack_batch([record(target, ids, prompt_len)], [anchors], 4, MASK)
    ref = logits_of(draft, target, base)[0]
    # 1) change every token after anchor 15: block 0 (a=9) must change? no — only blocks with anchor <= 15 are fixed
    ids2 = ids.clone()
    ids2[16:] = torch.randint(10, V, (14,))
    b2 = pack_batch([record(target, ids2, prompt_len)], [anchors], 4, MASK)
    out2 = logits_of(draft, target, b2)[0]
    assert torch.allclose(out2[0:8], ref[0:8], atol=1e-5)          # blocks at anchors 9 and 15 unchanged
    assert not torch.allclose(out2[8:12], ref[8:12], atol=1e-3)    # block at 21 sees the change
    # 2) the anchor's own features are not visible: perturbing only the features at the anchor position
    b3 = pack_batch([record(target, ids, prompt_len)], [anchors], 4, MASK)
    b3.target_hidden[0, 15:] += torch.randn_like(b3.target_hidden[0, 15:])
    out3 = logits_of(draft, target, b3)[0]
    assert torch.allclose(out3[0:8], ref[0:8], atol=1e-5)
    # 3) another block's anchor token does not leak into this block
    ids4 = ids.clone()
    ids4[21] = (ids4[21] + 1 - 10) % (V - 10) + 10
    b4 = pack_batch([record(target, ids, prompt_len)], [anchors], 4, MASK)
    b4.block_ids[0, 8] = int(ids4[21])
    out4 = logits_of(draft, target, b4)[0]
    assert torch.allclose(out4[0:8], ref[0:8], atol=1e-5)
    assert not torch.allclose(out4[8:12], ref[8:12], atol=1e-4)


def test_packed_blocks_equal_single_inference_calls():
    """Each packed block gives the logits of the plain draft call that inference would make."""
    target = tiny_target()
    draft = tiny_draft(target, block_size=4).eval()
    ids = torch.randint(10, V, (24,))
    rec = record(target, ids, 5)
    anchors = torch.tensor([7, 12, 18])
    packed = logits_of(draft, target, pack_batch([rec], [anchors], 4, MASK))[0]
    emb = target.get_input_embeddings().weight
    for j, a in enumerate(anchors.tolist()):
        blk = torch.tensor([[int(ids[a])] + [MASK] * 3])
        pos = torch.arange(a + 4)[None]
        h = draft(position_ids=pos, noise_embedding=emb[blk], target_hidden=rec["features"][None, :a])
        single = draft.compute_logits(h, target.lm_head)[0]
        assert torch.allclose(packed[4 * j:4 * j + 4], single, atol=1e-4), j


def test_flex_path_matches_dense():
    pytest.importorskip("torch.nn.attention.flex_attention")
    target = tiny_target()
    draft = tiny_draft(target, block_size=4, layers=2).eval()
    recs = [record(target, torch.randint(10, V, (n,)), 4) for n in (20, 26)]
    batch = pack_batch(recs, [torch.tensor([5, 9, 14]), torch.tensor([6, 20])], 4, MASK)
    emb = target.get_input_embeddings().weight
    dense = draft_forward_dense(draft, batch, emb)
    try:
        with torch.no_grad():
            flex = draft_forward_flex(draft, batch, emb, compile=False)
    except Exception as exc:  # pragma: no cover - depends on the torch build
        pytest.skip(f"FlexAttention does not run here: {type(exc).__name__}: {exc}")
    valid = (batch.anchors.repeat_interleave(4, dim=1) >= 0)
    assert torch.allclose(flex[valid], dense[valid], atol=1e-4)
    la, _ = weighted_block_loss(draft.compute_logits(dense, target.lm_head), batch.labels, 4)
    lb, _ = weighted_block_loss(draft.compute_logits(flex, target.lm_head), batch.labels, 4)
    assert torch.allclose(la, lb, atol=1e-4)


def test_lr_schedule():
    assert lr_at(0, 100, 1.0, 0.04) == pytest.approx(0.25)
    assert lr_at(3, 100, 1.0, 0.04) == pytest.approx(1.0)
    assert lr_at(100, 100, 1.0, 0.04) == pytest.approx(0.0, abs=1e-9)
    assert lr_at(52, 100, 1.0, 0.04) == pytest.approx(0.5, abs=1e-6)


def test_training_overfits_tiny_batch_and_freezes_target():
    """80 AdamW steps on 2 sequences: the weighted loss falls by at least 5x; target weights unchanged."""
    target = tiny_target()
    with torch.no_grad():  # a random target with an expressive (not near-zero) tied LM head
        target.get_input_embeddings().weight.normal_(0.0, 0.5)
    draft = tiny_draft(target, block_size=4)
    recs = [record(target, torch.randint(10, V, (n,)), 4) for n in (22, 18)]
    emb_before = target.get_input_embeddings().weight.detach().clone()
    tr = Trainer(draft, target.get_input_embeddings().weight, target.lm_head.weight, lr=3e-3,
                 total_steps=80, num_anchors=16, seed=0)
    first = tr.train_step(recs)["loss"]
    for _ in range(79):
        last = tr.train_step(recs)["loss"]
    assert last < first / 5, (first, last)
    assert torch.equal(target.get_input_embeddings().weight, emb_before)
    assert not tr.embed_weight.requires_grad and not tr.lm_head_weight.requires_grad
    ev = tr.evaluate(recs, stride=1)
    assert ev["tau_est"] > 1.5


def test_evaluate_skips_responses_shorter_than_a_block():
    """Responses of 1 and 3 tokens (block size 4) have no anchor block: evaluated beside a longer one they leave its
    estimate and loss as they are, and the walk still decodes them."""
    target = tiny_target()
    draft = tiny_draft(target, block_size=4)
    tr = Trainer(draft, target.get_input_embeddings().weight, target.lm_head.weight)
    long = record(target, torch.randint(10, V, (22,)), 4)
    short = [record(target, torch.randint(10, V, (n,)), 4) for n in (5, 7)]
    alone = tr.evaluate([long], stride=1)
    mixed = tr.evaluate([short[0], long, short[1]], stride=1, walk_tokens=8)
    assert mixed["tau_est"] == alone["tau_est"] and mixed["eval_loss"] == pytest.approx(alone["eval_loss"], rel=1e-6)
    assert mixed["walk_rounds"] == sum(len(tr.walk_rounds(r, 8)) for r in (short[0], long, short[1]))
    assert tr.walk_rounds(short[1], 8)  # its 3 tokens: decoded in rounds


def test_evaluate_a_draft_with_a_vocabulary_subset():
    """A subset draft is evaluated over its own ids (as at inference): with every id, permuted, it scores exactly
    like the full draft; with none of the labels' ids it never matches (τ estimate 1)."""
    from dflash_apps.train.vocab import with_draft_vocab

    target = tiny_target()
    draft = tiny_draft(target, block_size=4)
    recs = [record(target, torch.randint(10, V, (n,)), 4) for n in (22, 18)]
    full = Trainer(draft, target.get_input_embeddings().weight, target.lm_head.weight).evaluate(recs, stride=1)
    everything = with_draft_vocab(draft, torch.randperm(V))
    ev = Trainer(everything, target.get_input_embeddings().weight, target.lm_head.weight).evaluate(recs, stride=1)
    assert ev["tau_est"] == full["tau_est"] and ev["eval_loss"] == pytest.approx(full["eval_loss"], rel=1e-5)
    labels = set(torch.cat([r["ids"][r["prompt_len"]:] for r in recs]).tolist())
    few = with_draft_vocab(draft, torch.tensor([i for i in range(V) if i not in labels][:5]))
    ev = Trainer(few, target.get_input_embeddings().weight, target.lm_head.weight).evaluate(recs, stride=1)
    assert ev["tau_est"] == 1.0


def test_init_from_draft_copies_weights_and_drops_vocab_subset(tmp_path):
    """`fit --init FOLDER` warm start: a saved draft's weights (with a draft vocabulary subset, stored as the
    shipped draft is: its own LM head rows and d2t offsets, which are dropped) load into a fresh draft of the same
    shape; a shallower draft or other taps are refused."""
    from safetensors.torch import load_file

    from dflash_apps.train.trainer import init_from_draft
    from dflash_apps.train.vocab import with_draft_vocab

    target = tiny_target()
    src = tiny_draft(target, layers=2)
    with_draft_vocab(src, torch.arange(0, 20, 2)).save_pretrained(str(tmp_path / "src"), output_head=target.lm_head)
    assert {"d2t", "lm_head.weight"} <= set(load_file(str(tmp_path / "src" / "model.safetensors")))
    fresh = tiny_draft(target, layers=2)
    init_from_draft(fresh, str(tmp_path / "src"))
    for name, w in src.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], w), name
    with pytest.raises(ValueError, match="the same or more --layers"):
        init_from_draft(tiny_draft(target, layers=1), str(tmp_path / "src"))
    cfg = make_draft_config(target.config, num_layers=2, block_size=4, mask_token_id=MASK, target_layer_ids=[1, 3])
    with pytest.raises(ValueError, match="--target-layer-ids"):
        init_from_draft(DFlashDraftModel(cfg), str(tmp_path / "src"))


def test_init_with_more_taps_computes_what_it_did(tmp_path, seed):
    """A draft tapping more target layers (`fit --target-layer-ids 0,1,2,3 --init FOLDER` from a draft of taps 1,2)
    gives the folder draft's logits (fp32 rounding apart: its fc sums zero columns too) on the same sequence, and
    the added taps' fc columns get a gradient at once."""
    from dflash_apps.train.trainer import init_from_draft

    target, src = _saved_random_draft(tmp_path, seed)
    cfg = make_draft_config(target.config, num_layers=2, block_size=4, mask_token_id=MASK,
                            target_layer_ids=[0, 1, 2, 3])
    wide = DFlashDraftModel(cfg)
    init_from_draft(wide, str(tmp_path / "src"))
    ids, anchors = torch.randint(10, V, (40,)), [torch.tensor([9, 17, 26])]
    want = logits_of(src, target, pack_batch([record(target, ids, 8)], anchors, 4, MASK))
    batch = pack_batch([record(target, ids, 8, layer_ids=(0, 1, 2, 3))], anchors, 4, MASK)
    got = logits_of(wide, target, batch)
    assert torch.isfinite(want).all() and torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    assert (got - want).abs().max() < (want.abs().max() * 1e-5)
    logits_of(wide, target, batch).square().mean().backward()
    H = target.config.hidden_size
    grad = wide.fc.weight.grad
    assert grad[:, :H].abs().sum() > 0 and grad[:, 3 * H:].abs().sum() > 0


def _saved_random_draft(tmp_path, seed):
    """A tiny target and a 2-layer draft of random weights saved to ``tmp_path / "src"``, loaded back as stored
    (bf16 values)."""
    torch.manual_seed(seed)
    target = tiny_target()
    src = tiny_draft(target, layers=2)
    with torch.no_grad():
        for p in src.parameters():
            p.normal_(0, 0.2)
    src.save_pretrained(str(tmp_path / "src"))
    return target, DFlashDraftModel.from_pretrained(str(tmp_path / "src"), dtype=torch.float32)


def test_init_from_shallower_draft_computes_what_it_did(tmp_path, seed):
    """A deeper draft warm-started from a shallower one (`fit --layers 4 --init FOLDER`) gives the folder draft's
    logits bit for bit on random blocks (its added layers are identities), and those layers are not inert: their
    attention and MLP inputs are trained copies, so the output projections get a gradient at once."""
    from dflash_apps.train.trainer import init_from_draft

    target, src = _saved_random_draft(tmp_path, seed)
    deep = tiny_draft(target, layers=4)
    init_from_draft(deep, str(tmp_path / "src"))
    ids = torch.randint(10, V, (40,))
    batch = pack_batch([record(target, ids, 8)], [torch.tensor([9, 17, 26])], 4, MASK)
    want, got = logits_of(src, target, batch), logits_of(deep, target, batch)
    assert torch.isfinite(want).all() and torch.equal(got, want)
    logits_of(deep, target, batch).square().mean().backward()
    for i in (2, 3):
        layer = deep.layers[i]
        assert layer.self_attn.o_proj.weight.grad.abs().sum() > 0
        assert layer.mlp.down_proj.weight.grad.abs().sum() > 0


def _walk_labels(tokens, parents, labels):
    """Accepted draft tokens of one tree against the target's path ``labels`` (depths 1..B-1): brute force."""
    cur, accepted = 0, 0
    for want in labels:
        children = [i for i in range(len(tokens)) if parents[i] == cur and tokens[i] == want]
        if not children:
            break
        cur, accepted = children[0], accepted + 1
    return accepted


@pytest.mark.parametrize("with_vocab_ids", [False, True])
def test_tree_acceptance_lengths_walk_the_target_path(with_vocab_ids, seed):
    """Per full block: 1 + the deepest node of the tree (build_tree's definition, a heap) on the labels' path, by a
    brute-force walk; blocks with a missing label are left out; a larger budget never accepts less; budget 1 is
    the chain's first token."""
    from dflash_apps.train.blocks import acceptance_lengths, tree_acceptance_lengths
    from dflash_kernels.tree import build_tree_reference

    g = torch.Generator().manual_seed(seed)
    b, A, B, v = 3, 5, 4, 11
    logits = torch.randn(b, A * B, v, generator=g) * 2.5
    vocab_ids = torch.randperm(40, generator=g)[:v] if with_vocab_ids else None
    ids = (lambda j: vocab_ids[j]) if with_vocab_ids else (lambda j: j)
    labels = torch.full((b, A * B), -100)
    for i in range(b):
        for a in range(A):
            for k in range(1, B):  # mostly the draft's first choice, else its second or third, so paths run deep
                rank = (0, 0, 0, 1, 2, 3)[int(torch.randint(0, 6, (1,), generator=g))]  # and branch; 3: any token
                pick = logits[i, a * B + k].argsort(descending=True)[rank] if rank < 3 else torch.randint(0, v, (1,))
                labels[i, a * B + k] = ids(int(pick))
    labels[0, 2 * B + 3] = -100  # an incomplete block: not counted
    full_blocks = [(i, a) for i in range(b) for a in range(A) if (labels[i, a * B + 1:(a + 1) * B] != -100).all()]
    previous = None
    budgets = (1, 2, 5, 9, 30)
    trees = tree_acceptance_lengths(logits, labels, B, budgets, vocab_ids=vocab_ids, chunk=4)
    assert list(trees) == list(budgets)
    for budget in budgets:
        got = trees[budget]
        want = []
        for i, a in full_blocks:
            z = logits[i, a * B + 1:(a + 1) * B][None]
            tokens, parents, _ = build_tree_reference(z, torch.zeros(1, dtype=torch.long), budget, vocab_ids=vocab_ids)
            want.append(1 + _walk_labels(tokens[0].tolist(), parents[0].tolist(),
                                         labels[i, a * B + 1:(a + 1) * B].tolist()))
        assert got.tolist() == want, budget
        if previous is not None:
            assert (got >= previous).all(), budget
        previous = got
        if budget == 1:
            pred = logits.argmax(-1)
            chain = acceptance_lengths(ids(pred) if with_vocab_ids else pred, labels, B)
            assert got.tolist() == chain.clamp(max=2).tolist()
    assert previous.max() == B and len(set(previous.tolist())) > 2  # deep paths and a spread of lengths


def test_evaluate_reports_tree_estimates():
    """Trainer.evaluate(tree_budgets=...): per budget the mean of tree_acceptance_lengths over the chain's blocks;
    a tree of 1 node is the chain cut at one draft token; more nodes never lower the estimate."""
    target = tiny_target()
    with torch.no_grad():
        target.get_input_embeddings().weight.normal_(0.0, 0.5)
    draft = tiny_draft(target, block_size=4)
    recs = [record(target, torch.randint(10, V, (n,)), 4) for n in (22, 18)]
    tr = Trainer(draft, target.get_input_embeddings().weight, target.lm_head.weight, lr=3e-3, total_steps=40,
                 num_anchors=16, seed=0)
    for _ in range(40):  # a draft that has learnt something: acceptance beyond the first token
        tr.train_step(recs)
    ev = tr.evaluate(recs, stride=1, tree_budgets=(1, 4, 12))
    plain = tr.evaluate(recs, stride=1)
    assert "tree_tau_est" not in plain and plain["tau_est"] == ev["tau_est"]
    trees = ev["tree_tau_est"]
    assert list(trees) == [1, 4, 12]
    assert trees[1] <= min(ev["tau_est"], 2.0) and trees[1] <= trees[4] <= trees[12]
    assert trees[12] > ev["tau_est"] > 1.0


def test_tree_budgets_argument_is_checked():
    from dflash_apps.train.trainer import _budgets

    assert _budgets("") == [] and _budgets("7, 15") == [7, 15]
    for bad in ("7,x", "0", "3,-1"):
        with pytest.raises(SystemExit, match="tree budgets must be comma-separated positive integers"):
            _budgets(bad)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_tail_teacher_gives_the_target_distribution_at_every_block_row(attn):
    """The tail (layers after the deepest tap + norm + head) over the stored features of a right-padded batch: each
    labelled block row gets the target's own next-token distribution after the previous position."""
    torch.manual_seed(11)
    target = tiny_target()
    target.config._attn_implementation = attn
    recs = [record(target, torch.randint(10, V, (n,)), 3) for n in (21, 13)]
    anchors = [torch.tensor([3, 9, 17]), torch.tensor([4, 10])]
    batch = pack_batch(recs, anchors, 4, MASK)
    teacher = TailTeacher(target, 2)
    got = soft_targets(teacher.hidden(batch.target_hidden, [1, 2]), batch.position_ids, batch.ctx_len,
                       target.lm_head.weight)
    for i, r in enumerate(recs):
        with torch.no_grad():
            want = torch.softmax(target(r["ids"][None, :-1].long()).logits[0].double(), -1)
        rows = (batch.labels[i] != -100).nonzero().flatten()
        assert len(rows) > 0
        pos = batch.position_ids[i, batch.ctx_len + rows]
        torch.testing.assert_close(got[i, rows].double(), want[pos - 1], atol=2e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="not the teacher's tap 2"):
        teacher.hidden(batch.target_hidden, [0, 1])
    with pytest.raises(ValueError, match="target layers after the draft's deepest tap 3"):
        TailTeacher(target, 3)


def test_soft_label_loss_mixes_the_hard_and_the_soft_cross_entropy():
    torch.manual_seed(12)
    B = 4
    logits = torch.randn(2, 2 * B, 11)
    labels = torch.randint(0, 11, (2, 2 * B))
    labels[:, ::B] = -100
    labels[1, 5:] = -100
    hard, _ = weighted_block_loss(logits, labels, B)
    onehot = torch.nn.functional.one_hot(labels.clamp(min=0), 11).float()
    assert torch.allclose(weighted_block_loss(logits, labels, B, soft=onehot, soft_weight=1.0)[0], hard, atol=1e-6)
    soft = torch.softmax(torch.randn(2, 2 * B, 11), -1)
    w = torch.cat([torch.zeros(1), loss_weights(B)]).repeat(2)[None].expand(2, -1) * (labels != -100)
    soft_ce = -(soft * torch.log_softmax(logits, -1)).sum(-1)
    want = 0.25 * hard + 0.75 * (soft_ce * w).sum() / w.sum()
    got, _ = weighted_block_loss(logits, labels, B, soft=soft, soft_weight=0.75)
    assert torch.allclose(got, want, atol=1e-6)
    assert torch.equal(weighted_block_loss(logits, labels, B, soft=soft, soft_weight=0.0)[0], hard)


def test_trainer_soft_labels_are_the_target_distribution_and_checked():
    """With soft labels only, the training loss is the weighted CE against the target's own distribution (full
    vocabulary); the weight and the teacher are checked before any work."""
    torch.manual_seed(13)
    target = tiny_target()
    draft = tiny_draft(target, block_size=4)
    recs = [record(target, torch.randint(10, V, (n,)), 4) for n in (22, 18)]
    tr = Trainer(draft, target.get_input_embeddings().weight, target.lm_head.weight, total_steps=10,
                 num_anchors=5, seed=0, teacher=TailTeacher(target, 2), soft_label_weight=1.0)
    batch = tr.make_batch(recs)
    loss, _, logits, _ = tr.forward_loss(batch, training=True)
    w = torch.cat([torch.zeros(1), loss_weights(4)]).repeat(batch.labels.shape[1] // 4)[None] * (batch.labels != -100)
    with torch.no_grad():
        full = [torch.softmax(target(r["ids"][None, :-1].long()).logits[0], -1) for r in recs]
    rows = (batch.position_ids[:, batch.ctx_len:] - 1).clamp(min=0)
    want_soft = torch.stack([full[i][rows[i].clamp(max=len(full[i]) - 1)] for i in range(2)])
    want = (-(want_soft * torch.log_softmax(logits.float(), -1)).sum(-1) * w).sum() / w.sum()
    assert torch.allclose(loss, want, atol=1e-5), (loss, want)
    hard_loss, _, _, _ = Trainer(draft, target.get_input_embeddings().weight, target.lm_head.weight,
                                 total_steps=10).forward_loss(batch, training=True)
    assert not torch.allclose(loss, hard_loss)
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="soft_label_weight must be in 0..1"):
            Trainer(draft, target.get_input_embeddings().weight, target.lm_head.weight, teacher=TailTeacher(target, 2),
                    soft_label_weight=bad)
    with pytest.raises(ValueError, match="needs a teacher"):
        Trainer(draft, target.get_input_embeddings().weight, target.lm_head.weight, soft_label_weight=0.5)


def test_fit_refuses_a_soft_label_weight_outside_0_1_before_any_work(tmp_path, capsys):
    from dflash_apps.train import main as train_main

    assert train_main(["fit", "--soft-labels", "1.5", "--out", str(tmp_path / "run")]) == 2
    assert "--soft-labels must be in 0..1" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_decode_walk_gives_the_runtimes_rounds():
    """Trainer.walk_rounds on records whose responses are the target's greedy outputs: the rounds (tokens committed
    each) that both runtimes make decoding those prompts, round for round, for the whole response and for a decode
    that ends inside it (blocks cut short near the end); a trained draft, so rounds longer than one occur. With
    every id as a permuted vocabulary subset: the same rounds. walk_tau_est pools them as the runtimes' τ."""
    from dflash import generate
    from dflash_apps.train.vocab import with_draft_vocab

    from helpers.tiny_models import make_target

    torch.manual_seed(0)
    target = make_target("qwen3")
    with torch.no_grad():  # an expressive head: confident, varied greedy continuations
        target.lm_head.weight.normal_(0.0, 0.5)
    g = torch.Generator().manual_seed(1)
    recs = []
    for n in (5, 7):
        prompt = torch.randint(MASK + 1, 48, (1, n), generator=g)
        ids = target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=20, do_sample=False)[0]
        recs.append(record(target, ids, n))
    draft = DFlashDraftModel(make_draft_config(target.config, num_layers=1, block_size=4, mask_token_id=MASK,
                                               target_layer_ids=[1, 2]))
    tr = Trainer(draft, target.get_input_embeddings().weight, target.lm_head.weight, lr=3e-3, total_steps=60,
                 num_anchors=16, seed=0)
    for _ in range(60):
        tr.train_step(recs)
    subset = Trainer(with_draft_vocab(draft, torch.randperm(target.config.vocab_size)),
                     target.get_input_embeddings().weight, target.lm_head.weight)
    pooled = []
    for tokens in (20, 11):
        for rec in recs:
            walked = tr.walk_rounds(rec, tokens)
            assert sum(walked) == tokens - 1  # the first new token comes from the prefill
            assert subset.walk_rounds(rec, tokens) == walked
            prompt = rec["ids"][None, :rec["prompt_len"]].long()
            for backend in ("reference", "fast"):
                assert generate(target, draft, prompt, tokens, backend=backend).acceptance_lengths == walked, backend
            if tokens == 20:
                pooled += walked
    assert max(pooled) > 1, pooled
    ev = tr.evaluate(recs, walk_tokens=20)
    assert ev["walk_rounds"] == len(pooled) and ev["walk_tau_est"] == pytest.approx(sum(pooled) / len(pooled))
    with pytest.raises(ValueError, match="walk_tokens must be an integer >= 0"):
        tr.evaluate(recs, walk_tokens=-1)
