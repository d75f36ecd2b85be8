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


def assert_slots(partials, live: list[int], max_splits: int, kv_heads: int) -> None:
    """The slots the split kernel wrote: for request r and each KV head, A - 1 whole slots among its active
    splits 0..A-1 (the last split to finish merges from its registers; which one is last is up to the GPU's
    schedule), none with A = 1 (that split stores the output itself), none in the inactive splits; acc, max
    and sum alike."""
    for t in partials:
        assert t.shape[1] == max_splits
        for r, rows in enumerate(live):
            a = da.active_splits(rows, max_splits)
            assert da.partial_slots(rows, max_splits) == a - 1
            # [S, B, nH, ...] -> [S, kvH, everything of one (split, KV head) slot]
            nan = torch.isnan(t[r].unflatten(2, (kv_heads, -1)).transpose(1, 2).reshape(max_splits, kv_heads, -1))
            written = ~nan.any(-1)
            assert (written | nan.all(-1)).all(), (r, rows, "a slot partly written")
            assert (written[:a].sum(0) == a - 1).all() and not written[a:].any(), (r, rows, a, written.tolist())


def run_splits_in_order(monkeypatch, order) -> None:
    """Make the interpreter run the split programs of each (request, KV head) in ``order(S)`` (a permutation
    of the grid's S split indices): the program at position z runs as split ``order(S)[z]``."""
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    set_idx = type(builder).set_grid_idx.__get__(builder)  # the class's: an earlier call's patch is replaced
    monkeypatch.setattr(builder, "set_grid_idx", lambda x, y, z: set_idx(x, y, order(builder.grid_dim[2])[z]))


def merger(order: list[int], active: int) -> int:
    """The split that merges when the splits run in ``order``: the last active one to run."""
    return [s for s in order if s < active][-1]
