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


def assert_slots(pm: torch.Tensor, live: list[int], max_splits: int) -> None:
    """The slots the split kernel wrote = request r's active context splits and the block slot (the last)."""
    assert pm.shape[1] == max_splits + 1
    for r, rows in enumerate(live):
        a = da.active_splits(rows, max_splits)
        written = [bool((~torch.isnan(pm[r, s])).all()) for s in range(max_splits + 1)]
        assert written == [s < a or s == max_splits for s in range(max_splits + 1)], (r, rows, a, written)
