"""Draft vocabulary from the training data: the most frequent response tokens, as few as cover a
target share of all response-token occurrences: the draft's LM head is most of its CPU cost.

Proposals outside the subset are impossible, never wrong: verification keeps the output exactly the
target's, a token the draft cannot propose only ends that round's accepted prefix. The share of
held-out response tokens inside the subset (its coverage) is therefore an upper bound on how often
the subset is what stops acceptance, and the number to report.

DFlash drafts only: a DFlash2 draft keeps the full vocabulary (refused with a ValueError), since its selector's
codebooks have a row per target token and the runtimes (here, vLLM, SGLang) take its candidates from the full LM
head; speculators refuses pruned DFlash2 vocabularies too.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Iterable

import torch

from dflash.model import DFlashDraftModel


def response_token_counts(records: Iterable[dict], vocab: int) -> torch.Tensor:
    """[vocab] int64 occurrences of each token id among the records' response tokens (``ids[prompt_len:]``)."""
    counts = torch.zeros(vocab, dtype=torch.int64)
    for r in records:
        ids = r["ids"][r["prompt_len"]:].long()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            raise ValueError(f"records: token ids must lie in [0, {vocab}), got {int(ids.min())}..{int(ids.max())}; "
                             "pass the target's vocabulary size")
        counts += torch.bincount(ids, minlength=vocab)
    return counts


def choose_subset(counts: torch.Tensor, *, coverage: float | None = None, size: int | None = None) -> torch.Tensor:
    """Sorted token ids: the ``size`` most frequent, or the fewest most frequent covering at least
    ``coverage`` of all occurrences. Ties in frequency go to the smaller id (deterministic)."""
    if (coverage is None) == (size is None):
        raise ValueError("choose_subset: give exactly one of coverage= (a share in (0, 1]) or size= (a count >= 1)")
    total = int(counts.sum())
    if total == 0:
        raise ValueError("choose_subset: the records hold no response tokens")
    # stable sort on descending counts keeps ascending ids within a tie
    order = torch.sort(-counts, stable=True).indices
    if size is not None:
        if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= counts.numel():
            raise ValueError(f"choose_subset: size must be an int in [1, {counts.numel()}], got {size!r}")
        k = size
    else:
        if not 0 < coverage <= 1:
            raise ValueError(f"choose_subset: coverage must be in (0, 1], got {coverage!r}")
        covered = torch.cumsum(counts[order], 0)
        k = int(torch.searchsorted(covered, torch.tensor(coverage * total, dtype=torch.float64).ceil().long())) + 1
    return torch.sort(order[:k]).values


def coverage_of(ids: torch.Tensor, counts: torch.Tensor) -> float:
    """Share of the occurrences in ``counts`` whose token is in ``ids``."""
    return float(counts[ids].sum()) / max(int(counts.sum()), 1)


def check_subset_allowed(draft: DFlashDraftModel, source: str = "draft") -> None:
    """Refuses a DFlash2 draft (see the module docstring)."""
    if draft.config.dflash2 is not None:
        raise ValueError(f"{source}: a DFlash2 draft keeps the full target vocabulary (its candidate selector has a "
                         "codebook row per target token and ranks the full LM head's top-k); use the draft as it is, "
                         "vocab subsets are for DFlash drafts")


def with_draft_vocab(draft: DFlashDraftModel, ids: torch.Tensor) -> DFlashDraftModel:
    """A copy of ``draft`` (full vocabulary) whose LM head scores only ``ids``; same network weights."""
    check_subset_allowed(draft)
    if draft.config.draft_vocab_size is not None:
        raise ValueError("draft: it already has a vocabulary subset; start from its full-vocabulary checkpoint")
    config = dataclasses.replace(draft.config, draft_vocab_size=int(ids.numel()))
    sub = DFlashDraftModel(config).to(draft.fc.weight.dtype)
    sub.load_state_dict({**draft.state_dict(), "draft_token_ids": ids.long()}, strict=True)
    sub.set_draft_vocab(ids.long())
    return sub


def vocab_main(args) -> int:
    from dflash_apps.train.data import load_dataset

    draft = DFlashDraftModel.from_pretrained(args.draft, dtype=torch.float32)
    check_subset_allowed(draft, args.draft)
    included = []
    for folder in args.include:
        other = DFlashDraftModel.from_pretrained(folder, dtype=torch.float32)
        if other.config.draft_vocab_size is None:
            raise ValueError(f"--include {folder}: that draft has no vocabulary subset to include")
        included.append(other.draft_token_ids.long())
    vocab = args.vocab or draft.config.vocab_size
    if vocab is None:
        raise SystemExit(f"vocab: {args.draft}'s config has no vocab_size; pass --vocab (the target's vocabulary size)")
    train = response_token_counts(load_dataset(args.data, max_shards=args.max_shards), vocab)
    coverage = 0.999 if args.coverage is None and args.size is None else args.coverage
    ids = choose_subset(train, coverage=coverage, size=args.size)
    chosen = ids.numel()
    ids = torch.unique(torch.cat([ids] + included))
    line = f"draft vocabulary: {ids.numel()} of {vocab} ids"
    if args.include:
        line += f" ({chosen} chosen from the data, the rest from {', '.join(args.include)})"
    line += f", {coverage_of(ids, train):.4%} of {int(train.sum())} train response tokens"
    if args.eval:
        held = response_token_counts(load_dataset(args.eval), vocab)
        line += f", {coverage_of(ids, held):.4%} of {int(held.sum())} held-out ones"
    sub = with_draft_vocab(draft, ids)
    sub.to(torch.bfloat16).save_pretrained(args.out)
    print(line)
    print(f"wrote {args.out}")
    return 0


def add_vocab_args(sub) -> None:
    from dflash_apps.smollm2 import cache_path

    v = sub.add_parser("vocab", help="give a full-vocabulary draft a vocabulary subset chosen from the data")
    v.add_argument("draft", help="full-vocabulary draft folder")
    v.add_argument("out", help="destination folder (bf16 z-lab layout with draft_token_ids)")
    v.add_argument("--data", default=os.path.join(cache_path("data", "smollm2"), "train"),
                   help="training data folder (default: %(default)s)")
    v.add_argument("--max-shards", type=int, default=None, help="use only the first N train shards")
    v.add_argument("--vocab", type=int, default=None, help="target vocabulary size (default: the draft config's)")
    v.add_argument("--eval", default=None, help="held-out data folder: report the subset's coverage there too")
    v.add_argument("--include", action="append", default=[],
                   help="a draft folder with a vocabulary subset whose ids are kept too (e.g. the shipped draft's, "
                        "chosen on other data); repeatable")
    group = v.add_mutually_exclusive_group()
    group.add_argument("--coverage", type=float, default=None, help="share of response tokens to cover (default 0.999)")
    group.add_argument("--size", type=int, default=None, help="exact number of ids instead")
    v.set_defaults(func=vocab_main)
