"""``candidate_select``: DFlash2's candidate selector over the P proposal positions of every request, one launch.

At position i the candidates are the ``top_k`` best draft logits; the path walks left to right from the anchor:
``score[c] = logit[c] + <predecessor[prev] * projected[i], successor[c]>`` (``projected = hidden_projection(h_i)``,
rank-r codebooks over the full vocabulary), temperature 0 takes the best score, T > 0 samples from
``softmax(score / T)``, and the chosen token becomes ``prev`` (:class:`dflash.dflash2.CandidateSelector`).

Candidate order (the definition, which the argmax's tie rule depends on): descending logit, equal logits by
lower token id; a tie of scores takes the earlier candidate. Scores are computed in fp32 from the inputs' values.

Launch: one program per request walks its positions in order (the walk is sequential); per position it streams
the row's V logits once in tiles of BLOCK_V, keeping the running top-k in registers (k selection passes over a
tile that holds a value above the k-th kept one, none over the others; no sort), then scores the k candidates against the codebook rows and picks. Reads per call:
``N*P*V*e`` logits + ``N*P*(k+1)*r*e_c`` codebook rows + ``N*P*r*e`` projections; writes ``N*P*(1 + 2k)`` words.
Sampling reads seed and offset on the device (Philox; no host sync, graph-capturable), on a random stream of its
own (``SELECTOR_STREAM``), so that ``verify_sample`` may take the same seed and offset in the same round.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from dflash_kernels._dispatch import call_op, checked_by, resolve_backend
from dflash_kernels._triton_utils import (
    FLOAT_DTYPES, as_index_tensor, check_index_values, check_last_dim_contiguous, check_shape, check_tensor,
    interpreting, next_pow2,
)
from dflash_kernels import verify
from dflash_kernels.dynamic_conv import overlap
from dflash_kernels.verify import _rng_for

CANDIDATE_SELECT = "candidate_select"
_BACKENDS = ("triton", "torch")
MAX_TOP_K = 64  # the kernel keeps the candidates and their codebook rows in registers
_NO_ID = 2**31 - 1
# The picks' random stream, apart from verify_sample's, which draws in the same round with the same (seed, offset):
# the fourth Philox counter word (verify_sample's kernels use 2 * (offset >> 32) and that + 1, which reach it only
# at offsets >= 2**63 - 2**32 or below 0), and the reference generator's stream number.
SELECTOR_STREAM = 0xFFFFFFFF


def top_k_candidates(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` best ids of each row of ``logits`` [..., V] (int64): descending logit, equal logits by lower id
    (also at the k-th place: the lowest ids among the values equal to the k-th largest get in)."""
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    above = logits > kth
    room = k - above.sum(-1, keepdim=True)
    at_kth = logits == kth
    chosen = above | (at_kth & (at_kth.cumsum(-1) <= room))
    ids = chosen.nonzero()[:, -1].view(*logits.shape[:-1], k)  # ascending ids, k per row
    order = torch.sort(logits.gather(-1, ids), dim=-1, descending=True, stable=True).indices
    return ids.gather(-1, order)


def candidate_select_reference(logits: torch.Tensor, projected: torch.Tensor, predecessor: torch.Tensor,
                               successor: torch.Tensor, anchor: torch.Tensor, top_k: int,
                               temperature: Optional[torch.Tensor] = None, seed=0, offset=0):
    """Definition. logits [N, P, V], projected [N, P, r], predecessor / successor [V, r], anchor [N] ->
    ``(path [N, P] int64, candidates [N, P, k] int64, q [N, P, k] fp32)``; q is the selector's distribution over
    the candidates (``softmax(score / T)``, or one-hot at the pick where T <= 0 or ``temperature`` is None).
    Sampling draws u ~ U[0, 1) per position from a generator seeded by (seed, offset) (read on the host) and picks
    the first candidate whose cumulative q exceeds u; its random stream differs from the Triton kernel's."""
    n, p, _ = logits.shape
    candidates = top_k_candidates(logits, top_k)
    unary = logits.float().gather(-1, candidates)
    projected = projected.float()
    if temperature is not None:
        temps = temperature.float().expand(n)
        live = temps > 0
        rng = _rng_for(seed, offset, logits.device, SELECTOR_STREAM)
        u = torch.rand((n, p), generator=rng, dtype=torch.float64, device=logits.device)
    prev = anchor.long()
    path, q_rows = [], []
    for i in range(p):
        scores = unary[:, i] + torch.einsum("nr,nkr->nk", predecessor[prev].float() * projected[:, i],
                                            successor[candidates[:, i]].float())
        pick = scores.argmax(-1)
        q = torch.nn.functional.one_hot(pick, top_k).float()
        if temperature is not None:
            soft = torch.softmax(scores / torch.where(live, temps, 1.0)[:, None], dim=-1)
            drawn = (soft.double().cumsum(-1) <= u[:, i, None]).sum(-1).clamp_max(top_k - 1)
            pick = torch.where(live, drawn, pick)
            q = torch.where(live[:, None], soft, q)
        prev = candidates[:, i].gather(-1, pick[:, None])[:, 0]
        path.append(prev)
        q_rows.append(q)
    if p == 0:
        return (torch.zeros(n, 0, dtype=torch.int64, device=logits.device), candidates,
                torch.zeros(n, 0, top_k, device=logits.device))
    return torch.stack(path, 1), candidates, torch.stack(q_rows, 1)


@triton.jit
def _candidate_select_kernel(path_ptr, cand_ptr, q_ptr, logits_ptr, proj_ptr, pred_ptr, succ_ptr, anchor_ptr,
                             temp_ptr, seed_ptr, offset_ptr, P, V, R, K,
                             stride_ln, stride_lp, stride_pn, stride_pp, stride_pred, stride_succ, stride_anchor,
                             stride_temp,
                             SAMPLE: tl.constexpr, NO_ID: tl.constexpr, STREAM: tl.constexpr,
                             BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
    req = tl.program_id(0).to(tl.int64)
    slots = tl.arange(0, BLOCK_K)
    live_slot = slots < K
    rcols = tl.arange(0, BLOCK_R)
    rmask = rcols < R
    prev = tl.load(anchor_ptr + req * stride_anchor).to(tl.int64)
    if SAMPLE:
        temp = tl.load(temp_ptr + req * stride_temp).to(tl.float32)
        seed = tl.load(seed_ptr)
        offset = tl.load(offset_ptr).to(tl.int64)
    for i in range(P):
        row = logits_ptr + req * stride_ln + i * stride_lp
        # running top-k of the row, in candidate order (descending value, then ascending id)
        run_v = tl.full([BLOCK_K], float("-inf"), tl.float32)
        run_i = tl.full([BLOCK_K], NO_ID, tl.int32)
        for start in range(0, V, BLOCK_V):
            idx = start + tl.arange(0, BLOCK_V)
            in_row = idx < V
            x = tl.load(row + idx, mask=in_row, other=float("-inf")).to(tl.float32)
            # The tile's ids follow every kept id, so an element gets in only by a larger value than the k-th
            # kept one: a tile without one (most tiles once the list is full) costs one max and no passes.
            kth_v = tl.max(tl.where(slots == K - 1, run_v, float("-inf")), axis=0)
            kth_i = tl.min(tl.where(slots == K - 1, run_i, NO_ID), axis=0)
            if (kth_i == NO_ID) | (tl.max(x, axis=0) > kth_v):
                new_v = tl.full([BLOCK_K], float("-inf"), tl.float32)
                new_i = tl.full([BLOCK_K], NO_ID, tl.int32)
                last_v = tl.max(tl.full([BLOCK_K], float("inf"), tl.float32), axis=0)
                last_i = tl.min(tl.full([BLOCK_K], -1, tl.int32), axis=0)
                for j in range(K):  # pass j: the best (value, id) after the previous pass's pick
                    ok_x = in_row & ((x < last_v) | ((x == last_v) & (idx > last_i)))
                    best_x = tl.max(tl.where(ok_x, x, float("-inf")), axis=0)
                    id_x = tl.min(tl.where(ok_x & (x == best_x), idx, NO_ID), axis=0)
                    ok_r = (run_i != NO_ID) & ((run_v < last_v) | ((run_v == last_v) & (run_i > last_i)))
                    best_r = tl.max(tl.where(ok_r, run_v, float("-inf")), axis=0)
                    id_r = tl.min(tl.where(ok_r & (run_v == best_r), run_i, NO_ID), axis=0)
                    from_x = (best_x > best_r) | ((best_x == best_r) & (id_x < id_r))
                    last_v = tl.where(from_x, best_x, best_r)
                    last_i = tl.where(from_x, id_x, id_r)
                    new_v = tl.where(slots == j, last_v, new_v)
                    new_i = tl.where(slots == j, last_i, new_i)
                run_v = new_v
                run_i = new_i
        a = (tl.load(pred_ptr + prev * stride_pred + rcols, mask=rmask, other=0.0).to(tl.float32)
             * tl.load(proj_ptr + req * stride_pn + i * stride_pp + rcols, mask=rmask, other=0.0).to(tl.float32))
        safe_i = tl.where(live_slot, run_i, 0).to(tl.int64)
        succ = tl.load(succ_ptr + safe_i[:, None] * stride_succ + rcols[None, :],
                       mask=live_slot[:, None] & rmask[None, :], other=0.0).to(tl.float32)
        score = tl.where(live_slot, run_v + tl.sum(succ * a[None, :], axis=1), float("-inf"))
        best = tl.argmax(score, axis=0, tie_break_left=True)
        pick = best
        q = tl.where(slots == best, 1.0, 0.0)
        if SAMPLE:
            z = score / tl.where(temp > 0, temp, 1.0)
            e = tl.where(live_slot, tl.exp(z - tl.max(z, axis=0)), 0.0)
            soft = e / tl.sum(e, axis=0)
            counter = (req * P + i).to(tl.uint32)
            c0 = tl.zeros([BLOCK_K], tl.uint32) + counter
            c1 = tl.zeros([BLOCK_K], tl.uint32) + (offset & 0xFFFFFFFF).to(tl.uint32)
            c2 = tl.zeros([BLOCK_K], tl.uint32) + (offset >> 32).to(tl.uint32)
            c3 = tl.zeros([BLOCK_K], tl.uint32) + STREAM
            r0, _, _, _ = tl.philox(seed, c0, c1, c2, c3)
            u = tl.max(tl.where(slots == 0, tl.uint_to_uniform_float(r0), 0.0), axis=0)
            drawn = tl.minimum(tl.sum(tl.where(live_slot & (tl.cumsum(soft, axis=0) <= u), 1, 0), axis=0), K - 1)
            pick = tl.where(temp > 0, drawn, best)
            q = tl.where(temp > 0, soft, q)
        token = tl.sum(tl.where(slots == pick, run_i, 0), axis=0).to(tl.int64)
        out = req * P + i
        tl.store(path_ptr + out, token)
        tl.store(cand_ptr + out * K + slots, run_i.to(tl.int64), mask=live_slot)
        tl.store(q_ptr + out * K + slots, q, mask=live_slot)
        prev = token


def _candidate_select_triton(logits, projected, predecessor, successor, anchor, top_k, temperature, seed, offset,
                             path, candidates, q) -> None:
    n, p, v = logits.shape
    if n == 0 or p == 0:
        return
    sample = temperature is not None
    _candidate_select_kernel[(n,)](
        path, candidates, q, logits, projected, predecessor, successor, anchor,
        temperature if sample else logits, seed, offset, p, v, predecessor.shape[1], top_k,
        logits.stride(0), logits.stride(1), projected.stride(0), projected.stride(1), predecessor.stride(0),
        successor.stride(0), anchor.stride(0), temperature.stride(0) if sample and temperature.shape[0] > 1 else 0,
        SAMPLE=sample, NO_ID=_NO_ID, STREAM=SELECTOR_STREAM,
        BLOCK_V=min(next_pow2(v), 4096 if interpreting() else 1024),
        BLOCK_K=next_pow2(top_k), BLOCK_R=next_pow2(predecessor.shape[1]), num_warps=4,
    )


def candidate_select(logits: torch.Tensor, projected: torch.Tensor, predecessor: torch.Tensor,
                     successor: torch.Tensor, anchor: torch.Tensor, *, top_k: int,
                     temperature: Optional[torch.Tensor] = None, seed=0, offset=0,
                     out: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None, backend: str = "auto"):
    """DFlash2's candidate selection for all P proposal positions of all N requests.

    Args:
        logits: ``[N, P, V]`` fp32/bf16/fp16, last dim contiguous: the draft logits of the proposal positions.
        projected: ``[N, P, r]`` float, last dim contiguous: ``hidden_projection`` of the same rows.
        predecessor, successor: ``[V, r]`` float, last dim contiguous: the selector's codebooks.
        anchor: ``[N]`` int32/int64 in ``[0, V)``: the token before position 0 of each request.
        top_k: candidates per position, ``1 <= top_k <= min(V, 64)``.
        temperature: ``None`` (greedy: argmax of the scores), or an fp32/fp64 tensor ``[1]`` or ``[N]``: requests
            with T > 0 sample from ``softmax(score / T)``, T <= 0 take the argmax.
        seed, offset: ints or 1-element int32/int64 tensors (Philox key and counter offset, read on the device).
        out: ``None``, or the three result tensors to write (contiguous ``[N, P]`` int64, ``[N, P, k]`` int64,
            ``[N, P, k]`` fp32, sharing no memory with each other or the inputs): a runtime's persistent buffers,
            which the verify step reads (no copy).
        backend: ``"auto" | "triton" | "cpu" | "torch"`` (``"cpu"`` is the reference).

    Returns:
        ``(path [N, P] int64, candidates [N, P, k] int64, q [N, P, k] fp32)`` (``out``'s tensors, or new ones) as
        :func:`candidate_select_reference`; greedy results equal it exactly (up to fp32 score ties).
    """
    chosen = resolve_backend(CANDIDATE_SELECT, backend, logits.device, available=_BACKENDS)
    seed_t = as_index_tensor(CANDIDATE_SELECT, "seed", seed, logits.device)
    offset_t = as_index_tensor(CANDIDATE_SELECT, "offset", offset, logits.device)
    if out is None:
        n, p = logits.shape[:2] if isinstance(logits, torch.Tensor) and logits.dim() == 3 else (0, 0)
        k = top_k if isinstance(top_k, int) and top_k > 0 else 0
        out = (torch.empty((n, p), dtype=torch.int64, device=logits.device),
               torch.empty((n, p, k), dtype=torch.int64, device=logits.device),
               torch.empty((n, p, k), dtype=torch.float32, device=logits.device))
    elif not isinstance(out, (tuple, list)) or len(out) != 3:
        raise TypeError(f"{CANDIDATE_SELECT}: out must be None or a tuple (path, candidates, q) of three tensors")
    call_op(_candidate_select_op, logits, projected, predecessor, successor, anchor, top_k, temperature, seed_t,
            offset_t, *out, chosen, device=logits.device)
    return tuple(out)


def _check_candidate_select(logits, projected, predecessor, successor, anchor, top_k, temperature, seed, offset,
                            path, candidates, q, backend):
    op = CANDIDATE_SELECT
    check_tensor(op, "logits", logits, ndim=3, dtypes=FLOAT_DTYPES)
    check_last_dim_contiguous(op, "logits", logits)
    n, p, v = logits.shape
    device = logits.device
    check_tensor(op, "projected", projected, ndim=3, dtypes=FLOAT_DTYPES, device=device)
    rank = projected.shape[-1]
    check_shape(op, "projected", projected, (n, p, rank), "[N, P, r]: N, P from logits")
    check_last_dim_contiguous(op, "projected", projected)
    for name, codebook in (("predecessor", predecessor), ("successor", successor)):
        check_tensor(op, name, codebook, ndim=2, dtypes=FLOAT_DTYPES, device=device)
        check_shape(op, name, codebook, (v, rank), "[V, r]: V from logits, r from projected")
        check_last_dim_contiguous(op, name, codebook)
    check_tensor(op, "anchor", anchor, ndim=1, dtypes=(torch.int32, torch.int64), device=device)
    check_shape(op, "anchor", anchor, (n,), "[N]")
    check_index_values(op, "anchor", anchor, 0, v, "token ids of the codebooks' vocabulary")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= min(v, MAX_TOP_K):
        raise ValueError(f"{op}: top_k must be an int in [1, min(V, {MAX_TOP_K})] = [1, {min(v, MAX_TOP_K)}], "
                         f"got {top_k!r}")
    if temperature is not None:
        check_tensor(op, "temperature", temperature, ndim=1, dtypes=(torch.float32, torch.float64), device=device)
        if temperature.shape[0] not in (1, n):
            raise ValueError(f"{op}: temperature must be [1] or [N={n}], got {tuple(temperature.shape)}")
    for name, t in (("seed", seed), ("offset", offset)):
        as_index_tensor(op, name, t, device)
    results = (("path", path, torch.int64, (n, p)), ("candidates", candidates, torch.int64, (n, p, top_k)),
               ("q", q, torch.float32, (n, p, top_k)))
    for name, t, dtype, shape in results:
        check_tensor(op, name, t, dtypes=(dtype,), device=device)
        if tuple(t.shape) != shape or not t.is_contiguous():
            raise ValueError(f"{op}: {name} (out) must be a contiguous {list(shape)} tensor, got "
                             f"{tuple(t.shape)}{'' if t.is_contiguous() else ' (not contiguous)'}")
    inputs = (("logits", logits), ("projected", projected), ("predecessor", predecessor), ("successor", successor),
              ("anchor", anchor), ("temperature", temperature), ("seed", seed), ("offset", offset))
    for i, (name, t, _, _) in enumerate(results):
        for other, u in [(r[0], r[1]) for r in results[i + 1:]] + list(inputs):
            if u is not None and overlap(t, u):
                raise ValueError(f"{op}: {name} (out) overlaps {other}; give each result its own buffer")


@torch.library.custom_op("dflash::candidate_select", mutates_args=("path", "candidates", "q"))
@checked_by(_check_candidate_select)
def _candidate_select_op(logits: torch.Tensor, projected: torch.Tensor, predecessor: torch.Tensor,
                         successor: torch.Tensor, anchor: torch.Tensor, top_k: int, temperature: Optional[torch.Tensor],
                         seed: torch.Tensor, offset: torch.Tensor, path: torch.Tensor, candidates: torch.Tensor,
                         q: torch.Tensor, backend: str) -> None:
    """``torch.ops.dflash.candidate_select``: :func:`candidate_select` after validation, into ``path``,
    ``candidates`` and ``q`` (a custom op may not return an alias of an input). Under a CUDA graph capture the
    "torch" backend runs the Triton kernel: the reference's candidates have a host-sized step (``nonzero``) and its
    random stream a generator seeded from host ints, which a capture cannot hold."""
    chosen = resolve_backend(CANDIDATE_SELECT, backend, logits.device, available=_BACKENDS)
    if chosen == "torch" and not verify.cuda_capturing(logits.device):
        for result, value in zip((path, candidates, q), candidate_select_reference(
                logits, projected, predecessor, successor, anchor, top_k, temperature, seed, offset)):
            result.copy_(value)
        return
    _candidate_select_triton(logits, projected, predecessor, successor, anchor, top_k, temperature, seed, offset,
                             path, candidates, q)


@_candidate_select_op.register_fake
def _candidate_select_fake(logits, projected, predecessor, successor, anchor, top_k, temperature, seed, offset,
                           path, candidates, q, backend):
    return None
