"""Observe the attention kernels' split slots: NaN-filled fp32 partials (a slot read without being written
poisons the output) kept for inspection."""
from __future__ import annotations

import importlib

import torch

da = importlib.import_module("dflash_kernels.draft_attention")  # the package re-exports the function's name


def nan_partials(monkeypatch) -> list:
    """Patch the launcher's partial allocation; returns the list each call's (acc, max, sum) is appended to."""
    seen = []
    alloc = da._partials

    def nan_filled(*args):
        out = alloc(*args)
        for t in out:
            t.fill_(float("nan"))
        seen.append(out)
        return out

    monkeypatch.setattr(da, "_partials", nan_filled)
    return seen


def assert_slots(partials, live: list[int], max_splits: int) -> None:
    """The slots the split kernel wrote = request r's active splits 0..A-1, or none when A = 1 (that split
    stores the output itself); acc, max and sum alike."""
    for t in partials:
        assert t.shape[1] == max_splits
        for r, rows in enumerate(live):
            a = da.active_splits(rows, max_splits)
            assert da.partial_slots(rows, max_splits) == (0 if a == 1 else a)
            nan = [torch.isnan(t[r, s]) for s in range(max_splits)]
            written = ["all" if not x.any() else "none" if x.all() else "part" for x in nan]
            assert written == ["all" if 1 < a and s < a else "none" for s in range(max_splits)], (r, rows, a, written)
