"""Native fp32 CPU kernels behind the ``"cpu"`` backend of ``verify_attention``, ``draft_attention``,
``inject_context_kv``, ``add_rms_norm``, ``silu_mul`` and the draft-tree ops: the checked Python entry points of
``torch.ops.dflash_cpu`` (C++ in ``csrc/cpu/``, built into ``dflash_kernels._C``).

Why: on a CPU the small ops of a decoder layer cost more in dispatch than in arithmetic. Measured on SmolLM2-135M
(2 threads, one lean target forward): the torch formulas of attention (q/k norm, RoPE, cache write, SDPA, per
request Python) took 11-16 ms and the 61 residual-add + RMSNorm calls 6.5-7 ms of a 55-65 ms forward at 1-8
rows, about as much as the projections' distance from their memory floor. Here each is one C call.

What they compute (the ops' definitions, in fp32; only the order of fp32 sums differs, so the ops' tests hold
them to the 2x error rule against fp64, not to the references' bits):

* :func:`add_rms_norm`: ``residual += x`` (in place), then ``weight * (s * rsqrt(mean(s^2) + eps))``.
* :func:`silu_mul`: ``silu(gate) * up`` of ``[gate | up]`` rows.
* :func:`block_attention`: per request n (cache row ``rows[n]``, ``C = lens[n]``, ``v = block_lens[n]`` or B)
  and block row i: q and k get their per-head RMSNorm (when the weights are given) and RoPE from the given
  tables (``cos``, and ``sin`` with its first half negated, so ``rotate_half(x) * sin == roll(x, D/2) *
  sin_signed``); the verify step writes the block's K and raw V rows to cache rows ``C + i`` (the draft step
  keeps them aside); query i attends to the context rows ``[0, C)`` and the block rows j < v that are j <= i
  (causal), set in its ancestor mask (a tree), or all (the draft's non-causal block), with scale ``scale``.
* :func:`build_tree`, :func:`tree_ancestor_mask`: the draft tree of each request and its ancestor bitmask, equal
  to ``dflash_kernels.tree``'s references bit for bit (integers; the log-probs from the same torch normalizer).
  Measured at 7 positions, 2,585 draft ids, trees of 27, 2 threads: 199 and 20 us a call through the ops, against
  684 and 223 us for the references (Python heap; torch ops); at the demo draft's 4,096 ids: 192 and 18 us.

How (attention): the block's K/V rows are written first; then, with 8 or more query rows per KV head (a verify
block), each request's keys of each KV head are transposed into tiles of 16 keys (16 x 16 blocks in registers: a
target forward 0.3-0.6 / 1-2.7 / 2.8-4.5 ms faster at 250 / 600 / 1,500 context rows than one scalar move a float,
8-16 rows, SmolLM2), so a tile of scores is 16-lane
FMAs over d with no per-key horizontal sum, four query rows and two key tiles a pass (eight independent FMA
chains: four left each FMA waiting on the previous one's latency; 0.88-0.95x the time at 16-24 rows, measured
below); with fewer (a one-token step) a score
is a dot product and a halving sum. Softmax in 16 lanes with a polynomial exp; the weighted sum of the V rows
takes the same four query rows together (each V row loaded once for the four, 16 accumulators), 64 output
columns a pass. Measured at SmolLM2's shapes (9 heads, 3 KV heads, D 64, 200 context rows, 2 threads, one run,
medians): 34, 72, 116, 158 and 208 us a call at 1, 8, 16, 24 and 32 rows, against 35, 82, 136, 189 and 253 us
with one query row per V pass (0.77x at 24 rows and 400 context rows); the torch formulas took 370-530 us a
layer inside a forward. Two key tiles a score pass instead of one (in-process A/B, bit-identical outputs): 68 ->
65, 108 -> 103 and 153 -> 134 us at 8, 16 and 24 rows (200 context rows), 129 -> 121 and 295 -> 267 us at 8 and
24 rows (400).

Threads: OpenMP (torch's libgomp) with ``torch.get_num_threads()`` threads over (request, KV head, key tile) and
then (request, head, 4 query rows); the norm and silu_mul split their rows once there are enough of them.

Build: ahead of time, by setup.py, into ``dflash_kernels._C`` (``csrc/cpu/``; ``csrc/README.md``): the vector kernels
once per instruction set (AVX-512, AVX2 + FMA), the widest the CPU has chosen when the library loads
(``DFLASH_CPU_ISA=avx2`` runs the AVX2 build on an AVX-512 CPU: tests, benchmarks). Without the
extension (``DFLASH_BUILD_EXT=0``, a failed build) or on a CPU with neither, :func:`enabled` is False
(:func:`unavailable_reason` says why, one warning too) and the ops keep their torch formulas (bit-equal to the
references). ``DFLASH_CPU_NATIVE=0`` turns these kernels off (A/B runs, tests of the torch formulas).
"""
from __future__ import annotations

import os
import threading
import warnings

import torch

ENV = "DFLASH_CPU_NATIVE"
MAX_HEAD_DIM = 512  # the kernels' per-head stack buffers (and D % 16 == 0: whole vectors)
VECTOR_ISAS = ("avx512", "avx2")  # the instruction sets the vector kernels are built for, widest first


def cache_root() -> str:
    """The project's cache folder: ``$DFLASH_CACHE``, default ``~/.cache/dflash``."""
    return os.environ.get("DFLASH_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "dflash")


_lock = threading.Lock()
_ops = None  # torch.ops.dflash_cpu once loaded and usable on this CPU
_isas: tuple[str, ...] = ()
_reason: str | None = None
_tried = False


def _load():
    global _ops, _isas, _reason, _tried
    if _tried:
        return _ops
    with _lock:
        if not _tried:
            from dflash_kernels import _ext

            loaded, how = _ext.load()
            if not loaded:
                _reason = how
            elif not hasattr(torch.ops.dflash_cpu, "isas"):
                _reason = f"the compiled extension has no dflash_cpu ops (built on x86-64 only; {how})"
            else:
                try:
                    _isas = tuple(torch.ops.dflash_cpu.isas())
                except RuntimeError as e:  # a DFLASH_CPU_ISA this CPU lacks, or no such ISA
                    _reason = str(e).splitlines()[0]
                else:
                    if not set(VECTOR_ISAS) & set(_isas):
                        _reason = "this CPU has neither AVX-512 (F, BW, DQ, VL) nor AVX2 + FMA"
                    else:
                        _ops = torch.ops.dflash_cpu
            if _reason:
                _reason = f"dflash_kernels.cpu.native: unavailable ({_reason}); the \"cpu\" backend uses torch formulas"
                warnings.warn(_reason, RuntimeWarning, stacklevel=3)
            _tried = True
    return _ops


def isas() -> tuple[str, ...]:
    """The instruction sets of this CPU that the built kernels cover, widest first (of ``"amx"``, ``"avx512"``,
    ``"avx2"``; ``$DFLASH_CPU_ISA`` drops the wider ones); empty without the kernels."""
    _load()
    return _isas


def enabled() -> bool:
    """Whether the native kernels run (built and loaded, and not turned off by ``DFLASH_CPU_NATIVE=0``)."""
    return os.environ.get(ENV, "1") != "0" and (_ops is not None or _load() is not None)


def library():
    """``torch.ops.dflash_cpu`` when the kernels run (:func:`enabled`), else None: for a caller that has checked its
    arguments once and calls the ops directly (``dflash_kernels.cpu.forward``); their contracts are the comments of
    ``csrc/cpu/dflash_cpu.h`` and ``csrc/cpu/bindings.cpp``."""
    return _ops if enabled() else None


def unavailable_reason() -> str | None:
    """None when the kernels are built and loaded (building them now if needed), else why not."""
    _load()
    return _reason


def _raise_on_failure(status: int, kernel: str, size: str) -> None:
    """A kernel's non-zero status (its scratch memory could not be allocated) as a MemoryError naming the size."""
    if status:
        raise MemoryError(f"cpu_native.{kernel}: not enough memory for the kernel's scratch ({size}); use fewer or "
                          "shorter requests")


def add_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
                 out: torch.Tensor) -> bool:
    """``add_rms_norm``'s "cpu" body for fp32 tensors (x rows viewable as ``[rows, H]`` with a row stride,
    weight, residual and out contiguous); False (nothing done) where it does not apply."""
    f32 = torch.float32
    h = x.shape[-1]
    # Shapes too, even after the op's validation (validate=False skips it): a wrong one must not become a read or
    # write past a buffer; the torch formula then raises.
    if not (x.dtype == weight.dtype == out.dtype == f32 and weight.is_contiguous() and out.is_contiguous()
            and x.stride(-1) == 1 and h > 0 and weight.numel() == h and out.shape == x.shape
            and (residual is None or (residual.is_contiguous() and residual.shape == x.shape)) and enabled()):
        return False
    x2 = x.reshape(-1, h)  # a view where the layout allows (validated: last dim contiguous)
    if x2.stride(1) != 1:
        return False
    _ops.add_rms_norm(x2, residual, weight, out, eps)
    return True


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor) -> bool:
    """``silu_mul``'s "cpu" body for fp32 rows viewable as ``[rows, 2I]`` with a row stride into a contiguous
    ``out``; False (nothing done) where it does not apply."""
    i2 = gate_up.shape[-1]
    if not (gate_up.dtype == out.dtype == torch.float32 and gate_up.stride(-1) == 1 and i2 > 0 and i2 % 2 == 0
            and out.is_contiguous() and out.shape == (*gate_up.shape[:-1], i2 // 2) and enabled()):
        return False
    x2 = gate_up.reshape(-1, i2)
    if x2.stride(1) != 1:
        return False
    _ops.silu_mul(x2, out.view(-1, i2 // 2))
    return True


def _host_index_tensor(values) -> torch.Tensor | None:
    """A new contiguous int64 tensor of host ``values`` (None: None): what a kernel reads, built from the very
    values its caller checked, so no other thread's write to the caller's tensor between the check and the call
    reaches the C code, and an int32 input is read at its values, not as half of an int64."""
    return None if values is None else torch.tensor(values, dtype=torch.int64)


def block_attention(q, k, v, k_cache, v_cache, lens: list[int], rows: list[int] | None, q_norm_weight,
                    k_norm_weight, eps, scale, cos, sin_signed, *, causal: bool, write_kv: bool,
                    block_lens: list[int] | None = None, tree_mask=None) -> torch.Tensor | None:
    """The "cpu" body of ``verify_attention`` (``write_kv``, causal or a tree) and ``draft_attention`` (no write,
    ``block_lens``) for fp32 tensors on a contiguous cache (with room for the block where it is written).
    ``lens``, ``rows`` (None: 0..N-1) and ``block_lens`` (None: all B rows) are host values: the kernel reads
    int64 copies of exactly these. None (nothing done) where it does not apply, including cache rows outside the
    cache (the torch formulas then raise the IndexError). Raises MemoryError when the kernel's scratch cannot be
    allocated."""
    f32 = torch.float32
    n, b, nh, d = q.shape
    kvh = k.shape[2]
    cap = k_cache.shape[1]
    norms = [t for t in (q_norm_weight, k_norm_weight) if t is not None]
    # Whether the kernel applies to every extent and index: where not, the torch formula runs instead and raises
    # the op's own error (the native op refuses the same inputs too, with a less specific one).
    shapes_ok = (k.shape == v.shape == (n, b, kvh, d) and nh % kvh == 0 and k_cache.dim() == 4
                 and k_cache.shape[2:] == (kvh, d) and v_cache.shape == k_cache.shape
                 and len(lens) == n and all(t.numel() == d for t in norms)
                 and cos.shape == sin_signed.shape == (n * b, d)
                 and (rows is None or len(rows) == n) and (block_lens is None or len(block_lens) == n)
                 and (tree_mask is None or (tree_mask.shape[:2] == (n, b) and tree_mask.shape[2] * 64 >= b
                                           and tree_mask.dtype == torch.int64)))
    if not (shapes_ok and q.dtype == k.dtype == v.dtype == k_cache.dtype == v_cache.dtype == f32 and d <= MAX_HEAD_DIM
            and all(t.dtype == f32 and t.is_contiguous() for t in norms) and k_cache.is_contiguous()
            and v_cache.is_contiguous() and all(t.stride(3) == 1 and t.stride(2) == d for t in (q, k, v))
            and d % 16 == 0 and n > 0 and max(lens) + (b if write_kv else 0) <= cap and min(lens) >= 0
            and (rows is None or all(0 <= r < k_cache.shape[0] for r in rows))
            and (rows is not None or n <= k_cache.shape[0])
            and (block_lens is None or all(0 <= x <= b for x in block_lens)) and enabled()):
        return None
    if tree_mask is not None:
        tree_mask = tree_mask.contiguous()
    cos, sin_signed = cos.contiguous(), sin_signed.contiguous()
    lens_t, rows_t, block_lens_t = (_host_index_tensor(x) for x in (lens, rows, block_lens))
    out = q.new_empty((n, b, nh, d))
    status = _ops.block_attention(q, k, v, k_cache, v_cache, lens_t, rows_t, block_lens_t, q_norm_weight,
                                  k_norm_weight, eps, cos, sin_signed, tree_mask, causal, write_kv, scale, out)
    _raise_on_failure(status, "block_attention", f"{n} requests x {b} block rows over {max(lens)} context rows")
    return out


def inject_context_kv(k: torch.Tensor, v: torch.Tensor, k_norm_weight: torch.Tensor, eps: float, cu: list[int],
                      lens: list[int], rows: list[int] | None, cos: torch.Tensor, sin_signed: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """``inject_context_kv``'s "cpu" body for fp32 tensors on a contiguous cache (host values: ``cu`` the row
    offsets, ``lens`` the cache lengths, ``rows`` ``cache_batch_idx`` or None; ``cos`` / ``sin_signed``
    [cu[-1], D]: each row's tables); False (nothing done) where it does not apply, including offsets that are not
    a partition of k's first rows and cache rows outside the cache (the reference then decides)."""
    f32 = torch.float32
    m, kvh, d = k.shape
    n = len(cu) - 1
    # Every extent and index the kernel uses, checked here: a mismatch falls back to the reference.
    if not (enabled() and k.dtype == v.dtype == k_norm_weight.dtype == k_cache.dtype == v_cache.dtype == f32
            and v.shape == k.shape and k.stride(2) == v.stride(2) == 1 and k.stride(1) == v.stride(1) == d
            and k_cache.dim() == 4 and k_cache.shape[2:] == (kvh, d) and v_cache.shape == k_cache.shape
            and k_cache.is_contiguous() and v_cache.is_contiguous() and k_norm_weight.is_contiguous()
            and k_norm_weight.numel() == d and 0 < d <= MAX_HEAD_DIM and n > 0 and cu[0] == 0 and cu[-1] <= m
            and all(a <= b for a, b in zip(cu, cu[1:])) and len(lens) == n and min(lens) >= 0
            and cos.shape == sin_signed.shape == (cu[-1], d)
            and (len(rows) == n and all(0 <= r < k_cache.shape[0] for r in rows) if rows is not None
                 else n <= k_cache.shape[0])):
        return False
    offsets, lens_t, rows_t = (_host_index_tensor(x) for x in (cu, lens, rows))
    cos, sin_signed = cos.contiguous(), sin_signed.contiguous()
    _ops.inject_context_kv(k, v, k_norm_weight, eps, offsets, lens_t, rows_t, cos, sin_signed, k_cache, v_cache)
    return True


def build_tree(draft_logits: torch.Tensor, lse: torch.Tensor, anchor: torch.Tensor, budget: int,
               vocab_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``build_tree``'s "cpu" body (validated CPU inputs; ``lse``: ``draft_log_normalizer``'s [R, P] fp32): the
    reference's trees bit for bit, or None (nothing done) where it does not apply: no native library, non-fp32
    logits, or a NaN / +inf logit (the reference then decides by torch.topk's NaN rule)."""
    r, p, v = draft_logits.shape
    i64 = torch.int64
    # Whether the kernel applies to these extents (also on the op's unchecked path); where not, the reference runs.
    if not (enabled() and draft_logits.dtype == torch.float32 and draft_logits.stride(2) == 1 and budget >= 1
            and v >= 1 and p >= 1 and anchor.dtype == i64 and anchor.shape == (r,) and lse.shape == (r, p)
            and (vocab_ids is None or (vocab_ids.dtype == i64 and vocab_ids.shape == (v,)))):
        return None
    t = budget + 1
    out = tuple(torch.empty((r, t), dtype=torch.int64) for _ in range(3))
    lse = lse.contiguous()
    anchor = anchor.contiguous()
    ids = None if vocab_ids is None else vocab_ids.contiguous()
    status = _ops.build_tree(draft_logits, lse, min(budget, v), anchor, ids, *out)
    if status == 2:
        _raise_on_failure(status, "build_tree", f"{r} trees of {t} nodes over {p} depths")
    return None if status else out


def tree_ancestor_mask(tree_parents: torch.Tensor, words: int) -> torch.Tensor | None:
    """``tree_ancestor_mask``'s "cpu" body for validated CPU parents; None without the native library. A node
    whose parent is not an earlier node (or a root whose parent is not -1) raises ValueError naming it."""
    if not (enabled() and tree_parents.dtype == torch.int64):
        return None
    r, t = tree_parents.shape
    par = tree_parents if tree_parents.stride(1) == 1 else tree_parents.contiguous()
    mask = torch.empty((r, t, words), dtype=torch.int64)
    bad = _ops.tree_ancestor_mask(par, mask)
    if bad >= 0:
        raise ValueError(bad_parent_message("tree_ancestor_mask", par, *divmod(bad, t)))
    return mask


def bad_parent_message(op: str, tree_parents: torch.Tensor, req: int, node: int) -> str:
    """The error of a tree whose node ``node`` of request ``req`` has no valid parent."""
    return (f"{op}: tree_parents[{req}, {node}] = {int(tree_parents[req, node])} is not a valid parent: node 0 (the "
            "root) needs -1, node i > 0 an earlier node (0 <= parent < i), as build_tree returns them")


def tree_walk_tokens(target_tokens: torch.Tensor, tree_tokens: torch.Tensor, tree_parents: torch.Tensor,
                     block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``tree_accept_greedy_tokens``' "cpu" body (validated CPU inputs: [R, T] rows, the last dim contiguous): the
    reference's walk, ``(path, accepted, bonus)``; None without the native library."""
    i64 = torch.int64
    if not (enabled() and block_size >= 1 and tree_tokens.dtype == tree_parents.dtype == i64
            and target_tokens.shape == tree_tokens.shape == tree_parents.shape
            and tree_tokens.stride(1) == tree_parents.stride(1) == 1):
        return None
    r, t = tree_tokens.shape
    target = target_tokens.to(torch.int64)
    if target.stride(-1) != 1:
        target = target.contiguous()
    path = torch.empty((r, block_size), dtype=torch.int64)
    accepted, bonus = torch.empty(r, dtype=torch.int64), torch.empty(r, dtype=torch.int64)
    _ops.tree_walk_tokens(target, tree_tokens, tree_parents, path, accepted, bonus)
    return path, accepted, bonus


def tree_graft_lookup(tree_tokens: torch.Tensor, tree_parents: torch.Tensor, tree_depths: torch.Tensor,
                      tokens: torch.Tensor, lengths: torch.Tensor, limit: int, max_ngram: int,
                      min_ngram: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``tree_graft_lookup``'s "cpu" body for validated CPU inputs (``limit`` = min(depth, T - 1)): the new
    ``(tokens, parents, depths)``; None without the native library."""
    if not enabled():
        return None
    r, t = tree_tokens.shape
    out = tuple(torch.empty((r, t), dtype=torch.int64) for _ in range(3))
    _ops.tree_graft_lookup(tree_tokens, tree_parents, tree_depths, tokens, lengths.contiguous(), limit, max_ngram,
                           min_ngram, *out)
    return out


def compact_index_error(paths: list[list[int]], accepted: list[int], start: list[int], rows: list[int],
                        batch_rows: int) -> str | None:
    """Why ``tree_compact``'s host values would address rows outside the caches, or None: ``accepted[r]`` must be
    a depth of the path, the moved sources ``path[r, :accepted[r] + 1]`` and ``start[r]`` non-negative (a
    negative host index would take a row from the end), batch rows inside the cache. Sources at or past the
    capacity are allowed: the moves skip them."""
    for r, (a, s, b, p) in enumerate(zip(accepted, start, rows, paths)):
        if not 0 <= a < len(p):
            return f"accepted[{r}] = {a} is not a depth of path (0 <= accepted < B = {len(p)})"
        if min(p[:a + 1]) < 0:
            return f"path[{r}, :{a + 1}] = {p[:a + 1]} holds a negative node (the walk's path, -1 only past accepted)"
        if s < 0:
            return f"start[{r}] = {s} must be >= 0 (the cache length before the verify step)"
        if not 0 <= b < batch_rows:
            return f"cache_batch_idx[{r}] = {b} is outside the cache's {batch_rows} batch rows"
    return None


def tree_compact(k_cache: torch.Tensor, v_cache: torch.Tensor, path: torch.Tensor, accepted: torch.Tensor,
                 start: torch.Tensor, cache_batch_idx: torch.Tensor | None) -> bool:
    """``tree_compact``'s "cpu" body: the moves by ``memcpy``; False (nothing done) where it does not apply: no
    native library, non-contiguous caches, indices outside the caches (:func:`compact_index_error`), or a path
    that is not a walk's (node 0, then d <= path[d] < path[d + 1]: only then does no move in depth order overwrite
    a later one's source); the reference then decides. The kernel reads int64 copies of the values checked here."""
    if not (enabled() and k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
            and k_cache.dim() == 5):
        return False
    nb = k_cache.shape[1]
    paths, acc, st = path.tolist(), accepted.tolist(), start.tolist()
    if not acc:
        return True
    rows = cache_batch_idx.tolist() if cache_batch_idx is not None else list(range(len(acc)))
    if not (len(paths) == len(acc) == len(st) == len(rows)) or compact_index_error(paths, acc, st, rows, nb):
        return False
    for a, p in zip(acc, paths):
        walk = p[:a + 1]
        if walk[0] != 0 or any(not (d <= x < y) for d, (x, y) in enumerate(zip(walk, walk[1:]))):
            return False
    path_t, acc_t, st_t, rows_t = (_host_index_tensor(x) for x in (paths, acc, st, rows))
    _ops.tree_compact(k_cache, v_cache, path_t, acc_t, st_t, rows_t)
    return True
