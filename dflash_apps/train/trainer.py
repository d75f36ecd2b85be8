"""The training loop: frozen target embedding/LM head, trainable draft (layers, ``fc``, norms; a DFlash2 draft's
convolutions and candidate selector too), AdamW (lr 6e-4, cosine decay, warmup ratio 0.04, grad-clip 1.0),
resumable checkpoints.

``fit --arch dflash2`` trains a DFlash2 draft (:mod:`dflash.dflash2`): the DFlash loss on its logits plus the
selector's K-way loss (:mod:`dflash_apps.train.selector`); its convolutions start as identities (base tap 0 = 1,
kernel projection 0), so a DFlash2 draft warm-started from a DFlash draft (``--init FOLDER``) first proposes what
that draft's logits rank best, reranked by a fresh selector whose transition scores start near 0. Evaluation
walks the selector's greedy path, as the runtimes propose, so both kinds of draft are chosen by the same τ.

Checkpoint folder (``--out``):
  ``last.pt``     draft + optimizer state, step, RNG, args, loss history (resume point, rewritten every
                  ``--save-every-min`` minutes and at the end)
  ``best/``       z-lab draft folder (config.json + model.safetensors, fp32) with the best eval τ-estimate
  ``history.jsonl`` one line per log interval (step, loss, lr, grad-norm, per-position accuracy) and per eval
"""
from __future__ import annotations

import json
import math
import os
import random
import time
from types import SimpleNamespace
from typing import Sequence

import torch

import dataclasses

from dflash.config import DRAFT_TOKEN_IDS, DFlash2Settings, DFlashConfig
from dflash.dflash2 import GroupedDynamicCausalConv
from dflash.model import DFlash2DraftModel, DFlashDraftModel
from dflash_apps.cli import device_arg
from dflash_apps.train.blocks import (
    acceptance_lengths,
    default_gamma,
    draft_forward_dense,
    draft_forward_flex,
    pack_batch,
    sample_anchors,
    tree_acceptance_lengths,
    weighted_block_loss,
)
from dflash_apps.train.data import load_plain
from dflash_apps.train.selector import selector_loss, selector_path_acceptance
from dflash_apps.train.teacher import TailTeacher, soft_targets

SMOLLM2_MASK_TOKEN_ID = 16  # "<empty_output>": a special token that never occurs in normal text
# DFlash2 settings for SmolLM2-135M (H = 576, vocabulary 49,152): the published drafts' taps, group and top-k
# (K = 2, G = 16, k = 16), and a smaller rank than their 256 (chosen for H = 4096-6656): the two codebooks are
# vocabulary x rank, so rank 64 is 6.3 M parameters, about the 2-layer draft's own 7.75 M (rank 256: 25 M, three
# times the draft, with its Adam state, on a CPU), still 64 dims for a transition over 16 candidates.
SMOLLM2_DFLASH2 = DFlash2Settings(conv_kernel_size=2, conv_group_size=16, selector_rank=64, selector_top_k=16)


def lr_at(step: int, total: int, lr: float, warmup_ratio: float, min_ratio: float = 0.0) -> float:
    """Linear warmup over ``warmup_ratio·total`` steps, then cosine decay to ``min_ratio·lr`` at ``total``."""
    warm = max(1, int(round(warmup_ratio * total)))
    if step < warm:
        return lr * (step + 1) / warm
    t = min(1.0, (step - warm) / max(1, total - warm))
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def make_draft_config(target_config, *, num_layers: int, block_size: int, mask_token_id: int,
                      target_layer_ids=None, intermediate_size: int | None = None,
                      dflash2: DFlash2Settings | None = None) -> DFlashConfig:
    """The config of a draft for ``target_config`` (a DFlash2 draft's with ``dflash2`` settings)."""
    tc = target_config
    rope = dict(getattr(tc, "rope_parameters", None) or {"rope_type": "default", "rope_theta": getattr(tc, "rope_theta", 10000.0)})
    return DFlashConfig(
        hidden_size=tc.hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=tc.num_key_value_heads,
        head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads,
        intermediate_size=intermediate_size or tc.intermediate_size,
        rms_norm_eps=float(tc.rms_norm_eps),
        max_position_embeddings=int(tc.max_position_embeddings),
        rope_parameters={"rope_type": rope.get("rope_type", "default"), "rope_theta": float(rope["rope_theta"])},
        num_target_layers=tc.num_hidden_layers,
        vocab_size=tc.vocab_size,
        tie_word_embeddings=bool(getattr(tc, "tie_word_embeddings", False)),
        block_size=block_size,
        mask_token_id=mask_token_id,
        target_layer_ids=target_layer_ids,
        dflash2=dflash2,
    )


def build_draft(config: DFlashConfig) -> DFlashDraftModel:
    """A freshly initialised draft of ``config``: a DFlash2 draft's convolutions are identities (zero kernel
    projections: the layers compute what DFlash layers do) and its selector is random (N(0, 0.02) codebooks and
    projection: transition scores near 0, so the walk starts as the logits' argmax)."""
    if config.dflash2 is None:
        return DFlashDraftModel(config)
    draft = DFlash2DraftModel(config)
    with torch.no_grad():
        for module in draft.modules():
            if isinstance(module, GroupedDynamicCausalConv):
                module.reset_base_kernel()
                module.kernel_projection.weight.zero_()
    return draft


@torch.no_grad()
def init_from_target(draft: DFlashDraftModel, target, layer_ids) -> None:
    """Warm start: copy target decoder layers ``layer_ids`` into the draft layers (attention, MLP, norms;
    q_norm/k_norm stay 1), the target's final norm into ``draft.norm``, and ``fc`` = identity on the
    last tap (zeros elsewhere) so the fused context starts as the deepest tapped hidden state."""
    H = draft.config.hidden_size
    for dl, tl in zip(draft.layers, layer_ids):
        src = target.model.layers[tl]
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(dl.self_attn, name).weight.copy_(getattr(src.self_attn, name).weight)
        if dl.mlp.gate_proj.weight.shape == src.mlp.gate_proj.weight.shape:
            for name in ("gate_proj", "up_proj", "down_proj"):
                getattr(dl.mlp, name).weight.copy_(getattr(src.mlp, name).weight)
        dl.input_layernorm.weight.copy_(src.input_layernorm.weight)
        dl.post_attention_layernorm.weight.copy_(src.post_attention_layernorm.weight)
    draft.norm.weight.copy_(target.model.norm.weight)
    draft.fc.weight.zero_()
    draft.fc.weight[:, -H:].copy_(torch.eye(H))


@torch.no_grad()
def init_from_draft(draft: DFlashDraftModel, folder: str) -> None:
    """Warm start from a trained z-lab draft folder of the same shape (its network weights; a draft vocabulary
    subset, if it has one, is not part of training and is dropped). A DFlash2 draft also starts from a DFlash
    draft's folder: the parts both have are copied, its convolutions and selector keep their initialisation
    (:func:`build_draft`). A deeper draft starts from a shallower one (:func:`_deepened`): it first computes
    exactly what the folder's draft does, so training adds capacity without losing what was learnt; so does one
    tapping more target layers than the folder's draft (:func:`_widened`: the added taps start unread)."""
    source = DFlashDraftModel.from_pretrained(folder, dtype=torch.float32)  # any stored layout
    taps, wanted = source.config.target_layer_ids, draft.config.target_layer_ids
    if not set(taps) <= set(wanted):
        raise ValueError(f"--init {folder}: it taps target layers {list(taps)}, the draft being trained "
                         f"{list(wanted)}; --target-layer-ids must name all of its taps (more may be added)")
    state = source.state_dict()
    state.pop(DRAFT_TOKEN_IDS, None)
    state = _deepened(state, len(draft.layers))
    state = _widened(state, taps, wanted, draft.config.hidden_size)
    own = draft.state_dict()
    dflash2_only = set(draft.config.expected_weight_shapes()) - set(
        dataclasses.replace(draft.config, dflash2=None).expected_weight_shapes())
    missing = set(own) - set(state)
    if (set(state) - set(own) or (missing and missing != dflash2_only)
            or any(state[k].shape != own[k].shape for k in state)):
        raise ValueError(f"--init {folder}: its weights do not match the draft being trained (the same or more "
                         f"--layers, the same --block-size and --target-layer-ids needed; a DFlash2 draft starts "
                         f"from a DFlash or DFlash2 draft, a DFlash draft from a DFlash draft)")
    draft.load_state_dict({k: v.to(own[k].dtype) for k, v in state.items()}, strict=False)


def _widened(state: dict, taps: list[int], wider: list[int], hidden: int) -> dict:
    """``state`` (a draft tapping target layers ``taps``) for a draft tapping ``wider``, a superset: its ``fc``
    columns moved to their taps' places among ``wider`` and zero columns for the added taps, so the wider draft's
    context rows (``hidden_norm(fc(features))``) start as the folder draft's. The same taps in the same order, or
    an ``fc`` of another shape (which then fails the shape check): ``state`` as it is."""
    if list(taps) == list(wider) or state["fc.weight"].shape[1] != len(taps) * hidden:
        return state
    fc = state["fc.weight"].new_zeros(state["fc.weight"].shape[0], len(wider) * hidden)
    for j, layer in enumerate(taps):
        i = list(wider).index(layer)
        fc[:, i * hidden:(i + 1) * hidden] = state["fc.weight"][:, j * hidden:(j + 1) * hidden]
    return {**state, "fc.weight": fc}


def _deepened(state: dict, layers: int) -> dict:
    """``state`` with layers appended up to ``layers``: copies of its last layer whose output projections
    (attention ``o_proj``, MLP ``down_proj``) are zero, so each added layer adds nothing to the residual stream
    and the deeper draft's output is the shallower one's (its other weights start from trained values, not
    noise). A state with ``layers`` or more layers is returned as it is."""
    prefix = "layers."
    have = 1 + max(int(k.split(".")[1]) for k in state if k.startswith(prefix))
    last = {k[len(f"{prefix}{have - 1}."):]: v for k, v in state.items() if k.startswith(f"{prefix}{have - 1}.")}
    state = dict(state)
    for i in range(have, layers):
        for name, w in last.items():
            zero = name.endswith(("o_proj.weight", "down_proj.weight"))
            state[f"{prefix}{i}.{name}"] = torch.zeros_like(w) if zero else w.clone()
    return state


def _labels_in(labels: torch.Tensor, ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """Target-vocabulary labels as indices into ``ids`` (a head of those rows); -100 (ignored) outside them."""
    remap = torch.full((vocab,), -100, dtype=torch.long)
    remap[ids.cpu()] = torch.arange(len(ids))
    return torch.where(labels >= 0, remap[labels.clamp(min=0).cpu()].to(labels.device), labels)


def check_soft_label_weight(weight: float, name: str) -> None:
    """The soft labels' share of the loss must be in 0..1; ``name`` is the argument as the caller knows it."""
    if not 0.0 <= weight <= 1.0:
        raise ValueError(f"{name} must be in 0..1 (the soft labels' share of the loss), got {weight}")


def check_walk_tokens(tokens: int, name: str) -> None:
    """The decode walk's new tokens per sequence: 0 (no walk) or more; ``name`` as the caller knows it."""
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise ValueError(f"{name} must be an integer >= 0 (new tokens a sequence; 0 skips the walk), got {tokens!r}")


class Trainer:
    def __init__(self, draft: DFlashDraftModel, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor, *,
                 lr: float = 6e-4, weight_decay: float = 0.0, warmup_ratio: float = 0.04, grad_clip: float = 1.0,
                 total_steps: int = 1000, gamma: float | None = None, num_anchors: int = 16,
                 attention: str = "dense", seed: int = 0, vocab_subset: torch.Tensor | None = None,
                 negatives: int = 0, selector_loss_weight: float = 1.0, teacher: TailTeacher | None = None,
                 soft_label_weight: float = 0.0):
        """``selector_loss_weight``: a DFlash2 draft's loss is the DFlash loss + this x the selector's.
        ``teacher``, ``soft_label_weight``: training rows also learn the target's distribution (soft labels, weight
        in 0..1 against the hard label's; :func:`~dflash_apps.train.blocks.weighted_block_loss`); evaluation loss
        stays the hard labels' CE, comparable across objectives."""
        check_soft_label_weight(soft_label_weight, "soft_label_weight")
        if soft_label_weight and teacher is None:
            raise ValueError("soft_label_weight > 0 needs a teacher (TailTeacher of the target) for the soft labels")
        self.draft = draft
        self.selector_loss_weight = selector_loss_weight
        self.teacher, self.soft_label_weight = teacher, soft_label_weight
        # Frozen, shared with the target: never updated (no grad, not in the optimizer).
        self.embed_weight = embed_weight.detach().requires_grad_(False)
        self.lm_head_weight = lm_head_weight.detach().requires_grad_(False)
        self.params = [p for p in draft.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)
        self.lr, self.warmup_ratio, self.grad_clip = lr, warmup_ratio, grad_clip
        self.total_steps = total_steps
        self.B = draft.config.block_size
        self.gamma = default_gamma(self.B) if gamma is None else gamma
        self.num_anchors = num_anchors
        self.mask_id = draft.config.mask_token_id
        self.attention = attention
        self.step = 0
        self.gen = torch.Generator().manual_seed(seed)
        self.negatives = negatives
        self.set_vocab_subset(vocab_subset)

    def set_vocab_subset(self, subset: torch.Tensor | None) -> None:
        """Restrict the training softmax to ``subset`` token ids (plus ``negatives`` random other ids per
        step). ``None`` = the full vocabulary (exact loss). Evaluation always uses the full vocabulary."""
        self.vocab_subset = None if subset is None else torch.unique(subset.long())

    def _head_for_step(self, labels: torch.Tensor, training: bool):
        """``(head rows, labels as indices into them, the rows' token ids or None for the whole head)``."""
        V = self.lm_head_weight.shape[0]
        if self.vocab_subset is None or not training:
            return self.lm_head_weight, labels, None
        ids = self.vocab_subset
        if self.negatives:
            extra = torch.randint(0, V, (self.negatives,), generator=self.gen)
            ids = torch.unique(torch.cat([ids, extra, labels[labels >= 0].unique()]))
        else:
            ids = torch.unique(torch.cat([ids, labels[labels >= 0].unique()]))
        return self.lm_head_weight[ids.to(self.lm_head_weight.device)], _labels_in(labels, ids, V), ids

    def _hidden(self, batch) -> torch.Tensor:
        if self.attention == "flex":
            return draft_forward_flex(self.draft, batch, self.embed_weight)
        return draft_forward_dense(self.draft, batch, self.embed_weight)

    def _scores(self, hidden: torch.Tensor, labels: torch.Tensor, training: bool):
        """``(logits, labels as indices into their columns, the columns' token ids or None for the whole head)``
        of the draft's hidden states: over its own vocabulary subset where it has one, else over the step's
        training subset (:meth:`_head_for_step`; the whole head when not training)."""
        if self.draft.vocab_ids is not None:
            # A draft with its own vocabulary subset scores only those ids, as at inference: its logits index
            # them; a label outside them is left out of the loss (and never matched by evaluate).
            logits = self.draft.compute_logits(hidden, SimpleNamespace(weight=self.lm_head_weight))
            labels = _labels_in(labels, self.draft.vocab_ids, self.lm_head_weight.shape[0])
            columns = self.draft.vocab_ids
        else:
            head, labels, columns = self._head_for_step(labels, training)
            logits = self.draft.compute_logits(hidden, lambda h: h @ head.T)
        return logits, labels.to(logits.device), columns

    def forward_loss(self, batch, training: bool = False):
        """``(loss, hidden, logits, stats)`` of a packed batch: the position-weighted loss (a DFlash2 draft's:
        plus its selector's, also in ``stats["selector_loss"]``), the draft's hidden states and logits (over the
        step's vocabulary subset when training with one)."""
        hidden = self._hidden(batch)
        logits, labels, columns = self._scores(hidden, batch.labels, training)
        soft = None
        if training and self.soft_label_weight:
            head_w = self.lm_head_weight
            rows = head_w if columns is None else head_w[columns.to(head_w.device)]
            taught = self.teacher.hidden(batch.target_hidden, self.draft.config.target_layer_ids)
            soft = soft_targets(taught, batch.position_ids, batch.ctx_len, rows.to(taught.dtype)).to(logits.device)
        loss, stats = weighted_block_loss(logits, labels, self.B, self.gamma, soft, self.soft_label_weight)
        if self.draft.config.dflash2 is not None:
            extra, _ = selector_loss(self.draft.candidate_selector, logits, hidden, batch.block_ids.to(logits.device),
                                     labels, batch.labels.to(logits.device), self.B, self.gamma, columns)
            loss = loss + self.selector_loss_weight * extra
            stats["selector_loss"] = float(extra.detach())
        return loss, hidden, logits, stats

    def make_batch(self, records):
        anchors = [sample_anchors(r["prompt_len"], len(r["ids"]), self.num_anchors, self.gen) for r in records]
        return pack_batch(records, anchors, self.B, self.mask_id)

    def train_step(self, records) -> dict:
        self.draft.train()
        lr = lr_at(self.step, self.total_steps, self.lr, self.warmup_ratio)
        for g in self.opt.param_groups:
            g["lr"] = lr
        batch = self.make_batch(records)
        loss, _, _, stats = self.forward_loss(batch, training=True)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
        self.opt.step()
        self.step += 1
        return {"loss": float(loss.detach()), "lr": lr, "grad_norm": float(gnorm), **stats}

    @torch.no_grad()
    def evaluate(self, records, stride: int = 4, max_anchors: int = 32, tree_budgets: Sequence[int] = (),
                 walk_tokens: int = 0) -> dict:
        """Teacher-forced τ estimate: anchors every ``stride`` response positions, acceptance length =
        1 + leading run of proposals equal to the target's (greedy) continuation; the proposals are the draft's
        argmaxes, a DFlash2 draft's the selector's greedy walk from the anchor. ``tree_budgets``: also the
        estimate of draft trees of each budget (``tree_tau_est``, by budget: :func:`tree_acceptance_lengths` on the
        same blocks; DFlash drafts only, as in the runtimes). ``walk_tokens`` > 0: also ``walk_tau_est``, the
        chain's τ of a greedy decode of that many new tokens per record (:meth:`walk_rounds`), which the evenly
        spaced anchors overstate: a decode's anchors follow its rejections, at the harder positions."""
        check_tree_budgets(self.draft, tree_budgets)
        check_walk_tokens(walk_tokens, "walk_tokens")
        self.draft.eval()
        lens, losses = [], []
        tree_lens: dict[int, list[torch.Tensor]] = {n: [] for n in tree_budgets}
        for i in range(0, len(records), 4):
            recs = records[i:i + 4]
            # (a response shorter than a block has no anchor here; the walk still decodes it)
            anchors = [torch.arange(r["prompt_len"], max(r["prompt_len"], len(r["ids"]) - self.B), stride)[:max_anchors]
                       for r in recs]
            if not any(len(a) for a in anchors):
                continue
            batch = pack_batch(recs, anchors, self.B, self.mask_id)
            loss, hidden, logits, _ = self.forward_loss(batch)
            losses.append(float(loss))
            if self.draft.config.dflash2 is not None:
                lens.append(selector_path_acceptance(self.draft, hidden, logits, batch.block_ids, batch.labels))
                continue
            pred = logits.argmax(-1)
            if self.draft.vocab_ids is not None:  # indices into the draft's own ids -> target ids
                pred = self.draft.vocab_ids.to(pred.device)[pred]
            lens.append(acceptance_lengths(pred, batch.labels, self.B))
            if tree_budgets:
                trees = tree_acceptance_lengths(logits, batch.labels, self.B, tree_budgets,
                                                vocab_ids=self.draft.vocab_ids)
                for n, got in tree_lens.items():
                    got.append(trees[n])
        all_len = torch.cat(lens) if lens else torch.zeros(1)
        out = {"eval_loss": sum(losses) / max(1, len(losses)), "tau_est": float(all_len.mean()),
               "eval_blocks": int(all_len.numel())}
        if tree_budgets:
            out["tree_tau_est"] = {n: float((torch.cat(got) if got else torch.zeros(1)).mean())
                                   for n, got in tree_lens.items()}
        if walk_tokens:
            rounds = [c for r in records for c in self.walk_rounds(r, walk_tokens)]
            out["walk_tau_est"] = sum(rounds) / max(1, len(rounds))
            out["walk_rounds"] = len(rounds)
        return out

    @torch.no_grad()
    def walk_rounds(self, record, tokens: int) -> list[int]:
        """The tokens each round commits when the chain runtimes decode ``record``'s prompt greedily for
        ``tokens`` new tokens (as ``GenerateResult.acceptance_lengths``), teacher-forced: the record's response
        is the target's greedy output, so round by round the anchor, the context and the block are the
        runtime's (a block of v = min(B, positions left) rows near the end), and a round commits its accepted
        proposals and the bonus token, up to the last position (``tokens`` in, or the response's end: its stop
        token, or where the data's own decode stopped)."""
        self.draft.eval()
        P, B = record["prompt_len"], self.B
        last = min(P + tokens, len(record["ids"])) - 1  # the last position the decode commits
        full = list(range(P, min(last, P + tokens - B + 1)))  # the anchors whose block has all B rows
        accepted = dict(zip(full, self._accepted(record, full, B))) if full else {}
        a, rounds = P, []
        while a < last:
            v = min(B, P + tokens - a)  # the runtime's block rows (labels past the response's end match nothing)
            if a not in accepted:
                accepted[a] = self._accepted(record, [a], v)[0]
            rounds.append(min(accepted[a] + 1, last - a))
            a += rounds[-1]
        return rounds

    def _accepted(self, record, anchors: list[int], v: int) -> list[int]:
        """For blocks of ``v`` rows at ``anchors`` of one record: how many of the v - 1 proposals lead in a run
        equal to the record's next tokens (proposals as in :meth:`evaluate`)."""
        batch = pack_batch([record], [torch.tensor(anchors)], v, self.mask_id)
        hidden = self._hidden(batch)
        logits = self._scores(hidden, batch.labels, training=False)[0]
        if self.draft.config.dflash2 is not None:
            pred, _, _ = self.draft.candidate_selector.select(
                hidden.view(len(anchors), v, -1)[:, 1:], logits.view(len(anchors), v, -1)[:, 1:],
                batch.block_ids.view(len(anchors), v)[:, 0].to(logits.device))
        else:
            pred = logits.argmax(-1).view(len(anchors), v)[:, 1:]
            if self.draft.vocab_ids is not None:
                pred = self.draft.vocab_ids.to(pred.device)[pred]
        labels = batch.labels.view(len(anchors), v)[:, 1:].to(pred.device)
        return ((pred == labels) & (labels != -100)).long().cumprod(-1).sum(-1).tolist()

    def state_dict(self) -> dict:
        return {"draft": self.draft.state_dict(), "opt": self.opt.state_dict(), "step": self.step,
                "gen": self.gen.get_state(), "py_random": random.getstate()}

    def load_state_dict(self, s: dict) -> None:
        self.draft.load_state_dict(s["draft"])
        self.opt.load_state_dict(s["opt"])
        self.step = int(s["step"])
        self.gen.set_state(s["gen"])
        random.setstate(s["py_random"])


def check_tree_budgets(draft: DFlashDraftModel, tree_budgets: Sequence[int]) -> None:
    """Refuses tree estimates for a DFlash2 draft, before any work: the runtimes build no trees from its walk."""
    if tree_budgets and draft.config.dflash2 is not None:
        raise ValueError("tree budgets need a DFlash draft: a DFlash2 draft proposes one path through its "
                         "candidates and the runtimes build no trees from it; drop --tree-budgets / "
                         "--eval-tree-budgets")


# ------------------------------------------------------------------------------------------------ CLI
def add_fit_args(sub) -> None:
    from dflash_apps.smollm2 import cache_path

    f = sub.add_parser("fit", help="train a draft for SmolLM2-135M on a generated data folder (resumable)")
    f.add_argument("--data", default=cache_path("data", "smollm2"), help="folder written by `dflash train data`")
    f.add_argument("--out", default=cache_path("runs", "smollm2-b8-l2"), help="checkpoint folder (resumes if it has last.pt)")
    f.add_argument("--max-shards", type=int, default=None,
                   help="train on the first N train shards only (fixes the data while `data` is still appending)")
    f.add_argument("--arch", choices=["dflash", "dflash2"], default="dflash",
                   help="draft kind: DFlash, or DFlash2 (grouped dynamic convolutions + candidate selector, trained "
                        "with the selector's K-way loss added)")
    d2 = SMOLLM2_DFLASH2
    f.add_argument("--conv-kernel-size", type=int, default=d2.conv_kernel_size, help="DFlash2: convolution taps K")
    f.add_argument("--conv-group-size", type=int, default=d2.conv_group_size,
                   help="DFlash2: channels sharing one dynamic kernel value G (divides the hidden size)")
    f.add_argument("--selector-rank", type=int, default=d2.selector_rank,
                   help="DFlash2: rank r of the selector's codebooks (vocabulary x r each; 64 for SmolLM2's 576 "
                        "hidden, the published drafts use 256 at 4096+)")
    f.add_argument("--selector-top-k", type=int, default=d2.selector_top_k,
                   help="DFlash2: candidates the selector reranks per position")
    f.add_argument("--selector-loss-weight", type=float, default=1.0,
                   help="DFlash2: weight of the selector's K-way loss beside the DFlash loss")
    f.add_argument("--layers", type=int, default=2)
    f.add_argument("--block-size", type=int, default=8)
    f.add_argument("--gamma", type=float, default=None, help="loss decay γ (default: 7 for B=16, 5 for B=10, 4 for B=8)")
    f.add_argument("--target-layer-ids", default=None, help="comma list of tapped target layers (default rule if unset)")
    f.add_argument("--mask-token-id", type=int, default=SMOLLM2_MASK_TOKEN_ID)
    f.add_argument("--init", default="target",
                   help="draft init: 'target' (copy the target's last layers + final norm; default), 'random', or "
                        "a trained z-lab draft folder of the same architecture (warm start from its weights; with "
                        "more --layers than it has, the added layers start as identities; --target-layer-ids must name "
                        "its taps or more, the added taps start unread)")
    f.add_argument("--steps", type=int, default=4000, help="total optimizer steps (cosine schedule length)")
    f.add_argument("--batch-seqs", type=int, default=8, help="sequences per step")
    f.add_argument("--anchors", type=int, default=16, help="anchors (blocks) per sequence per visit")
    f.add_argument("--lr", type=float, default=6e-4)
    f.add_argument("--weight-decay", type=float, default=0.0)
    f.add_argument("--warmup-ratio", type=float, default=0.04)
    f.add_argument("--grad-clip", type=float, default=1.0)
    f.add_argument("--attention", choices=["dense", "flex"], default="dense",
                   help="dense-mask SDPA (CPU and GPU) or FlexAttention (GPU; no CPU backward in torch 2.13)")
    f.add_argument("--vocab-subset", choices=["full", "data"], default="full",
                   help="training softmax over the full vocabulary (exact, default) or over the tokens that occur "
                        "in the training data plus --negatives random others (≈4-6x cheaper LM head on CPU)")
    f.add_argument("--negatives", type=int, default=2048, help="random extra vocabulary ids per step with --vocab-subset data")
    f.add_argument("--soft-labels", type=float, default=0.0, metavar="WEIGHT",
                   help="share (0..1) of the loss taken by soft labels: the target's own distribution at each "
                        "row, recomputed from the stored features of the deepest tap through the target layers "
                        "after it (0: hard labels only, the paper's recipe)")
    f.add_argument("--eval-seqs", type=int, default=12)
    f.add_argument("--eval-every", type=int, default=100)
    f.add_argument("--eval-tree-budgets", default="",
                   help="comma-separated draft tree budgets: each eval also logs their teacher-forced τ estimates "
                        "(best/ is still chosen by the chain's)")
    f.add_argument("--eval-walk-tokens", type=int, default=96,
                   help="each eval also logs the chain's τ of a greedy decode of this many new tokens per eval "
                        "sequence, teacher-forced (walk_tau_est: what the runtimes measure; 0: skip)")
    f.add_argument("--log-every", type=int, default=10)
    f.add_argument("--save-every-min", type=float, default=5.0)
    f.add_argument("--max-minutes", type=float, default=None, help="stop (after saving) when this wall time is used")
    f.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's, i.e. all cores)")
    f.add_argument("--seed", type=int, default=0)
    f.add_argument("--device", default="cpu")
    f.set_defaults(func=fit_main)


def add_export_args(sub) -> None:
    e = sub.add_parser("export", help="export a checkpoint (last.pt or a z-lab folder) as a bf16 z-lab draft folder")
    e.add_argument("checkpoint", help="run folder (uses best/ if present, else last.pt) or a z-lab folder")
    e.add_argument("out", help="destination folder")
    e.add_argument("--use-last", action="store_true", help="export last.pt even when best/ exists")
    e.set_defaults(func=export_main)


def add_evaluate_args(sub) -> None:
    from dflash_apps.smollm2 import cache_path

    v = sub.add_parser("evaluate", help="teacher-forced τ estimate of a draft folder on a data folder")
    v.add_argument("draft")
    v.add_argument("--data", default=os.path.join(cache_path("data", "smollm2"), "eval"))
    v.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's, i.e. all cores)")
    v.add_argument("--tree-budgets", default="",
                   help="comma-separated draft tree budgets: also their teacher-forced τ estimates (tree_tau_est)")
    v.add_argument("--walk-tokens", type=int, default=96,
                   help="also the chain's τ of a greedy decode of this many new tokens per sequence, teacher-forced "
                        "(walk_tau_est; 0: skip)")
    v.set_defaults(func=evaluate_main)


def _budgets(text: str) -> list[int]:
    """``--tree-budgets`` / ``--eval-tree-budgets``: comma-separated positive ints ("" = none)."""
    try:
        budgets = [int(b) for b in text.split(",") if b.strip()]
    except ValueError:
        budgets = None
    if budgets is None or any(b < 1 for b in budgets):
        raise SystemExit(f"tree budgets must be comma-separated positive integers (e.g. 7,15), got {text!r}")
    return budgets


def _fmt(s: float) -> str:
    return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m{int(s % 60):02d}s" if s >= 3600 else f"{int(s // 60)}m{int(s % 60):02d}s"


def _save_atomic(obj, path: str) -> None:
    tmp = path + ".tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def fit_main(args) -> int:
    from dflash_apps import smollm2
    from dflash_apps.train.data import load_dataset

    tree_budgets = _budgets(args.eval_tree_budgets)
    check_walk_tokens(args.eval_walk_tokens, "--eval-walk-tokens")
    check_soft_label_weight(args.soft_labels, "--soft-labels")  # before the target and the data load
    device_arg(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    os.makedirs(args.out, exist_ok=True)
    log_path = os.path.join(args.out, "history.jsonl")

    def log(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    target, _tok = smollm2.load()
    layer_ids = [int(x) for x in args.target_layer_ids.split(",")] if args.target_layer_ids else None
    dflash2 = (DFlash2Settings(args.conv_kernel_size, args.conv_group_size, args.selector_rank, args.selector_top_k)
               if args.arch == "dflash2" else None)
    cfg = make_draft_config(target.config, num_layers=args.layers, block_size=args.block_size,
                            mask_token_id=args.mask_token_id, target_layer_ids=layer_ids, dflash2=dflash2)
    draft = build_draft(cfg)
    check_tree_budgets(draft, tree_budgets)
    if args.init == "target":
        n = target.config.num_hidden_layers
        init_from_target(draft, target, list(range(n - args.layers, n)))
    elif args.init != "random":
        init_from_draft(draft, args.init)
    draft.to(args.device)
    embed = target.get_input_embeddings().weight.detach().float().to(args.device)
    head = target.lm_head.weight.detach().float().to(args.device)
    teacher = None
    if args.soft_labels:
        target.float().to(args.device).requires_grad_(False)
        teacher = TailTeacher(target, max(cfg.target_layer_ids))
    del target
    trainer = Trainer(draft, embed, head, lr=args.lr, weight_decay=args.weight_decay, warmup_ratio=args.warmup_ratio,
                      grad_clip=args.grad_clip, total_steps=args.steps, gamma=args.gamma, num_anchors=args.anchors,
                      attention=args.attention, seed=args.seed,
                      negatives=args.negatives if args.vocab_subset == "data" else 0,
                      selector_loss_weight=args.selector_loss_weight, teacher=teacher,
                      soft_label_weight=args.soft_labels)
    last = os.path.join(args.out, "last.pt")
    best_tau = -1.0
    # Sequences of the current epoch not yet visited; saved with the checkpoint so that a resumed run
    # visits them in the same order as an uninterrupted one.
    order: list[int] = []
    if os.path.isfile(last):
        state = load_plain(last)
        trainer.load_state_dict(state)
        best_tau = state.get("best_tau", -1.0)
        order = list(state.get("epoch_order", []))
        log(f"resumed from {last} at step {trainer.step} (best τ-estimate so far {best_tau:.3f})")
    kind = "DFlash" if dflash2 is None else f"DFlash2 ({dflash2})"
    log(f"draft: {kind}, {cfg.num_hidden_layers} layers, B={cfg.block_size}, γ={trainer.gamma}, taps "
        f"{cfg.target_layer_ids}, mask id {cfg.mask_token_id}, "
        f"{sum(p.numel() for p in draft.parameters()) / 1e6:.2f}M trainable params")

    def load_train():
        recs = load_dataset(os.path.join(args.data, "train"), cfg.target_layer_ids, max_shards=args.max_shards)
        return [r for r in recs if len(r["ids"]) - r["prompt_len"] >= 3]

    def subset_of(recs):
        if args.vocab_subset != "data":
            return None
        toks = torch.cat([r["ids"].long() for r in recs] + [torch.arange(32)])
        return torch.unique(toks)

    train = load_train()
    trainer.set_vocab_subset(subset_of(train))
    if trainer.vocab_subset is not None:
        log(f"vocab subset: {len(trainer.vocab_subset)} ids from the training data + {args.negatives} random per step")
    eval_recs = load_dataset(os.path.join(args.data, "eval"), cfg.target_layer_ids)[: args.eval_seqs]
    log(f"data: {len(train)} train sequences ({sum(len(r['ids']) - r['prompt_len'] for r in train)} response tokens), "
        f"{len(eval_recs)} eval sequences")
    t_start = time.perf_counter()
    t_save = t_start
    acc_c = torch.zeros(args.block_size)
    acc_n = torch.zeros(args.block_size)
    losses: list[float] = []
    selector_losses: list[float] = []
    step_times: list[float] = []
    while trainer.step < args.steps:
        if not order:
            fresh = load_train()
            if len(fresh) != len(train):
                log(f"data: reloaded, now {len(fresh)} train sequences")
                train = fresh
                trainer.set_vocab_subset(subset_of(train))
            order = list(range(len(train)))
            random.shuffle(order)
        idx, order = order[: args.batch_seqs], order[args.batch_seqs:]
        t0 = time.perf_counter()
        out = trainer.train_step([train[i] for i in idx])
        step_times.append(time.perf_counter() - t0)
        losses.append(out["loss"])
        if "selector_loss" in out:
            selector_losses.append(out["selector_loss"])
        acc_c += out["per_k_correct"].cpu()
        acc_n += out["per_k_count"].cpu()
        s = trainer.step
        if s % args.log_every == 0 or s == args.steps:
            acc = (acc_c[1:] / acc_n[1:].clamp(min=1)).tolist()
            sp = sum(step_times) / len(step_times)
            selector = ({"selector_loss": sum(selector_losses) / len(selector_losses)} if selector_losses else {})
            log(f"step {s}/{args.steps} loss {sum(losses) / len(losses):.4f}"
                + "".join(f" (selector {v:.4f})" for v in selector.values()) + f" lr {out['lr']:.2e} "
                f"gnorm {out['grad_norm']:.2f} acc@k1..{args.block_size - 1} "
                + " ".join(f"{a:.2f}" for a in acc) + f" | {sp:.2f} s/step, ETA {_fmt(sp * (args.steps - s))}")
            with open(log_path, "a", encoding="utf-8") as f:
                f.write(json.dumps({"step": s, "loss": sum(losses) / len(losses), **selector, "lr": out["lr"],
                                    "grad_norm": out["grad_norm"], "acc": acc, "time": time.time()}) + "\n")
            losses, selector_losses, step_times = [], [], []
            acc_c.zero_(); acc_n.zero_()
        if eval_recs and (s % args.eval_every == 0 or s == args.steps):
            ev = trainer.evaluate(eval_recs, tree_budgets=tree_budgets, walk_tokens=args.eval_walk_tokens)
            improved = ev["tau_est"] > best_tau
            if improved:
                best_tau = ev["tau_est"]
                draft.save_pretrained(os.path.join(args.out, "best"))
            trees = "".join(f", trees of {n} {t:.3f}" for n, t in ev.get("tree_tau_est", {}).items())
            walk = (f", decode walk {ev['walk_tau_est']:.3f} over {ev['walk_rounds']} rounds"
                    if "walk_tau_est" in ev else "")
            log(f"eval step {s}: loss {ev['eval_loss']:.4f} τ-estimate {ev['tau_est']:.3f}{trees} over "
                f"{ev['eval_blocks']} blocks{walk}"
                + (" (best, saved best/)" if improved else f" (best {best_tau:.3f})"))
            with open(log_path, "a", encoding="utf-8") as f:
                f.write(json.dumps({"step": s, **ev, "time": time.time()}) + "\n")
        now = time.perf_counter()
        timeout = args.max_minutes is not None and (now - t_start) / 60 >= args.max_minutes
        if now - t_save >= args.save_every_min * 60 or s == args.steps or timeout:
            _save_atomic({**trainer.state_dict(), "best_tau": best_tau, "epoch_order": order,
                          "args": vars(args) | {"func": None}, "config": cfg.to_dict()}, last)
            t_save = now
            log(f"checkpoint saved: {last} (step {s})")
        if timeout:
            log(f"--max-minutes {args.max_minutes} reached; stopping (resume with the same command)")
            break
    return 0


def export_main(args) -> int:
    src = args.checkpoint
    best = os.path.join(src, "best")
    last = os.path.join(src, "last.pt")
    if os.path.isfile(os.path.join(src, "config.json")):
        draft = DFlashDraftModel.from_pretrained(src, dtype=torch.float32)
    elif os.path.isdir(best) and not args.use_last:
        draft = DFlashDraftModel.from_pretrained(best, dtype=torch.float32)
    elif os.path.isfile(last):
        state = load_plain(last)
        config = DFlashConfig.from_dict(state["config"], source=last)
        draft = DFlashDraftModel.class_for(config, source=last)(config)
        draft.load_state_dict(state["draft"])
    else:
        raise SystemExit(f"export: no checkpoint in {src} (expected best/, last.pt or config.json)")
    draft.to(torch.bfloat16).save_pretrained(args.out)
    size = os.path.getsize(os.path.join(args.out, "model.safetensors"))
    print(f"exported {args.out} ({size / 1e6:.1f} MB bf16)")
    return 0


def evaluate_main(args) -> int:
    from dflash_apps import smollm2
    from dflash_apps.train.data import load_dataset

    tree_budgets = _budgets(args.tree_budgets)
    check_walk_tokens(args.walk_tokens, "--walk-tokens")
    if args.threads:
        torch.set_num_threads(args.threads)
    draft = DFlashDraftModel.from_pretrained(args.draft, dtype=torch.float32)
    check_tree_budgets(draft, tree_budgets)
    target, _ = smollm2.load()
    trainer = Trainer(draft, target.get_input_embeddings().weight.float(), target.lm_head.weight.float())
    recs = load_dataset(args.data, draft.config.target_layer_ids)
    print(json.dumps(trainer.evaluate(recs, tree_budgets=tree_budgets, walk_tokens=args.walk_tokens)))
    return 0
