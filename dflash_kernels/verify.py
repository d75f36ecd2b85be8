"""Verification of a drafted block against the target's logits: greedy and sampled (temperature > 0).

Greedy: 2 launches. Sampled: 2 launches, plus, when top-k / top-p filtering is on, an exact per-row
threshold found by a radix select split across CTAs: ``threshold_launches(use_top_k, use_top_p)`` =
8 histogram passes per filter + 1 (9 with one filter, 17 with both; grid (row blocks, vocab splits)),
moving ``threshold_bytes(rows, vocab, itemsize, use_top_k, use_top_p)`` bytes: the logits once per pass
(``(8 * filters + top_p) * rows * vocab * itemsize``) plus 64-byte per-split histograms. It replaced a
single-program bisection (one launch, ~67 serial passes over each row, one program per row).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from dflash_kernels._dispatch import call_op, checked_by, registered, resolve_backend
from dflash_kernels._triton_utils import (
    FLOAT_DTYPES, as_index_tensor, check_index_values, check_last_dim_contiguous, check_tensor, interpreting,
    next_pow2,
)

_BIG = 2**31 - 1
# Each op's own backends; the wings' registered bodies (dflash_kernels.cpu) join them.
_GREEDY_BACKENDS = ("ext", "triton", "torch")
_TOKENS_BACKENDS = ("triton", "torch")
_SAMPLE_BACKENDS = ("triton", "torch")


def _validate(op: str, logits, draft_tokens):
    check_tensor(op, "logits", logits, ndim=3, dtypes=FLOAT_DTYPES)
    n, b, v = logits.shape
    if b < 1 or v < 1:
        raise ValueError(f"{op}: logits must be [N, B, V] with B >= 1 and V >= 1, got {tuple(logits.shape)}")
    if v >= _BIG:
        raise ValueError(f"{op}: vocab size {v} does not fit the int32 token index used in-kernel")
    check_tensor(op, "draft_tokens", draft_tokens, ndim=2, dtypes=(torch.int64, torch.int32), device=logits.device)
    if tuple(draft_tokens.shape) != (n, b - 1):
        raise ValueError(f"{op}: draft_tokens must be [N, B-1] = [{n}, {b - 1}] for logits of shape {tuple(logits.shape)} "
                         f"(row i of logits predicts the token after block position i); got {tuple(draft_tokens.shape)}")


# --------------------------------------------------------------------------------------------------
# greedy
# --------------------------------------------------------------------------------------------------

def verify_greedy_reference(logits: torch.Tensor, draft_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Definition: accepted = longest prefix with draft == argmax(logits), bonus = argmax at row ``accepted``."""
    return _accept_greedy(logits.argmax(dim=-1), draft_tokens)


def _accept_greedy(target: torch.Tensor, draft_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The acceptance rule on the target's argmax tokens ``target`` [N, B]."""
    match = (draft_tokens.to(torch.int64) == target[:, :-1]).to(torch.int64)
    accepted = match.cumprod(dim=1).sum(dim=1)
    bonus = target.gather(1, accepted[:, None]).squeeze(1)
    return accepted, bonus


@triton.jit
def _argmax_partial_kernel(
    logits_ptr, pval_ptr, pidx_ptr, R, B, V, stride_n, stride_b, CHUNK, S,
    BLOCK_ROWS: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Per (row, vocab split): max value and its first index; NaN wins (first NaN), like torch.argmax."""
    pid_r = tl.program_id(0)
    split = tl.program_id(1)
    rows = pid_r * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = rows < R
    rows64 = rows.to(tl.int64)
    base = (rows64 // B) * stride_n + (rows64 % B) * stride_b
    best_val = tl.full((BLOCK_ROWS,), float("-inf"), tl.float32)
    best_idx = tl.full((BLOCK_ROWS,), 2147483647, tl.int32)
    nan_idx = tl.full((BLOCK_ROWS,), 2147483647, tl.int32)
    v_lo = split * CHUNK
    for v0 in range(v_lo, v_lo + CHUNK, BLOCK_V):
        idx = v0 + tl.arange(0, BLOCK_V)
        ok = row_ok[:, None] & (idx < V)[None, :]
        x = tl.load(logits_ptr + base[:, None] + idx[None, :].to(tl.int64), mask=ok, other=float("-inf"))
        x = x.to(tl.float32)
        isn = (x != x) & ok
        nan_idx = tl.minimum(nan_idx, tl.min(tl.where(isn, idx[None, :], 2147483647), axis=1))
        xv = tl.where(ok & ~isn, x, float("-inf"))
        tmax = tl.max(xv, axis=1)
        tidx = tl.min(tl.where(ok & ~isn & (xv == tmax[:, None]), idx[None, :], 2147483647), axis=1)
        upd = (tmax > best_val) | ((best_idx == 2147483647) & (tidx < 2147483647))
        best_val = tl.where(upd, tmax, best_val)
        best_idx = tl.where(upd, tidx, best_idx)
    has_nan = nan_idx < 2147483647
    out_val = tl.where(has_nan, float("nan"), best_val)
    out_idx = tl.where(has_nan, nan_idx, best_idx)
    tl.store(pval_ptr + rows64 * S + split, out_val, mask=row_ok)
    tl.store(pidx_ptr + rows64 * S + split, out_idx, mask=row_ok)


@triton.jit
def _merge_argmax(pval_ptr, pidx_ptr, rows64, row_ok, S, BLOCK_S: tl.constexpr):
    """Reduce the per-split partials of ``rows`` to the global torch.argmax index (int32)."""
    sp = tl.arange(0, BLOCK_S)
    ok = row_ok[:, None] & (sp < S)[None, :]
    val = tl.load(pval_ptr + rows64[:, None] * S + sp[None, :], mask=ok, other=float("-inf"))
    idx = tl.load(pidx_ptr + rows64[:, None] * S + sp[None, :], mask=ok, other=2147483647)
    isn = (val != val) & ok
    nan_idx = tl.min(tl.where(isn, idx, 2147483647), axis=1)
    v = tl.where(ok & ~isn, val, float("-inf"))
    vmax = tl.max(v, axis=1)
    amax = tl.min(tl.where(ok & ~isn & (v == vmax[:, None]), idx, 2147483647), axis=1)
    return tl.where(nan_idx < 2147483647, nan_idx, amax)


@triton.jit
def _greedy_accept_kernel(
    pval_ptr, pidx_ptr, draft_ptr, acc_ptr, bonus_ptr, N, B, S, stride_dn, stride_dj,
    BLOCK_REQ: tl.constexpr, BLOCK_S: tl.constexpr,
):
    reqs = tl.program_id(0) * BLOCK_REQ + tl.arange(0, BLOCK_REQ)
    req_ok = reqs < N
    reqs64 = reqs.to(tl.int64)
    still = req_ok
    accepted = tl.zeros((BLOCK_REQ,), tl.int64)
    bonus = tl.zeros((BLOCK_REQ,), tl.int64)
    for j in range(0, B):
        target = _merge_argmax(pval_ptr, pidx_ptr, reqs64 * B + j, req_ok, S, BLOCK_S).to(tl.int64)
        # The row where the accepted prefix ends supplies the bonus: the last row reached with `still` set.
        bonus = tl.where(still, target, bonus)
        if j < B - 1:
            d = tl.load(draft_ptr + reqs64 * stride_dn + j * stride_dj, mask=req_ok, other=-1).to(tl.int64)
            still = still & (d == target)
            accepted += still.to(tl.int64)
    tl.store(acc_ptr + reqs64, accepted, mask=req_ok)
    tl.store(bonus_ptr + reqs64, bonus, mask=req_ok)


def _vocab_split(v: int, rows: int) -> tuple[int, int, int]:
    """(BLOCK_V, CHUNK, S): vocab tile width, split width (a multiple of BLOCK_V) and split count."""
    if interpreting():
        # Small tiles and two tiles per split so that CPU tests exercise the split merge and ragged tails.
        block_v = min(next_pow2(v), 1024)
        chunk = 2 * block_v
    else:
        block_v = min(next_pow2(v), 2048)
        # Aim for >= ~256 programs at batch 1 without making each program's loop trivially short.
        want_splits = max(1, min(triton.cdiv(v, 4 * block_v), triton.cdiv(512, max(rows, 1))))
        chunk = triton.cdiv(triton.cdiv(v, want_splits), block_v) * block_v
    return block_v, chunk, triton.cdiv(v, chunk)


def _rows_per_program(rows: int, block_v: int) -> int:
    if interpreting():
        return max(1, min(next_pow2(rows), max(1, 65536 // block_v)))
    return 1


def _split_launch_setup(logits):
    """Shared setup of the split-vocab launchers: two int64 [N] outputs, logits with a unit last
    stride, and the vocab split of the N*B rows."""
    n, b, v = logits.shape
    outputs = tuple(torch.empty(n, dtype=torch.int64, device=logits.device) for _ in range(2))
    if logits.stride(2) != 1:
        logits = logits.contiguous()
    return logits, outputs, n * b, _vocab_split(v, n * b)


def _verify_greedy_triton(logits, draft_tokens):
    n, b, v = logits.shape
    dev = logits.device
    logits, (accepted, bonus), r, (block_v, chunk, s) = _split_launch_setup(logits)
    if n == 0:
        return accepted, bonus
    pval = torch.empty((r, s), dtype=torch.float32, device=dev)
    pidx = torch.empty((r, s), dtype=torch.int32, device=dev)
    br = _rows_per_program(r, block_v)
    _argmax_partial_kernel[(triton.cdiv(r, br), s)](
        logits_ptr=logits, pval_ptr=pval, pidx_ptr=pidx, R=r, B=b, V=v,
        stride_n=logits.stride(0), stride_b=logits.stride(1), CHUNK=chunk, S=s,
        BLOCK_ROWS=br, BLOCK_V=block_v,
    )
    _greedy_accept_launch(pval, pidx, s, draft_tokens, n, b, accepted, bonus)
    return accepted, bonus


def _greedy_accept_launch(pval, pidx, s, draft_tokens, n, b, accepted, bonus):
    """The acceptance launch over per-split argmax partials ``pval``/``pidx`` ``[N * B, S]``."""
    block_req = min(next_pow2(n), 1024) if interpreting() else min(next_pow2(n), 64)
    _greedy_accept_kernel[(triton.cdiv(n, block_req),)](
        pval_ptr=pval, pidx_ptr=pidx, draft_ptr=draft_tokens, acc_ptr=accepted, bonus_ptr=bonus,
        N=n, B=b, S=s, stride_dn=draft_tokens.stride(0), stride_dj=draft_tokens.stride(1) if b > 1 else 0,
        BLOCK_REQ=block_req, BLOCK_S=next_pow2(s),
    )


def verify_greedy(logits: torch.Tensor, draft_tokens: torch.Tensor, *, backend: str = "auto"
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification of one drafted block per request (no host sync, at most two launches).

    Args:
        logits: ``[N, B, V]`` fp32/bf16/fp16, last dim contiguous. Row ``i`` is the target's distribution
            for the token that follows block position ``i`` (position 0 = the anchor / last committed token).
        draft_tokens: ``[N, B-1]`` int64 (int32 accepted), the drafted tokens at block positions 1..B-1.
            ``B == 1`` gives shape ``[N, 0]`` (nothing to verify, only the bonus).
        backend: ``"auto" | "ext" | "triton" | "cpu" | "torch"`` (``"cpu"``: CPU tensors, the argmax by NumPy).

    Returns:
        ``(accepted, bonus)``, both int64 ``[N]``: ``accepted[n]`` = length of the longest prefix with
        ``draft_tokens[n, j] == argmax(logits[n, j])``; ``bonus[n] = argmax(logits[n, accepted[n]])``.
        argmax is ``torch.argmax`` exactly: first index among ties, NaN counts as the maximum.
    """
    chosen = resolve_backend("verify_greedy", backend, logits.device, available=_GREEDY_BACKENDS)
    return call_op(_verify_greedy_op, logits, draft_tokens, chosen, device=logits.device)


def _check_greedy(logits, draft_tokens, backend):
    _validate("verify_greedy", logits, draft_tokens)


@torch.library.custom_op("dflash::verify_greedy", mutates_args=())
@checked_by(_check_greedy)
def _verify_greedy_op(logits: torch.Tensor, draft_tokens: torch.Tensor, backend: str
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.ops.dflash.verify_greedy``: :func:`verify_greedy` after validation (``backend`` may be "auto")."""
    chosen = resolve_backend("verify_greedy", backend, logits.device, available=_GREEDY_BACKENDS)
    body = registered("verify_greedy", chosen)
    if body is not None:
        return body(logits, draft_tokens)
    if chosen == "ext":
        from dflash_kernels import _ext

        return _ext.verify_greedy(logits, draft_tokens)
    if chosen == "torch":
        return verify_greedy_reference(logits, draft_tokens)
    return _verify_greedy_triton(logits, draft_tokens)


@_verify_greedy_op.register_fake
def _verify_greedy_fake(logits, draft_tokens, backend):
    n = logits.shape[0]
    return logits.new_empty((n,), dtype=torch.int64), logits.new_empty((n,), dtype=torch.int64)


def _validate_tokens(op: str, target_tokens, draft_tokens):
    check_tensor(op, "target_tokens", target_tokens, ndim=2, dtypes=(torch.int64, torch.int32))
    n, b = target_tokens.shape
    if b < 1:
        raise ValueError(f"{op}: target_tokens must be [N, B] with B >= 1, got {tuple(target_tokens.shape)}")
    check_tensor(op, "draft_tokens", draft_tokens, ndim=2, dtypes=(torch.int64, torch.int32),
                 device=target_tokens.device)
    if tuple(draft_tokens.shape) != (n, b - 1):
        raise ValueError(f"{op}: draft_tokens must be [N, B-1] = [{n}, {b - 1}] for target_tokens of shape "
                         f"{tuple(target_tokens.shape)}; got {tuple(draft_tokens.shape)}")


def verify_greedy_tokens_reference(target_tokens: torch.Tensor, draft_tokens: torch.Tensor
                                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Definition: :func:`verify_greedy_reference`'s rule on the argmax tokens themselves."""
    return _accept_greedy(target_tokens.to(torch.int64), draft_tokens)


def verify_greedy_tokens(target_tokens: torch.Tensor, draft_tokens: torch.Tensor, *, backend: str = "auto"
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`verify_greedy` given the target's argmax tokens instead of its logits (one launch, no host sync):
    for a verify whose LM head returns the argmax itself (``dflash_kernels.cpu.linear.linear_argmax`` on the CPU), so the
    logits are never written.

    Args:
        target_tokens: ``[N, B]`` int64 (int32 accepted), values in ``[0, 2**31 - 1)``: ``argmax(logits[n, i])`` of
            :func:`verify_greedy`.
        draft_tokens: ``[N, B-1]`` int64 (int32 accepted), the drafted tokens at block positions 1..B-1.
        backend: ``"auto" | "triton" | "cpu" | "torch"``.

    Returns:
        ``(accepted, bonus)``, both int64 ``[N]``: :func:`verify_greedy`'s for logits with these argmax tokens.
    """
    chosen = resolve_backend("verify_greedy_tokens", backend, target_tokens.device, available=_TOKENS_BACKENDS)
    return call_op(_verify_greedy_tokens_op, target_tokens, draft_tokens, chosen, device=target_tokens.device)


def _check_greedy_tokens(target_tokens, draft_tokens, backend):
    _validate_tokens("verify_greedy_tokens", target_tokens, draft_tokens)


@torch.library.custom_op("dflash::verify_greedy_tokens", mutates_args=())
@checked_by(_check_greedy_tokens)
def _verify_greedy_tokens_op(target_tokens: torch.Tensor, draft_tokens: torch.Tensor, backend: str
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.ops.dflash.verify_greedy_tokens``: :func:`verify_greedy_tokens` after validation."""
    chosen = resolve_backend("verify_greedy_tokens", backend, target_tokens.device, available=_TOKENS_BACKENDS)
    if chosen != "triton":
        return verify_greedy_tokens_reference(target_tokens, draft_tokens)
    n, b = target_tokens.shape
    dev = target_tokens.device
    accepted, bonus = (torch.empty(n, dtype=torch.int64, device=dev) for _ in range(2))
    if n:  # the tokens as argmax partials of one split (any value: a token's partial is never NaN)
        pidx = target_tokens.reshape(n * b, 1).to(torch.int32)
        pval = torch.zeros((n * b, 1), dtype=torch.float32, device=dev)
        _greedy_accept_launch(pval, pidx, 1, draft_tokens, n, b, accepted, bonus)
    return accepted, bonus


@_verify_greedy_tokens_op.register_fake
def _verify_greedy_tokens_fake(target_tokens, draft_tokens, backend):
    n = target_tokens.shape[0]
    return target_tokens.new_empty((n,), dtype=torch.int64), target_tokens.new_empty((n,), dtype=torch.int64)


# --------------------------------------------------------------------------------------------------
# sampled (temperature > 0)
# --------------------------------------------------------------------------------------------------

def filter_logits_reference(logits: torch.Tensor, temperature, top_k=0, top_p=1.0) -> torch.Tensor:
    """HF warper order: ``logits / temperature``, then top-k, then top-p; removed tokens become -inf.

    top-k keeps every token >= the k-th largest value (ties at the threshold are kept, as in HF).
    top-p removes the ascending-sorted tokens whose cumulative probability is <= 1 - top_p, keeping at
    least the largest one (HF ``TopPLogitsWarper``). Parameters may be per request ([N] tensors, logits
    [N, ...]); top_k <= 0 or >= V and top_p >= 1 disable a filter.
    """
    if any(isinstance(x, torch.Tensor) for x in (temperature, top_k, top_p)):
        def at(x, i):
            return x[i].item() if isinstance(x, torch.Tensor) else x

        return torch.stack([filter_logits_reference(logits[i], at(temperature, i), int(at(top_k, i)),
                                                    float(at(top_p, i))) for i in range(logits.shape[0])])
    dt = torch.float64 if logits.dtype == torch.float64 else torch.float32
    z = logits.to(dt) / temperature
    v = z.shape[-1]
    if 0 < top_k < v:
        kth = torch.topk(z, top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p < 1.0:
        z = z.masked_fill(~_top_p_keep(z, top_p), float("-inf"))
    return z


TOP_P_CANDIDATES = 256  # the tokens ranked first for top-p; a row whose nucleus reaches past them is sorted whole


def _top_p_keep(z: torch.Tensor, top_p: float) -> torch.Tensor:
    """HF's top-p rule as a keep mask of ``z [..., V]``: sorted ascending, a token is removed where the cumulative
    probability up to it is <= 1 - top_p, so kept where the mass of the tokens ranked above it is < top_p (the
    largest always). The nucleus usually lies in the first few hundred: those are ranked (``torch.topk``: 0.7 ms
    where sorting 8 rows of SmolLM2's 49,152 logits took 11.9 on a 2-core CPU), and only a row whose nucleus
    reaches past them is sorted whole. The same sets up to the rounding of the sums."""
    shape, v = z.shape, z.shape[-1]
    p = z.reshape(-1, v).softmax(dim=-1)
    top, idx = torch.topk(p, min(v, TOP_P_CANDIDATES), dim=-1)
    keep = torch.zeros_like(p, dtype=torch.bool).scatter_(-1, idx, _ranked_keep(top, top_p))
    wide = top.sum(-1) < top_p  # the nucleus may reach past the ranked tokens
    if bool(wide.any()):
        ranked, order = torch.sort(p[wide], dim=-1, descending=True)
        keep[wide] = torch.zeros_like(ranked, dtype=torch.bool).scatter_(-1, order, _ranked_keep(ranked, top_p))
    return keep.reshape(shape)


def _ranked_keep(ranked: torch.Tensor, top_p: float) -> torch.Tensor:
    """For probabilities ranked in descending order: whether the mass ranked above each is < top_p."""
    above = torch.cat([torch.zeros_like(ranked[..., :1]), ranked[..., :-1]], dim=-1).cumsum(dim=-1)
    return above < top_p


def _rng_for(seed, offset, device, stream: int = 0) -> torch.Generator:
    """The references' generator of (seed, offset); ``stream`` separates the draws of ops that run in one round
    with the same (seed, offset) (a candidate selector's picks must not reuse verification's uniforms)."""
    seed = int(seed.item()) if isinstance(seed, torch.Tensor) else int(seed)
    offset = int(offset.item()) if isinstance(offset, torch.Tensor) else int(offset)
    g = torch.Generator(device=device)
    g.manual_seed((seed * 0x9E3779B97F4A7C15 + offset + stream * 0xD1B54A32D192ED03) % (2**63 - 1))
    return g


def gumbel_max(log_weights: torch.Tensor, g: torch.Generator) -> int:
    """The references' draw: a token of ``log_weights [V]`` (logs of unnormalised probabilities, -inf where a
    token cannot be drawn) by Gumbel-max in fp64, a fresh uniform from ``g`` for each entry above -inf. The other
    entries have probability 0, so leaving them out changes nothing but the cost: a top-p nucleus (a few to ~256
    tokens) rather than SmolLM2's 49,152 (a tree node's draw 1.06 -> 0.44 ms on a 2-core Xeon). Where an entry is
    NaN or +inf, or none is above -inf, a uniform for every entry (the argmax then picks the first NaN or +inf)."""
    kept = (log_weights != float("-inf")).nonzero().squeeze(1)  # (NaN kept: it sends the draw to the whole rule)
    weights = log_weights[kept]
    if not kept.numel() or not bool(torch.isfinite(weights).all()):
        kept, weights = None, log_weights
    u = torch.rand(weights.shape, generator=g, device=weights.device, dtype=torch.float64).clamp_min(1e-300)
    i = int((weights.double() - torch.log(-torch.log(u))).argmax())
    return i if kept is None else int(kept[i])


def verify_sample_reference(logits: torch.Tensor, draft_tokens: torch.Tensor, *, temperature, top_k=0, top_p=1.0,
                            seed=0, offset=0, draft_probs=None,
                            draft_indices=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Definition (materialises the probabilities; the reference reads seed/offset on the host).

    p_j = softmax(filter(logits[:, j])), q_j = the draft's distribution at row j: one-hot at d_j, or (given
    ``draft_probs`` / ``draft_indices`` [N, B-1, K]) ``draft_probs[:, j, t]`` on token ``draft_indices[:, j, t]``
    (summed where a token is listed twice). Accept d_j with probability min(1, p_j(d_j) / q_j(d_j)) (u * q < p)
    while all earlier drafts were accepted; at the first rejection j sample from max(p_j - q_j, 0) renormalised
    (p_j itself where that is zero everywhere; one-hot q: p_j with d_j removed); if all B-1 drafts are accepted
    sample the bonus from p_{B-1}. Its random stream differs from the Triton kernel's.
    """
    n, b, v = logits.shape
    g = _rng_for(seed, offset, logits.device)
    z = filter_logits_reference(logits, temperature, top_k, top_p)
    p = z.softmax(dim=-1)                                                     # [N, B, V]
    d = draft_tokens.to(torch.int64)
    in_range = (d >= 0) & (d < v)  # an out-of-range draft token is rejected and removes nothing
    q = torch.zeros_like(p[:, :-1])
    if draft_probs is None:
        q.scatter_(-1, d.clamp(0, v - 1)[..., None], in_range[..., None].to(q.dtype))
    else:
        q.scatter_add_(-1, draft_indices.to(torch.int64), draft_probs.to(q.dtype))
    p_d = torch.where(in_range, p[:, :-1].gather(-1, d.clamp(0, v - 1)[..., None]).squeeze(-1), 0.0)
    q_d = torch.where(in_range, q.gather(-1, d.clamp(0, v - 1)[..., None]).squeeze(-1), 0.0)
    u = torch.rand((n, b - 1), generator=g, device=logits.device, dtype=torch.float64)
    accept = (u * q_d.double() < p_d.double()).to(torch.int64)
    accepted = accept.cumprod(dim=1).sum(dim=1)
    residual = p.clone()
    if b > 1:
        left = (p[:, :-1] - q).clamp_min(0.0)
        residual[:, :-1] = torch.where(left.sum(-1, keepdim=True) > 0, left, p[:, :-1])
    row = residual.gather(1, accepted[:, None, None].expand(n, 1, v)).squeeze(1)  # [N, V]
    next_token = torch.tensor([gumbel_max(r.double().log(), g) for r in row], dtype=torch.int64,
                              device=logits.device)
    return accepted, next_token


@triton.jit
def _order_key(z):
    """Order-preserving int32 key of fp32 values (-0.0 folded into +0.0 first, as float compares do)."""
    bits = (z + 0.0).to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


# Exact top-k / top-p threshold: radix select over the 32-bit order key, split across CTAs.
#
# The key (``_order_key``) is read as 8 digits of 4 bits, most significant first. Launch t of a search
# histograms digit t over the tokens whose key lies in the bucket resolved so far: grid (row blocks, vocab
# splits; one row per block on a GPU), 16 counts (top-k) or 16 probability masses (top-p) per (row, split),
# each in its own place (no atomics, so the result is deterministic). The next launch starts by resolving
# digit t from those per-split histograms: every program of the row does it redundantly (16 * splits
# values, so no select launch), and split 0 records it for the launch after. A final per-row launch
# resolves the last digit and writes the threshold. Histograms and search state live in two slots written
# by alternate launches, so no launch overwrites what its own programs still read.
_RADIX_BINS = 16                     # 4-bit digits; the kernels hard-code them (shifts 28 - 4 * level, & 15)
_RADIX_PASSES = 8


def threshold_launches(use_top_k: bool, use_top_p: bool) -> int:
    """Launches of the top-k / top-p threshold: 8 histogram passes per filter, plus one that writes it."""
    filters = int(use_top_k) + int(use_top_p)
    return filters * _RADIX_PASSES + 1 if filters else 0


def threshold_bytes(rows: int, vocab: int, itemsize: int, use_top_k: bool, use_top_p: bool) -> int:
    """Bytes the threshold launches move for ``rows`` rows of ``vocab`` logits of ``itemsize`` bytes.

    Each histogram pass reads the logits once (top-p's first pass twice: its split maxima, then its masses)
    and writes 16 four-byte bins per (row, split); each program of the next launch re-reads its row's bins
    (splits * 64 bytes), and top-p's picks the split maxima. Per-row parameters and search state (< 64 bytes
    per row and launch) are left out; the threshold written is counted."""
    passes = _RADIX_PASSES * (int(use_top_k) + int(use_top_p))
    if not passes:
        return 0
    _, _, s = _vocab_split(vocab, rows)
    bins = rows * s * _RADIX_BINS * 4                               # one pass's histograms
    total = (passes + int(use_top_p)) * rows * vocab * itemsize
    total += passes * bins + ((passes - 1) * s + 1) * bins          # written; read by (rows, splits) or rows programs
    if use_top_p:
        total += rows * s * 4 * ((_RADIX_PASSES - 1) * s + 2)       # split maxima: written once, read 7 * s + 1 times
    return total + rows * 4


@triton.jit
def _radix_pick(cnt_ptr, mass_ptr, pmax_ptr, pre_ptr, acc_ptr, budget_ptr, topk_ptr, topp_ptr, rows, row_ok, prm,
                R, V, S, sel, rd, MASS: tl.constexpr, BLOCK_S: tl.constexpr):
    """Resolve digit ``sel`` of the rows' searches from the per-split histograms in slot ``rd``.

    Returns (prefix, carry, m), each [BLOCK_ROWS]: the sel+1 resolved digits (the top bits of key + 2**31),
    the carry into the next digit, and the row max of the kept z (top-p; 0.0 for top-k).
    top-k (counts): the largest digit d with count(digit >= d) >= need, where need (carry) starts at k and
    drops by the count above each chosen bucket, so it ends on the k-th largest key exactly.
    top-p (masses): the smallest d with mass(digit <= d) > budget, where budget (carry) starts at
    (1 - top_p) * total and drops by the mass below each chosen bucket; if fp32 rounding of the finer
    bins leaves no such d, the largest bucket with mass (the bound was reached at its top).
    """
    sp = tl.arange(0, BLOCK_S)
    bins = tl.arange(0, 16)
    hofs = ((rd * R + rows[:, None, None]) * S + sp[None, :, None]) * 16 + bins[None, None, :]
    hmask = row_ok[:, None, None] & (sp < S)[None, :, None]
    first = sel == 0
    later = row_ok & (sel != 0)
    prefix = tl.load(pre_ptr + rd * R + rows, mask=later, other=0)
    if MASS:
        pm = tl.load(pmax_ptr + rows[:, None] * S + sp[None, :], mask=row_ok[:, None] & (sp < S)[None, :],
                     other=float("-inf"))
        m = tl.max(pm, axis=1)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        # The first pass's bins are relative to each split's own max; later passes use the row max m.
        scale = tl.where(first, tl.exp(pm - m_safe[:, None]), 1.0)
        h = tl.sum(tl.load(mass_ptr + hofs, mask=hmask, other=0.0) * scale[:, :, None], axis=1)
        top_p = tl.load(topp_ptr + prm, mask=row_ok, other=1.0)
        budget = tl.where(first, (1.0 - top_p) * tl.sum(h, axis=1),
                          tl.load(budget_ptr + rd * R + rows, mask=later, other=0.0))
        cum = tl.sum(tl.where(bins[None, None, :] <= bins[None, :, None], h[:, None, :], 0.0), axis=2)
        d_first = tl.min(tl.where(cum > budget[:, None], bins[None, :], 16), axis=1)
        d = tl.where(d_first < 16, d_first, tl.max(tl.where(h > 0.0, bins[None, :], 0), axis=1))
        # cum is monotone, so the chosen bucket has mass and budget - cum[d-1] >= 0.
        carry = budget - tl.sum(tl.where(bins[None, :] == d[:, None] - 1, cum, 0.0), axis=1)
    else:
        m = tl.zeros_like(rows).to(tl.float32)
        h = tl.sum(tl.load(cnt_ptr + hofs, mask=hmask, other=0), axis=1).to(tl.int64)
        k = tl.load(topk_ptr + prm, mask=row_ok, other=0).to(tl.int64)
        # A disabled row (k <= 0 or k >= V) searches for the V-th largest key: the row min, so all is kept.
        need = tl.where(first, tl.where((k > 0) & (k < V), k, V), tl.load(acc_ptr + rd * R + rows, mask=later, other=1))
        suf = tl.sum(tl.where(bins[None, None, :] >= bins[None, :, None], h[:, None, :], 0), axis=2)
        d = tl.max(tl.where(suf >= need[:, None], bins[None, :], 0), axis=1)
        carry = need - tl.sum(tl.where(bins[None, :] > d[:, None], h, 0), axis=1)
    return prefix * 16 + d, carry, m


# level / slot / has_lb change between launches: one compiled kernel per (PREV, HIST), not per value.
@triton.jit(do_not_specialize=["level", "slot", "has_lb"])
def _threshold_pass_kernel(
    logits_ptr, temp_ptr, topk_ptr, topp_ptr, cnt_ptr, mass_ptr, pmax_ptr, pre_ptr, acc_ptr, budget_ptr, thr_ptr,
    R, B, V, stride_n, stride_b, stride_param, CHUNK, S, level, slot, has_lb,
    PREV: tl.constexpr, HIST: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """One launch of the threshold search; grid (row blocks, vocab splits), or (row blocks, 1) for the last.

    PREV (what the previous launch histogrammed): 0 nothing, 1 top-k counts, 2 top-p masses; its last digit
    is resolved first (digit level-1, or digit 7 when the search changes). HIST: 1 counts / 2 masses of
    digit ``level`` of this launch's search, or 0: write the threshold (smallest kept key) instead.
    Tokens with key(logits * inv_temp) < thr are filtered out; top-p's masses are over the tokens top-k
    keeps (thr_ptr holds top-k's threshold from top-p's first launch on when has_lb).
    """
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = rows < R
    rows = rows.to(tl.int64)
    split = tl.program_id(1)
    prm = (rows // B) * stride_param
    rd = 1 - slot
    if PREV != 0:
        prefix, carry, m = _radix_pick(cnt_ptr, mass_ptr, pmax_ptr, pre_ptr, acc_ptr, budget_ptr, topk_ptr, topp_ptr,
                                       rows, row_ok, prm, R, V, S, (level + 7) % 8, rd, PREV == 2, BLOCK_S)
        if PREV != HIST:
            # The previous search ended: prefix is its whole key + 2**31; this search starts from the root.
            prev_key = (prefix - 2147483648).to(tl.int32)
            prefix = tl.zeros_like(rows)
    else:
        prefix = tl.zeros_like(rows)
    if PREV == 1 and HIST != 1:
        lb = prev_key                                # top-k's threshold bounds top-p's search
    else:
        lb = tl.load(thr_ptr + rows, mask=row_ok & (has_lb != 0), other=-2147483648)
    if HIST == 0:
        if PREV == 2:
            top_p = tl.load(topp_ptr + prm, mask=row_ok, other=1.0)
            prev_key = tl.where(top_p < 1.0, prev_key, lb)
        tl.store(thr_ptr + rows, prev_key, mask=row_ok)
    else:
        if split == 0:
            if PREV == HIST:
                tl.store(pre_ptr + slot * R + rows, prefix, mask=row_ok)
                if HIST == 2:
                    tl.store(budget_ptr + slot * R + rows, carry, mask=row_ok)
                else:
                    tl.store(acc_ptr + slot * R + rows, carry, mask=row_ok)
            if PREV == 1 and HIST == 2:
                tl.store(thr_ptr + rows, lb, mask=row_ok)
        # Candidates: keys in the resolved bucket [lo, hi] and >= lb; digit = bits of key + 2**31.
        width = tl.full((), 1, tl.int64) << (32 - 4 * level)
        lo = prefix * width - 2147483648
        hi = (lo + width - 1).to(tl.int32)[:, None]
        lo = tl.maximum(lo, lb.to(tl.int64)).to(tl.int32)[:, None]
        shift = 28 - 4 * level
        base = ((rows // B) * stride_n + (rows % B) * stride_b)[:, None]
        inv_temp = (1.0 / tl.load(temp_ptr + prm, mask=row_ok, other=1.0))[:, None]
        bins = tl.arange(0, 16)
        v_lo = split * CHUNK
        if HIST == 2:
            if PREV != 2:
                # First top-p pass: the row max is not known yet; bin masses relative to this split's max.
                m = tl.full((BLOCK_ROWS,), float("-inf"), tl.float32)
                for v0 in range(v_lo, v_lo + CHUNK, BLOCK_V):
                    idx = v0 + tl.arange(0, BLOCK_V)
                    ok = row_ok[:, None] & (idx < V)[None, :]
                    z = tl.load(logits_ptr + base + idx[None, :].to(tl.int64), mask=ok, other=0.0).to(tl.float32)
                    z = z * inv_temp
                    m = tl.maximum(m, tl.max(tl.where(ok & (_order_key(z) >= lo), z, float("-inf")), axis=1))
                tl.store(pmax_ptr + rows * S + split, m, mask=row_ok)
            m = tl.where(m == float("-inf"), 0.0, m)[:, None]
            acc = tl.zeros((BLOCK_ROWS, 16, BLOCK_V), tl.float32)
        else:
            acc = tl.zeros((BLOCK_ROWS, 16, BLOCK_V), tl.int32)
        for v0 in range(v_lo, v_lo + CHUNK, BLOCK_V):
            idx = v0 + tl.arange(0, BLOCK_V)
            ok = row_ok[:, None] & (idx < V)[None, :]
            z = tl.load(logits_ptr + base + idx[None, :].to(tl.int64), mask=ok, other=0.0).to(tl.float32) * inv_temp
            key = _order_key(z)
            cand = ok & (key >= lo) & (key <= hi)
            # Late passes usually have few candidates: skip the 16-bin one-hot for tiles without any.
            if tl.max(tl.max(cand.to(tl.int32), axis=1), axis=0) > 0:
                digit = tl.where(cand, ((key ^ -2147483648) >> shift) & 15, 16)
                # Bins in the middle, tokens last: each thread keeps all 16 bins of its own tokens, so the
                # per-token work is not replicated across the bins.
                hit = digit[:, None, :] == bins[None, :, None]
                if HIST == 2:
                    acc += tl.where(hit, tl.exp(z - m)[:, None, :], 0.0)
                else:
                    acc += hit.to(tl.int32)
        out = ((slot * R + rows[:, None]) * S + split) * 16 + bins[None, :]
        if HIST == 2:
            tl.store(mass_ptr + out, tl.sum(acc, axis=2), mask=row_ok[:, None])
        else:
            tl.store(cnt_ptr + out, tl.sum(acc, axis=2), mask=row_ok[:, None])


@triton.jit
def _sample_partial_kernel(
    z_ptr, draft_ptr, seed_ptr, offset_ptr, thr_ptr, pm_ptr, ps_ptr, pbest_ptr, pidx_ptr,
    temp_ptr, R, B, V, stride_n, stride_b, stride_dn, stride_dj, stride_param, CHUNK, S,
    FILTER: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_V: tl.constexpr,
    K=1, stride_dk=0, SPARSE: tl.constexpr = False,
):
    """Per (row, vocab split): online max / sum-exp of logits*inv_temp, and the Gumbel-max winner of the
    row's residual (the row's draft token excluded; the last block row excludes nothing). ``SPARSE``: draft_ptr
    holds the row's K candidate ids (stride_dk apart), all excluded here; the accept kernel scores them."""
    pid_r = tl.program_id(0)
    split = tl.program_id(1)
    rows = pid_r * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = rows < R
    rows64 = rows.to(tl.int64)
    n = rows64 // B
    j = rows64 % B
    base = n * stride_n + j * stride_b
    excl = tl.load(draft_ptr + n * stride_dn + j * stride_dj, mask=row_ok & (j < B - 1), other=-1)
    excl = excl.to(tl.int64)
    inv_temp = (1.0 / tl.load(temp_ptr + n * stride_param, mask=row_ok, other=1.0))[:, None]
    if FILTER:
        thr = tl.load(thr_ptr + rows64, mask=row_ok, other=0)
    seed = tl.load(seed_ptr)
    off = tl.load(offset_ptr)
    c2 = tl.zeros((BLOCK_ROWS, BLOCK_V), tl.uint32) + (off & 0xFFFFFFFF).to(tl.uint32)
    c3 = tl.zeros((BLOCK_ROWS, BLOCK_V), tl.uint32) + ((off >> 32) * 2).to(tl.uint32)
    c1 = (tl.zeros((BLOCK_ROWS, BLOCK_V), tl.int64) + rows64[:, None]).to(tl.uint32)
    m = tl.full((BLOCK_ROWS,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_ROWS,), tl.float32)
    best = tl.full((BLOCK_ROWS,), float("-inf"), tl.float32)
    best_idx = tl.full((BLOCK_ROWS,), -1, tl.int32)
    v_lo = split * CHUNK
    for v0 in range(v_lo, v_lo + CHUNK, BLOCK_V):
        idx = v0 + tl.arange(0, BLOCK_V)
        ok = row_ok[:, None] & (idx < V)[None, :]
        z = tl.load(z_ptr + base[:, None] + idx[None, :].to(tl.int64), mask=ok, other=float("-inf"))
        z = z.to(tl.float32) * inv_temp
        if FILTER:
            ok = ok & (_order_key(z) >= thr[:, None])
        z = tl.where(ok, z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(z - m_safe[:, None]), axis=1)
        m = m_new
        c0 = (tl.zeros((BLOCK_ROWS, BLOCK_V), tl.int32) + idx[None, :]).to(tl.uint32)
        r0, _, _, _ = tl.philox(seed, c0, c1, c2, c3)
        u = tl.uint_to_uniform_float(r0)
        gumbel = -tl.log(-tl.log(u))
        if SPARSE:
            hit = idx[None, :].to(tl.int64) == excl[:, None]
            for t in range(1, K):
                other = tl.load(draft_ptr + n * stride_dn + j * stride_dj + t * stride_dk,
                                mask=row_ok & (j < B - 1), other=-1).to(tl.int64)
                hit = hit | (idx[None, :].to(tl.int64) == other[:, None])
            cand = ok & (z > float("-inf")) & ~hit
        else:
            cand = ok & (z > float("-inf")) & (idx[None, :].to(tl.int64) != excl[:, None])
        score = tl.where(cand, z + gumbel, float("-inf"))
        tbest = tl.max(score, axis=1)
        tidx = tl.min(tl.where(cand & (score == tbest[:, None]), idx[None, :], 2147483647), axis=1)
        upd = (tbest > best) & (tidx < 2147483647)
        best = tl.where(upd, tbest, best)
        best_idx = tl.where(upd, tidx, best_idx)
    out = rows64 * S + split
    tl.store(pm_ptr + out, m, mask=row_ok)
    tl.store(ps_ptr + out, s, mask=row_ok)
    tl.store(pbest_ptr + out, best, mask=row_ok)
    tl.store(pidx_ptr + out, best_idx, mask=row_ok)


@triton.jit
def _sample_accept_kernel(
    z_ptr, draft_ptr, seed_ptr, offset_ptr, thr_ptr, pm_ptr, ps_ptr, pbest_ptr, pidx_ptr, acc_ptr, tok_ptr,
    temp_ptr, N, B, V, S, stride_n, stride_b, stride_dn, stride_dj, stride_param,
    FILTER: tl.constexpr, BLOCK_REQ: tl.constexpr, BLOCK_S: tl.constexpr,
    cand_ptr=None, q_ptr=None, K=1, stride_cn=0, stride_cj=0, stride_qn=0, stride_qj=0,
    SPARSE: tl.constexpr = False, BLOCK_K: tl.constexpr = 1,
):
    """Per request: walk the block rows, accepting d_j with probability min(1, p_j(d_j) / q_j(d_j)) (q one-hot at
    d_j unless ``SPARSE``, where q_j is the draft's distribution over the row's K candidates); the request's token
    is the residual draw of its first rejected row, or the last row's draw. ``SPARSE``: the candidates' residual
    weights max(p - q, 0) enter the Gumbel-max here, with the noise the partial kernel would have drawn for them
    (the row's draw is p itself where the whole residual is zero)."""
    reqs = tl.program_id(0) * BLOCK_REQ + tl.arange(0, BLOCK_REQ)
    req_ok = reqs < N
    reqs64 = reqs.to(tl.int64)
    seed = tl.load(seed_ptr)
    off = tl.load(offset_ptr)
    inv_temp = 1.0 / tl.load(temp_ptr + reqs64 * stride_param, mask=req_ok, other=1.0)
    sp = tl.arange(0, BLOCK_S)
    still = req_ok
    accepted = tl.zeros((BLOCK_REQ,), tl.int64)
    token = tl.zeros((BLOCK_REQ,), tl.int64)
    for j in range(0, B):
        live = still  # row j's draw is the request's token unless d_j is accepted
        rows64 = reqs64 * B + j
        ok = req_ok[:, None] & (sp < S)[None, :]
        pofs = rows64[:, None] * S + sp[None, :]
        best = tl.load(pbest_ptr + pofs, mask=ok, other=float("-inf"))
        bidx = tl.load(pidx_ptr + pofs, mask=ok, other=-1)
        tbest = tl.max(best, axis=1)
        tok_j = tl.min(tl.where(ok & (best == tbest[:, None]) & (bidx >= 0), bidx, 2147483647), axis=1)
        if j < B - 1:
            pm = tl.load(pm_ptr + pofs, mask=ok, other=float("-inf"))
            ps = tl.load(ps_ptr + pofs, mask=ok, other=0.0)
            gm = tl.max(pm, axis=1)
            gm_safe = tl.where(gm == float("-inf"), 0.0, gm)
            total = tl.sum(ps * tl.exp(pm - gm_safe[:, None]), axis=1)
            d = tl.load(draft_ptr + reqs64 * stride_dn + j * stride_dj, mask=req_ok, other=-1).to(tl.int64)
            d_ok = req_ok & (d >= 0) & (d < V)
            zd = tl.load(z_ptr + reqs64 * stride_n + j * stride_b + d, mask=d_ok, other=float("-inf"))
            zd = zd.to(tl.float32) * inv_temp
            if FILTER:
                thr = tl.load(thr_ptr + reqs64 * B + j, mask=req_ok, other=0)
                zd = tl.where(_order_key(zd) >= thr, zd, float("-inf"))
            p_d = tl.exp(zd - gm_safe) / tl.where(total > 0, total, 1.0)
            c0 = (tl.zeros((BLOCK_REQ,), tl.int64) + j).to(tl.uint32)
            c1 = reqs64.to(tl.uint32)
            c2 = (tl.zeros((BLOCK_REQ,), tl.int64) + (off & 0xFFFFFFFF)).to(tl.uint32)
            c3 = (tl.zeros((BLOCK_REQ,), tl.int64) + ((off >> 32) * 2 + 1)).to(tl.uint32)
            r0, _, _, _ = tl.philox(seed, c0, c1, c2, c3)
            u = tl.uint_to_uniform_float(r0)
            if SPARSE:
                slots = tl.arange(0, BLOCK_K)
                c_ok = req_ok[:, None] & (slots < K)[None, :]
                cand = tl.load(cand_ptr + reqs64[:, None] * stride_cn + j * stride_cj + slots[None, :],
                               mask=c_ok, other=-1).to(tl.int64)
                c_ok = c_ok & (cand >= 0) & (cand < V)
                q = tl.load(q_ptr + reqs64[:, None] * stride_qn + j * stride_qj + slots[None, :], mask=c_ok,
                            other=0.0).to(tl.float32)
                # q of each slot's token (a token listed twice holds both slots' mass), and of d_j
                same = (cand[:, :, None] == cand[:, None, :]) & c_ok[:, None, :]
                q_tok = tl.sum(tl.where(same, q[:, None, :], 0.0), axis=2)
                q_d = tl.sum(tl.where(c_ok & (cand == d[:, None]), q, 0.0), axis=1)
                zc = tl.load(z_ptr + reqs64[:, None] * stride_n + j * stride_b + cand, mask=c_ok,
                             other=float("-inf")).to(tl.float32) * inv_temp[:, None]
                if FILTER:
                    zc = tl.where(_order_key(zc) >= thr[:, None], zc, float("-inf"))
                p_c = tl.exp(zc - gm_safe[:, None]) / tl.where(total > 0, total, 1.0)[:, None]
                w = tl.maximum(p_c - q_tok, 0.0)
                g0 = cand.to(tl.uint32)
                g1 = (tl.zeros((BLOCK_REQ, BLOCK_K), tl.int64) + rows64[:, None]).to(tl.uint32)
                g2 = (tl.zeros((BLOCK_REQ, BLOCK_K), tl.int64) + (off & 0xFFFFFFFF)).to(tl.uint32)
                g3 = (tl.zeros((BLOCK_REQ, BLOCK_K), tl.int64) + ((off >> 32) * 2)).to(tl.uint32)
                n0, _, _, _ = tl.philox(seed, g0, g1, g2, g3)
                gumbel = -tl.log(-tl.log(tl.uint_to_uniform_float(n0)))
                # on the others' scale z = log p + gm + log(total)
                score = tl.where(w > 0, tl.log(w) + gm_safe[:, None] + tl.log(total)[:, None] + gumbel,
                                 float("-inf"))
                cbest = tl.max(score, axis=1)
                ctok = tl.min(tl.where(score == cbest[:, None], cand, 2147483647), axis=1).to(tl.int32)
                # an empty residual (all of p on candidates, q >= p there): the draw is from p itself
                empty = (tbest == float("-inf")) & (cbest == float("-inf"))
                pscore = tl.where(c_ok & (zc > float("-inf")), zc + gumbel, float("-inf"))
                p_best = tl.max(pscore, axis=1)
                ptok = tl.min(tl.where(pscore == p_best[:, None], cand, 2147483647), axis=1).to(tl.int32)
                tok_j = tl.where(empty, ptok, tl.where(cbest > tbest, ctok, tok_j))
                still = still & (u * q_d < p_d)
            else:
                still = still & (u < p_d)
            accepted += still.to(tl.int64)
        token = tl.where(live, tok_j.to(tl.int64), token)
    tl.store(acc_ptr + reqs64, accepted, mask=req_ok)
    tl.store(tok_ptr + reqs64, token, mask=req_ok)


def order_key_reference(z: torch.Tensor) -> torch.Tensor:
    """Host mirror of the kernels' order key of fp32 values (for tests and debugging)."""
    bits = (z.to(torch.float32) + 0.0).view(torch.int32)
    return torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


def _filter_threshold(logits: torch.Tensor, temp_t: torch.Tensor, topk_t: torch.Tensor, topp_t: torch.Tensor,
                      use_top_k: bool, use_top_p: bool) -> torch.Tensor:
    """[N*B] int32: token x of row r survives top-k/top-p iff order_key(logits[r, x] / temp) >= thr[r].

    ``threshold_launches(use_top_k, use_top_p)`` launches; no host sync, static shapes."""
    n, b, v = logits.shape
    r = n * b
    dev = logits.device
    block_v, chunk, s = _vocab_split(v, r)
    # The one-hot bins are a [BLOCK_V, 16] accumulator: a 256-token tile keeps it in registers on a GPU.
    block_v = block_v if interpreting() else min(block_v, 256)
    thr = torch.empty(r, dtype=torch.int32, device=dev)
    # Buffers of a filter that is off are never read: any tensor stands in for their pointers.
    cnt = torch.empty((2, r, s, _RADIX_BINS), dtype=torch.int32, device=dev) if use_top_k else thr
    mass = torch.empty((2, r, s, _RADIX_BINS), dtype=torch.float32, device=dev) if use_top_p else thr
    pmax = torch.empty((r, s), dtype=torch.float32, device=dev) if use_top_p else thr
    pre = torch.empty((2, r), dtype=torch.int64, device=dev)
    acc = torch.empty((2, r), dtype=torch.int64, device=dev) if use_top_k else pre
    budget = torch.empty((2, r), dtype=torch.float32, device=dev) if use_top_p else thr
    plan = []                                                   # (PREV, HIST, level, has_lb)
    if use_top_k:
        plan += [(1 if t else 0, 1, t, 0) for t in range(_RADIX_PASSES)]
    if use_top_p:
        plan += [(2 if t else int(use_top_k), 2, t, int(use_top_k and t > 0)) for t in range(_RADIX_PASSES)]
    plan.append((2 if use_top_p else 1, 0, _RADIX_PASSES, int(use_top_k and use_top_p)))
    br = _rows_per_program(r, max(block_v, 16))          # tiles [rows, max(BLOCK_V, 16), 16] <= 2**20
    for g, (prev, hist, level, has_lb) in enumerate(plan):
        _threshold_pass_kernel[(triton.cdiv(r, br), s if hist else 1)](
            logits_ptr=logits, temp_ptr=temp_t, topk_ptr=topk_t, topp_ptr=topp_t, cnt_ptr=cnt, mass_ptr=mass,
            pmax_ptr=pmax, pre_ptr=pre, acc_ptr=acc, budget_ptr=budget, thr_ptr=thr, R=r, B=b, V=v,
            stride_n=logits.stride(0), stride_b=logits.stride(1), stride_param=1 if temp_t.numel() > 1 else 0,
            CHUNK=chunk, S=s, level=level, slot=g % 2, has_lb=has_lb, PREV=prev, HIST=hist, BLOCK_ROWS=br,
            BLOCK_V=block_v, BLOCK_S=next_pow2(s),
        )
    return thr


def check_packed_sampling(op: str, n: int, temperature, top_k, top_p, seed, offset, device) -> None:
    """Validate the sampling ops' packed tensors (:func:`sampling_op_args`' results, as a registered op takes them):
    temperature / top_k / top_p 1-D of one length, 1 (one value for the batch) or N (per request), seed and offset
    one element each, all on ``device``; any float dtype for temperature and top_p, any integer one for top_k (the
    ops convert). The kernels index the parameters by request when their length is not 1."""
    for name, t, floating in (("temperature", temperature, True), ("top_k", top_k, False), ("top_p", top_p, True)):
        check_tensor(op, name, t, ndim=1, device=device)
        if t.is_floating_point() != floating or t.is_complex() or t.dtype == torch.bool:
            raise TypeError(f"{op}: {name} must be {'a float' if floating else 'an integer'} tensor, got {t.dtype}")
        if t.shape[0] not in (1, n) or t.shape != temperature.shape:
            raise ValueError(f"{op}: temperature, top_k and top_p must be [1] or [N={n}] alike, got "
                             f"{tuple(temperature.shape)}, {tuple(top_k.shape)}, {tuple(top_p.shape)}")
    for name, t in (("seed", seed), ("offset", offset)):
        as_index_tensor(op, name, t, device)


def _sampling_params(op: str, n: int, temperature, top_k, top_p, device):
    """Validate the sampling parameters and pass them on as device tensors of length 1 (one value for the
    batch, packed here) or N (per request: the caller's tensors themselves, never copied, so that a replay
    reads their current values). Scalars are packed exactly (fp64 / int64); the op converts."""
    per_request = any(isinstance(x, torch.Tensor) for x in (temperature, top_k, top_p))
    length = n if per_request else 1

    def pack(name, x, dtypes, dtype, scalar_ok, rule):
        if isinstance(x, torch.Tensor):
            check_tensor(op, name, x, ndim=1, dtypes=dtypes, device=device)
            if x.shape[0] != n:
                raise ValueError(f"{op}: per-request {name} must be [N={n}], got {tuple(x.shape)}")
            return x
        if isinstance(x, bool) or not scalar_ok(x):
            raise ValueError(f"{op}: {name} must be {rule} or an [N] tensor, got {x!r}")
        return torch.full((length,), x, dtype=dtype, device=device)

    temp_t = pack("temperature", temperature, (torch.float32, torch.float64), torch.float64,
                  lambda x: isinstance(x, (float, int)) and x > 0, "a float > 0 (use verify_greedy for temperature 0)")
    topk_t = pack("top_k", top_k, (torch.int32, torch.int64), torch.int64,
                  lambda x: isinstance(x, int) and x >= 0, "an int >= 0 (0 disables)")
    topp_t = pack("top_p", top_p, (torch.float32, torch.float64), torch.float64,
                  lambda x: isinstance(x, (float, int)) and 0.0 < x <= 1.0, "in (0, 1] (1 disables)")
    return temp_t, topk_t, topp_t


def sampling_op_args(op: str, logits: torch.Tensor, temperature, top_k, top_p, seed, offset) -> tuple:
    """The sampling ops' packed arguments ``(temperature, top_k, top_p, seed, offset, use_top_k, use_top_p)``
    for ``logits`` [N, ..., V] (validated; tensors passed on as they are)."""
    temp_t, topk_t, topp_t = _sampling_params(op, logits.shape[0], temperature, top_k, top_p, logits.device)
    seed_t = as_index_tensor(op, "seed", seed, logits.device)
    offset_t = as_index_tensor(op, "offset", offset, logits.device)
    # Which filters run is fixed per call site: a per-request tensor always filters (its rows disable
    # themselves on the device); a scalar filters iff its value does something.
    v = logits.shape[-1]
    use_top_k = isinstance(top_k, torch.Tensor) or 0 < top_k < v
    use_top_p = isinstance(top_p, torch.Tensor) or top_p < 1.0
    return temp_t, topk_t, topp_t, seed_t, offset_t, use_top_k, use_top_p


def _verify_sample_triton(logits, draft_tokens, temp_t, topk_t, topp_t, seed_t, offset_t, use_top_k, use_top_p,
                          draft_probs=None, draft_indices=None):
    n, b, v = logits.shape
    dev = logits.device
    logits, (accepted, token), r, (block_v, chunk, s) = _split_launch_setup(logits)
    if n == 0:
        return accepted, token
    pm = torch.empty((r, s), dtype=torch.float32, device=dev)
    ps = torch.empty_like(pm)
    pbest = torch.empty_like(pm)
    pidx = torch.empty((r, s), dtype=torch.int32, device=dev)
    br = _rows_per_program(r, block_v)
    stride_dj = draft_tokens.stride(1) if b > 1 else 0
    stride_param = 1 if temp_t.numel() > 1 else 0
    filt = use_top_k or use_top_p
    thr = _filter_threshold(logits, temp_t, topk_t, topp_t, use_top_k, use_top_p) if filt else pidx[:, 0]
    # A sparse draft distribution: the partial kernel excludes the row's candidates, the accept kernel scores them.
    sparse = draft_probs is not None and b > 1
    excluded = draft_indices if sparse else draft_tokens
    k = draft_indices.shape[2] if sparse else 1
    _sample_partial_kernel[(triton.cdiv(r, br), s)](
        z_ptr=logits, draft_ptr=excluded, seed_ptr=seed_t, offset_ptr=offset_t, thr_ptr=thr,
        pm_ptr=pm, ps_ptr=ps, pbest_ptr=pbest, pidx_ptr=pidx, temp_ptr=temp_t, R=r, B=b, V=v,
        stride_n=logits.stride(0), stride_b=logits.stride(1), stride_dn=excluded.stride(0),
        stride_dj=excluded.stride(1) if b > 1 else 0, stride_param=stride_param, CHUNK=chunk, S=s, FILTER=filt,
        BLOCK_ROWS=br, BLOCK_V=block_v, K=k, stride_dk=excluded.stride(2) if sparse else 0, SPARSE=sparse,
    )
    # a sparse row holds [BLOCK_REQ, K, K] id comparisons: 16 requests a program keep them in registers on sm_90
    block_req = min(next_pow2(n), 1024) if interpreting() else min(next_pow2(n), 16 if sparse else 64)
    sparse_args = dict(cand_ptr=draft_indices, q_ptr=draft_probs, K=k, stride_cn=draft_indices.stride(0),
                       stride_cj=draft_indices.stride(1), stride_qn=draft_probs.stride(0),
                       stride_qj=draft_probs.stride(1), SPARSE=True, BLOCK_K=next_pow2(k)) if sparse else {}
    _sample_accept_kernel[(triton.cdiv(n, block_req),)](
        z_ptr=logits, draft_ptr=draft_tokens, seed_ptr=seed_t, offset_ptr=offset_t, thr_ptr=thr,
        pm_ptr=pm, ps_ptr=ps, pbest_ptr=pbest, pidx_ptr=pidx, acc_ptr=accepted, tok_ptr=token, temp_ptr=temp_t,
        N=n, B=b, V=v, S=s, stride_n=logits.stride(0), stride_b=logits.stride(1),
        stride_dn=draft_tokens.stride(0), stride_dj=stride_dj, stride_param=stride_param, FILTER=filt,
        BLOCK_REQ=block_req, BLOCK_S=next_pow2(s), **sparse_args,
    )
    return accepted, token


def verify_sample(logits: torch.Tensor, draft_tokens: torch.Tensor, *, temperature, top_k=0, top_p=1.0, seed,
                  offset, draft_probs=None, draft_indices=None,
                  backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling of one drafted block per request: one-hot draft proposals, or proposals drawn from a
    sparse draft distribution over K candidates per row (DFlash2's selector; z-lab ``_rejection_sample`` with
    ``draft_indices``).

    p_j = softmax(filter(logits[:, j] / temperature)) with HF-style top-k then top-p filtering. Draft
    token d_j is accepted with probability p_j(d_j) (one-hot), or min(1, p_j(d_j) / q_j(d_j)) (sparse q_j),
    while all earlier ones were; at the first rejection the next token is sampled from p_j with d_j removed
    (one-hot), or from max(p_j - q_j, 0) (sparse; p_j where that is all zero), renormalised; if all B-1 drafts
    are accepted it is sampled from p_{B-1}. Triton: one online max/sum-exp pass per vocab split plus Gumbel-max
    sampling (no [N, B, V] probabilities), Philox keyed by (seed, offset, request, row, token): the same
    (seed, offset) gives the same tokens. top-k / top-p run in-kernel as an exact threshold search
    (``threshold_launches`` extra launches, only when filtering is on; see README for tie and rounding notes).

    Args:
        logits: ``[N, B, V]`` fp32/bf16/fp16, last dim contiguous (row i predicts block position i+1).
        draft_tokens: ``[N, B-1]`` int64/int32.
        temperature: float > 0, or an ``[N]`` fp32/fp64 device tensor (per request; values > 0 are the
            caller's responsibility, they are not read on the host).
        top_k: int >= 0 (0 disables) or an ``[N]`` int tensor. top_p: float in (0, 1] (1 disables) or an
            ``[N]`` float tensor. Per-request tensors turn the filter launches on for the whole batch.
        seed, offset: int or 1-element int32/int64 tensor on the logits' device (tensors keep CUDA-graph
            replay reproducible: bump ``offset`` in place between rounds).
        draft_probs, draft_indices: both ``None`` (one-hot proposals), or the draft's distribution of each row:
            ``[N, B-1, K]`` fp32/fp64 probabilities on the token ids ``[N, B-1, K]`` int32/int64 in ``[0, V)``,
            last dim contiguous, ``1 <= K <= 64`` (``d_j`` should be one of row j's ids: else q_j(d_j) = 0 and it
            is accepted). The Triton kernels exclude the K ids from the vocabulary pass and score them per request.
        backend: ``"auto" | "triton" | "torch"`` (the torch reference uses torch.Generator, a different
            random stream, and reads seed/offset/parameters on the host; under a CUDA graph capture "torch"
            runs the Triton kernels, which read them on the device).

    Returns:
        ``(accepted, next_token)``, int64 ``[N]`` each.
    """
    op = "verify_sample"
    _validate(op, logits, draft_tokens)  # before sampling_op_args reads logits
    args = sampling_op_args(op, logits, temperature, top_k, top_p, seed, offset)
    chosen = resolve_backend(op, backend, logits.device, available=_SAMPLE_BACKENDS)
    # One-hot proposals are validated above (sampling_op_args packs what it validated). A draft distribution is
    # checked by the op itself: its ids are read on the host (CPU tensors), which a captured step may do only
    # inside an op.
    one_hot = draft_probs is None and draft_indices is None
    return call_op(_verify_sample_op, logits, draft_tokens, *args, draft_probs, draft_indices, chosen,
                   device=logits.device, checked=one_hot)


MAX_DRAFT_CANDIDATES = 64  # the accept kernel holds a row's candidates in registers


def _validate_draft_distribution(op: str, logits, draft_probs, draft_indices) -> None:
    """``draft_probs`` / ``draft_indices``: both None, or [N, B-1, K] float / int tensors of one shape, K in
    [1, 64], last dim contiguous, ids in [0, V)."""
    if draft_probs is None and draft_indices is None:
        return
    if draft_probs is None or draft_indices is None:
        raise ValueError(f"{op}: pass draft_probs and draft_indices together (a sparse draft distribution), or "
                         "neither (one-hot proposals)")
    n, b, v = logits.shape
    check_tensor(op, "draft_probs", draft_probs, ndim=3, dtypes=(torch.float32, torch.float64), device=logits.device)
    check_tensor(op, "draft_indices", draft_indices, ndim=3, dtypes=(torch.int64, torch.int32), device=logits.device)
    k = draft_probs.shape[2]
    if tuple(draft_probs.shape) != (n, b - 1, k) or draft_indices.shape != draft_probs.shape \
            or not 1 <= k <= MAX_DRAFT_CANDIDATES:
        raise ValueError(f"{op}: draft_probs and draft_indices must both be [N, B-1, K] = [{n}, {b - 1}, K] with "
                         f"1 <= K <= {MAX_DRAFT_CANDIDATES}, got {tuple(draft_probs.shape)} and "
                         f"{tuple(draft_indices.shape)}")
    check_last_dim_contiguous(op, "draft_probs", draft_probs)
    check_last_dim_contiguous(op, "draft_indices", draft_indices)
    check_index_values(op, "draft_indices", draft_indices, 0, v, "token ids of the logits' vocabulary")


def _check_sample(logits, draft_tokens, temperature, top_k, top_p, seed, offset, use_top_k, use_top_p, draft_probs,
                  draft_indices, backend):
    _validate("verify_sample", logits, draft_tokens)
    _validate_draft_distribution("verify_sample", logits, draft_probs, draft_indices)
    check_packed_sampling("verify_sample", logits.shape[0], temperature, top_k, top_p, seed, offset, logits.device)


def cuda_capturing(device: torch.device) -> bool:
    """Whether work on ``device`` is being recorded into a CUDA graph now."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


@torch.library.custom_op("dflash::verify_sample", mutates_args=())
@checked_by(_check_sample)
def _verify_sample_op(logits: torch.Tensor, draft_tokens: torch.Tensor, temperature: torch.Tensor,
                      top_k: torch.Tensor, top_p: torch.Tensor, seed: torch.Tensor, offset: torch.Tensor,
                      use_top_k: bool, use_top_p: bool, draft_probs: Optional[torch.Tensor],
                      draft_indices: Optional[torch.Tensor], backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.ops.dflash.verify_sample``: :func:`verify_sample` after validation.

    temperature / top_k / top_p: ``[1]`` (whole batch) or ``[N]`` (per request), any float / int dtype;
    seed / offset: 1-element int tensors. All are read on the device at run time. ``use_top_k`` /
    ``use_top_p`` switch the filter launches on (the reference filters from the values themselves).

    Under a CUDA graph capture the "torch" backend runs the Triton kernels: the reference's random stream is a
    ``torch.Generator`` seeded from host ints (seed, offset; and one-value parameters become host scalars), a
    host read a capture cannot hold, while the kernels read all of them on the device (Philox counters).
    """
    chosen = resolve_backend("verify_sample", backend, logits.device, available=_SAMPLE_BACKENDS)
    if chosen == "torch" and not cuda_capturing(logits.device):
        if temperature.numel() == 1:
            temperature, top_k, top_p = temperature.item(), int(top_k.item()), top_p.item()
        return verify_sample_reference(logits, draft_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                       seed=seed, offset=offset, draft_probs=draft_probs, draft_indices=draft_indices)
    return _verify_sample_triton(logits, draft_tokens, temperature.to(torch.float32), top_k.to(torch.int32),
                                 top_p.to(torch.float32), seed.reshape(1).to(torch.int64),
                                 offset.reshape(1).to(torch.int64), use_top_k, use_top_p, draft_probs, draft_indices)


@_verify_sample_op.register_fake
def _verify_sample_fake(logits, draft_tokens, temperature, top_k, top_p, seed, offset, use_top_k, use_top_p,
                        draft_probs, draft_indices, backend):
    n = logits.shape[0]
    return logits.new_empty((n,), dtype=torch.int64), logits.new_empty((n,), dtype=torch.int64)
