"""Device-side bookkeeping of one speculative decoding round: ``commit_round``.

After verification (``verify_greedy`` or the sampled verifier) each request ``r`` of a ragged
batch has ``accepted[r]`` accepted drafts and a ``bonus[r]`` token. ``commit_round`` appends the
emitted tokens to each request's output buffer, advances its length and position, sets the next
anchor, reports how many new context rows the draft model gets, and finishes requests that hit a
stop token or their length limit -- with no host synchronisation (one kernel launch with
``backend="ext"`` on CUDA), so a decode step stays capturable in a CUDA graph.

Definition (per request ``r`` with ``done[r] == False``; done requests are left untouched and
get ``num_new[r] = 0``)::

    a       = accepted[r]                      # 0 <= a <= B-1
    L       = lengths[r]                       # 0 <= L <= capacity
    e[0..a] = draft_tokens[r, :a] + [bonus[r]] # the a+1 candidate tokens of this round
    s       = 1 + (index of the first e[j] in stop_tokens(r)), or a+1 if there is none
    n       = min(s, max(max_lengths[r] - L, 0))
    out_tokens[r, L:L+n] = e[:n]               # nothing else of out_tokens is written
    lengths[r]   += n
    positions[r] += n
    anchor[r]     = e[n-1]                     # unchanged if n == 0
    done[r]       = (e[s-1] is a stop token and n == s) or lengths[r] >= max_lengths[r]
    num_new[r]    = n

``n`` is the number of tokens committed, which is also the number of new context rows for the
draft model (the target hidden states of the anchor and the ``n-1`` committed drafts: rows
``0..n-1`` of this round's verify block). It equals ``accepted[r] + 1`` unless the request
finished in this round. ``positions[r]`` stays the position of ``anchor[r]``.

``draft_round_setup`` is the draft step's side of the same bookkeeping, one launch for what the
draft needs from the committed state (per request ``r``, block size ``B = block.shape[1]``)::

    block[r, 0]      = anchor[r]                                   # [anchor, MASK, ...] is drafted
    context_start[r] = positions[r] - num_new[r]                   # first of last round's new context rows
    block_lens[r]    = min(max(max_lengths[r] - positions[r], 1), B)  # rows the reference would draft
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from dflash_kernels._dispatch import call_op, checked_by, registered, resolve_backend
from dflash_kernels._triton_utils import check_tensor, next_pow2

__all__ = ["commit_round", "commit_round_reference", "CommitRoundInputError", "draft_round_setup",
           "draft_round_setup_reference", "first_token_done"]

_OP = "commit_round"
_BACKENDS = ("ext", "torch")  # and the wings' registered bodies (dflash_kernels.cpu)


class CommitRoundInputError(RuntimeError, ValueError, TypeError):
    """Bad argument to ``commit_round`` (a RuntimeError like the C++ op's; also a ValueError/TypeError)."""


def _fail(msg: str):
    raise CommitRoundInputError(f"{_OP}: {msg}")


def _check(name: str, t, dtype: torch.dtype, ndim, device: torch.device | None):
    if not isinstance(t, torch.Tensor):
        _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        _fail(f"{name} must have dtype {dtype}, got {t.dtype} (use {name}.to({dtype}))")
    dims = (ndim,) if isinstance(ndim, int) else ndim
    if t.dim() not in dims:
        _fail(f"{name} must be {' or '.join(f'{d}-D' for d in dims)}, got shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        _fail(f"{name} is on {t.device} but draft_tokens is on {device}")
    if not t.is_contiguous():
        _fail(f"{name} must be contiguous (pass {name}.contiguous(); in/out buffers must be dense)")


def _validate(draft_tokens, accepted, bonus, out_tokens, lengths, positions, anchor, done,
              max_lengths, stop_tokens):
    _check("draft_tokens", draft_tokens, torch.int64, 2, None)
    dev = draft_tokens.device
    R = draft_tokens.shape[0]
    for name, t, dt in (("accepted", accepted, torch.int64), ("bonus", bonus, torch.int64),
                        ("lengths", lengths, torch.int64), ("positions", positions, torch.int64),
                        ("anchor", anchor, torch.int64), ("done", done, torch.bool),
                        ("max_lengths", max_lengths, torch.int64)):
        _check(name, t, dt, 1, dev)
        if t.shape[0] != R:
            _fail(f"{name} must have shape [R] = [{R}] (R = draft_tokens.shape[0]), got {tuple(t.shape)}")
    _check("out_tokens", out_tokens, torch.int64, 2, dev)
    if out_tokens.shape[0] != R:
        _fail(f"out_tokens must have shape [R, capacity] with R = {R}, got {tuple(out_tokens.shape)}")
    if stop_tokens is not None:
        _check("stop_tokens", stop_tokens, torch.int64, (1, 2), dev)
        if stop_tokens.dim() == 2 and stop_tokens.shape[0] != R:
            _fail(f"stop_tokens must have shape [S] or [R, S] with R = {R}, got {tuple(stop_tokens.shape)}")


def _check_values(draft_tokens, accepted, lengths, done, max_lengths, capacity):
    """Value checks (a host sync on GPU): the first offending request is named."""
    B = draft_tokens.shape[1] + 1
    active = ~done
    for name, bad, rng in (
        ("accepted", active & ((accepted < 0) | (accepted > B - 1)), f"outside [0, B-1] = [0, {B - 1}]"),
        ("lengths", active & ((lengths < 0) | (lengths > capacity)),
         f"outside [0, capacity] = [0, {capacity}] of out_tokens"),
        ("max_lengths", active & (max_lengths > capacity), f"exceeds the capacity of out_tokens ({capacity})"),
    ):
        if bool(bad.any()):
            r = int(bad.nonzero()[0, 0])
            val = {"accepted": accepted, "lengths": lengths, "max_lengths": max_lengths}[name][r]
            _fail(f"{name}[{r}] = {int(val)} is {rng}")


def first_token_done(first: int, stop_tokens, max_new_tokens: int) -> bool:
    """:func:`commit_round`'s finishing rule for the token a request's prefill produced (committed outside any
    round): done when it is one of ``stop_tokens`` or ``max_new_tokens`` allows no more than it."""
    return first in stop_tokens or max_new_tokens <= 1


def commit_round_reference(draft_tokens: torch.Tensor, accepted: torch.Tensor, bonus: torch.Tensor,
                           out_tokens: torch.Tensor, lengths: torch.Tensor, positions: torch.Tensor,
                           anchor: torch.Tensor, done: torch.Tensor, max_lengths: torch.Tensor,
                           stop_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """Pure-PyTorch definition of :func:`commit_round` (no validation, no host sync).

    Vectorised over requests, so it also runs on the GPU inside CUDA graphs. A not-done request
    with out-of-range values (see :func:`commit_round`) is finished like the CUDA kernel does:
    ``done[r] = True``, ``num_new[r] = 0``, nothing else written.
    """
    R, B = draft_tokens.shape[0], draft_tokens.shape[1] + 1
    C = out_tokens.shape[1]
    dev = draft_tokens.device
    active = ~done
    bad = active & ((accepted < 0) | (accepted > B - 1) | (lengths < 0) | (lengths > C) | (max_lengths > C))
    ok = active & ~bad
    acc = accepted.clamp(0, B - 1)
    L = lengths.clamp(0, C)
    j = torch.arange(B, device=dev)
    # e[r, j]: draft_tokens[r, j] for j < acc, bonus at j == acc (entries after acc are unused).
    cand = torch.cat([draft_tokens, bonus[:, None]], dim=1)
    cand = torch.where(j[None, :] == acc[:, None], bonus[:, None], cand)
    in_block = j[None, :] <= acc[:, None]
    if stop_tokens is not None and stop_tokens.numel() > 0:
        st = stop_tokens if stop_tokens.dim() == 2 else stop_tokens[None, :].expand(R, -1)
        is_stop = ((cand[:, :, None] == st[:, None, :]) & (st[:, None, :] >= 0)).any(-1) & in_block
    else:
        is_stop = torch.zeros((R, B), dtype=torch.bool, device=dev)
    has_stop = is_stop.any(dim=1)
    s = torch.where(has_stop, is_stop.to(torch.int8).argmax(dim=1), acc) + 1
    room = (max_lengths - L).clamp(min=0)
    n = torch.where(ok, torch.minimum(s, room), torch.zeros_like(s))
    # Write e[:n] at L.. through a padded copy: the B target columns L..L+B-1 are distinct and in range.
    write = j[None, :] < n[:, None]
    padded = torch.cat([out_tokens, out_tokens.new_zeros((R, B))], dim=1)
    idx = L[:, None] + j[None, :]
    padded.scatter_(1, idx, torch.where(write, cand, padded.gather(1, idx)))
    out_tokens.copy_(padded[:, :C])
    new_len = L + n
    last = cand.gather(1, (n - 1).clamp(min=0)[:, None]).squeeze(1)
    finished = ok & ((has_stop & (n == s)) | (new_len >= max_lengths))
    lengths.copy_(torch.where(ok, new_len, lengths))
    positions.add_(n)
    anchor.copy_(torch.where(n > 0, last, anchor))
    done.copy_(done | bad | finished)
    return n


def commit_round(draft_tokens: torch.Tensor, accepted: torch.Tensor, bonus: torch.Tensor, *,
                 out_tokens: torch.Tensor, lengths: torch.Tensor, positions: torch.Tensor,
                 anchor: torch.Tensor, done: torch.Tensor, max_lengths: torch.Tensor,
                 stop_tokens: torch.Tensor | None = None, backend: str = "auto",
                 check: bool | None = None) -> torch.Tensor:
    """Commit one verified round for a ragged batch of ``R`` requests, in place, without host sync.

    Block size ``B`` (= anchor + ``B-1`` drafts) comes from ``draft_tokens``; ``capacity`` is
    ``out_tokens.shape[1]``. All tensors on one device, contiguous. See the module docstring for
    the exact definition.

    Args:
        draft_tokens: ``[R, B-1]`` int64, this round's drafted tokens (``B == 1`` gives ``[R, 0]``).
        accepted: ``[R]`` int64, accepted draft count per request, ``0 <= accepted[r] <= B-1``
            (``verify_greedy``'s first output).
        bonus: ``[R]`` int64, the target's token after the accepted prefix (``verify_greedy``'s second output).
        out_tokens: ``[R, capacity]`` int64, **in/out**: output buffers; the committed tokens are
            written at ``out_tokens[r, lengths[r]:lengths[r]+n]``.
        lengths: ``[R]`` int64, **in/out**: tokens already in ``out_tokens[r]``, ``0 <= lengths[r] <= capacity``.
        positions: ``[R]`` int64, **in/out**: sequence position of the current anchor; advanced by ``n``.
        anchor: ``[R]`` int64, **in/out**: the current anchor (last committed) token; set to the
            last committed token (the next round's block starts with it).
        done: ``[R]`` bool, **in/out**: finished flag; requests with ``done[r]`` set are not touched.
        max_lengths: ``[R]`` int64, a request finishes once ``lengths[r] >= max_lengths[r]``;
            must be ``<= capacity`` (``max_lengths[r] <= lengths[r]`` finishes it with nothing written).
        stop_tokens: ``[S]`` (shared) or ``[R, S]`` (per request) int64, or ``None``; negative entries are
            padding and ignored. The first stop token among the candidates is committed and ends the request.
        backend: ``"auto" | "ext" | "cpu" | "torch"`` (``"ext"``: the C++ op on CPU, the CUDA kernel on GPU;
            ``"cpu"``: CPU tensors, the C++ op where the extension is built, else the reference).
        check: validate values (``accepted``, ``lengths``, ``max_lengths`` ranges) and raise, naming the
            argument and request. ``None`` (default): only for CPU tensors outside ``torch.compile``
            (free there; a host sync on GPU). Unchecked invalid requests are finished untouched
            (``done[r] = True``, ``num_new[r] = 0``); no backend ever reads or writes out of bounds.

    Returns:
        ``num_new``: ``[R]`` int64, tokens committed per request (= new draft-context rows; 0 for
        done requests).

    Raises:
        RuntimeError (:class:`CommitRoundInputError`, also a ValueError/TypeError) naming the bad argument.
    """
    _validate(draft_tokens, accepted, bonus, out_tokens, lengths, positions, anchor, done,
              max_lengths, stop_tokens)
    dev = draft_tokens.device
    if check is None:
        check = dev.type == "cpu" and not torch.compiler.is_compiling()
    if check:
        _check_values(draft_tokens, accepted, lengths, done, max_lengths, out_tokens.shape[1])
    chosen = resolve_backend(_OP, backend, dev, available=_BACKENDS)
    return call_op(_commit_round_op, draft_tokens, accepted, bonus, out_tokens, lengths, positions, anchor,
                   done, max_lengths, stop_tokens, chosen, device=dev, checked=True)  # validated above


def _check_commit(draft_tokens, accepted, bonus, out_tokens, lengths, positions, anchor, done, max_lengths,
                  stop_tokens, backend):
    _validate(draft_tokens, accepted, bonus, out_tokens, lengths, positions, anchor, done, max_lengths, stop_tokens)


@torch.library.custom_op("dflash::commit_round",
                         mutates_args=("out_tokens", "lengths", "positions", "anchor", "done"))
@checked_by(_check_commit)
def _commit_round_op(draft_tokens: torch.Tensor, accepted: torch.Tensor, bonus: torch.Tensor,
                     out_tokens: torch.Tensor, lengths: torch.Tensor, positions: torch.Tensor, anchor: torch.Tensor,
                     done: torch.Tensor, max_lengths: torch.Tensor, stop_tokens: Optional[torch.Tensor],
                     backend: str) -> torch.Tensor:
    """``torch.ops.dflash.commit_round``: :func:`commit_round` after its shape and dtype checks (no value checks
    here: every backend finishes a request with values out of range untouched)."""
    chosen = resolve_backend(_OP, backend, draft_tokens.device, available=_BACKENDS)
    body = registered(_OP, chosen)
    if body is not None:
        return body(draft_tokens, accepted, bonus, out_tokens, lengths, positions, anchor, done, max_lengths,
                    stop_tokens)
    run = commit_round_ext if chosen == "ext" else commit_round_reference
    return run(draft_tokens, accepted, bonus, out_tokens, lengths, positions, anchor, done, max_lengths, stop_tokens)


def commit_round_ext(draft_tokens, accepted, bonus, out_tokens, lengths, positions, anchor, done, max_lengths,
                     stop_tokens) -> torch.Tensor:
    """``commit_round`` by the compiled extension's op (its C++ kernel on CPU, its CUDA kernel on GPU)."""
    from dflash_kernels import _ext

    if stop_tokens is None:
        stop_tokens = torch.empty(0, dtype=torch.int64, device=draft_tokens.device)
    return _ext.commit_round(draft_tokens, accepted, bonus, stop_tokens, max_lengths,
                             out_tokens, lengths, positions, anchor, done)


@_commit_round_op.register_fake
def _commit_round_fake(draft_tokens, accepted, bonus, out_tokens, lengths, positions, anchor, done, max_lengths,
                       stop_tokens, backend):
    return accepted.new_empty((draft_tokens.shape[0],))


# ------------------------------------------------------------------------------------------ draft_round_setup

_SETUP = "draft_round_setup"
_SETUP_BACKENDS = ("triton", "torch")


def draft_round_setup_reference(anchor: torch.Tensor, positions: torch.Tensor, num_new: torch.Tensor,
                                max_lengths: torch.Tensor, block: torch.Tensor, context_start: torch.Tensor,
                                block_lens: torch.Tensor) -> None:
    """Definition of :func:`draft_round_setup` (vectorised, no host sync)."""
    block[:, 0] = anchor
    torch.sub(positions, num_new, out=context_start)
    block_lens.copy_((max_lengths - positions).clamp(1, block.shape[1]))


@triton.jit
def _draft_round_setup_kernel(anchor_ptr, pos_ptr, new_ptr, maxl_ptr, block_ptr, start_ptr, lens_ptr, N, B,
                              stride_block, BLOCK_N: tl.constexpr):
    r = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = r < N
    r64 = r.to(tl.int64)
    pos = tl.load(pos_ptr + r64, mask=ok, other=0)
    tl.store(block_ptr + r64 * stride_block, tl.load(anchor_ptr + r64, mask=ok, other=0), mask=ok)
    tl.store(start_ptr + r64, pos - tl.load(new_ptr + r64, mask=ok, other=0), mask=ok)
    room = tl.load(maxl_ptr + r64, mask=ok, other=0) - pos
    tl.store(lens_ptr + r64, tl.minimum(tl.maximum(room, 1), B), mask=ok)


def draft_round_setup(anchor: torch.Tensor, positions: torch.Tensor, num_new: torch.Tensor,
                      max_lengths: torch.Tensor, *, block: torch.Tensor, context_start: torch.Tensor,
                      block_lens: torch.Tensor, backend: str = "auto") -> None:
    """What the draft step needs from the committed state, in one launch, in place (see the module docstring).

    Args:
        anchor, positions, num_new, max_lengths: ``[N]`` int64 (``commit_round``'s anchor, positions, num_new
            and max_lengths).
        block: ``[N, B]`` int64 (any strides), **out**: column 0 becomes the anchor; the other columns are
            not touched (the mask token).
        context_start: ``[N]`` int64, **out**: ``positions - num_new``, the position of the first context row
            the last round committed (its rows go to the draft's context cache from there).
        block_lens: ``[N]`` int64, **out**: ``clamp(max_lengths - positions, 1, B)``, the block rows the
            draft attends to (``draft_attention``'s ``block_lens``).
        backend: ``"auto" | "triton" | "torch"``.
    """
    chosen = resolve_backend(_SETUP, backend, block.device, available=_SETUP_BACKENDS)
    call_op(_draft_round_setup_op, anchor, positions, num_new, max_lengths, block, context_start, block_lens,
            chosen, device=block.device)


def _check_setup(anchor, positions, num_new, max_lengths, block, context_start, block_lens, backend):
    check_tensor(_SETUP, "block", block, ndim=2, dtypes=(torch.int64,))
    n, dev = block.shape[0], block.device
    if block.shape[1] < 1:
        raise ValueError(f"{_SETUP}: block must be [N, B] with B >= 1, got shape {tuple(block.shape)}")
    for name, t in (("anchor", anchor), ("positions", positions), ("num_new", num_new), ("max_lengths", max_lengths),
                    ("context_start", context_start), ("block_lens", block_lens)):
        check_tensor(_SETUP, name, t, ndim=1, dtypes=(torch.int64,), device=dev)
        if t.shape[0] != n or not t.is_contiguous():
            raise ValueError(f"{_SETUP}: {name} must be a contiguous [N={n}] tensor (N = block.shape[0]), "
                             f"got shape {tuple(t.shape)}")


@torch.library.custom_op("dflash::draft_round_setup", mutates_args=("block", "context_start", "block_lens"))
@checked_by(_check_setup)
def _draft_round_setup_op(anchor: torch.Tensor, positions: torch.Tensor, num_new: torch.Tensor,
                          max_lengths: torch.Tensor, block: torch.Tensor, context_start: torch.Tensor,
                          block_lens: torch.Tensor, backend: str) -> None:
    """``torch.ops.dflash.draft_round_setup``: :func:`draft_round_setup` after validation."""
    chosen = resolve_backend(_SETUP, backend, anchor.device, available=_SETUP_BACKENDS)
    if chosen == "torch":
        draft_round_setup_reference(anchor, positions, num_new, max_lengths, block, context_start, block_lens)
        return
    n = block.shape[0]
    if n == 0:
        return
    block_n = min(1024, max(16, next_pow2(n)))
    _draft_round_setup_kernel[(triton.cdiv(n, block_n),)](
        anchor_ptr=anchor, pos_ptr=positions, new_ptr=num_new, maxl_ptr=max_lengths, block_ptr=block,
        start_ptr=context_start, lens_ptr=block_lens, N=n, B=block.shape[1], stride_block=block.stride(0),
        BLOCK_N=block_n)


@_draft_round_setup_op.register_fake
def _draft_round_setup_fake(anchor, positions, num_new, max_lengths, block, context_start, block_lens, backend):
    return None
