"""verify_attention: the target's block over [cached context ++ its own keys, causal], and the block's K/V written
into the cache. Outputs and written K rows against fp64 (2x rule), V rows bit for bit, every other cache row
unchanged bit for bit, splits sized from the live length."""
import pytest
import torch

from dflash_kernels import verify_attention

from dflash_kernels.cpu import native as cpu_native
from dflash_kernels._triton_utils import rope_cos_sin_reference
from helpers.caches import random_block_table, to_paged
from helpers.splits import assert_slots, da, nan_partials
from helpers.device import DEVICE
from helpers.tol import assert_within_rule

BACKENDS = ["torch", "triton", pytest.param("cpu", marks=pytest.mark.skipif(DEVICE != "cpu", reason="CPU tensors only"))]


def _inv_freq(d, theta=10000.0):
    return 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))


def _case(n, b, nh, kvh, d, lens, cap, dtype, norm):
    """Inputs with contiguous [n, cap] caches whose rows the call must write are NaN."""
    q, k, v = (torch.randn(n, b, h, d).to(dtype) for h in (nh, kvh, kvh))
    kc, vc = (torch.randn(n, cap, kvh, d).to(dtype) for _ in range(2))
    for r, c in enumerate(lens):
        kc[r, c:c + b] = float("nan")
        vc[r, c:c + b] = float("nan")
    qw, kw = ((1 + 0.3 * torch.randn(d)).to(dtype) for _ in range(2)) if norm else (None, None)
    return q, k, v, kc, vc, torch.tensor(lens, dtype=torch.int64), qw, kw


def _bits(t):
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _reference(args, **kw):
    """(fp64 out, fp64 caches) and (low-precision out, caches) of the definition on contiguous copies."""
    q, k, v, kc, vc, cl, qw, kw_ = args
    res = []
    for conv in (torch.Tensor.double, lambda t: t.clone()):
        kc_r, vc_r = conv(kc), conv(vc)
        out = da.verify_attention_reference(conv(q), conv(k), conv(v), kc_r, vc_r, cl,
                                            None if qw is None else conv(qw), None if kw_ is None else conv(kw_), **kw)
        res.append((out, kc_r, vc_r))
    return res


def _layout(kind, kc, vc):
    """The caches as the call sees them (contiguous, rows picked by cache_batch_idx, or paged), the physical
    buffers, and index(r, t) -> the physical row of request r's logical row t."""
    n, cap = kc.shape[:2]
    if kind == "contiguous":
        # A [:, :cap] view of wider buffers: a row written past the capacity would land in the extra columns.
        big_k, big_v = (torch.randn(n, cap + 3, *kc.shape[2:]).to(kc.dtype) for _ in range(2))
        big_k[:, :cap], big_v[:, :cap] = kc, vc
        return big_k[:, :cap], big_v[:, :cap], {}, (big_k, big_v), lambda r, t: (r, t)
    if kind == "batch_idx":
        idx = torch.randperm(n + 2)[:n]
        big_k, big_v = (torch.randn(n + 2, cap, *kc.shape[2:]).to(kc.dtype) for _ in range(2))
        big_k[idx], big_v[idx] = kc, vc
        return big_k, big_v, dict(cache_batch_idx=idx), (big_k, big_v), lambda r, t: (int(idx[r]), t)
    page_size = 16
    assert cap % page_size == 0, "the paged capacity (whole pages) must equal the contiguous one"
    table, num_pages = random_block_table(n, cap, page_size)
    kp, vp = to_paged(kc, table, num_pages, page_size), to_paged(vc, table, num_pages, page_size)
    return kp, vp, dict(block_table=table), (kp, vp), lambda r, t: (int(table[r, t // page_size]), t % page_size)


CASES = [  # n, b, nh, kvh, d, context lengths, capacity, cache layout
    (3, 16, 4, 4, 16, [0, 1, 37], 60, "contiguous"),          # G = 1
    (2, 3, 9, 3, 80, [70, 5], 80, "batch_idx"),                 # G = 3, odd head count, D = 80
    (4, 1, 8, 2, 64, [5, 0, 130, 77], 144, "paged"),           # G = 4, B = 1
    (3, 16, 6, 2, 16, [50, 64, 10], 64, "contiguous"),         # near capacity: 14, 0 and 16 rows fit
    (2, 16, 6, 2, 16, [60, 41], 64, "paged"),                  # near capacity, paged (capacity = 4 pages)
    (3, 4, 4, 2, 16, [70, 64, 62], 64, "batch_idx"),           # lengths past the capacity: context read up to it
    (2, 16, 6, 2, 16, [100, 63], 64, "paged"),                 # past the capacity, paged: 0 and 1 rows fit
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [True, False], ids=["qk_norm", "no_norm"])
@pytest.mark.parametrize("case", CASES, ids=[f"{c[-1]}-{i}" for i, c in enumerate(CASES)])
def test_matches_reference_and_writes_exactly_the_block_rows(monkeypatch, backend, dtype, norm, case):
    """Contexts below MIN_CHUNK in a grid of 3 splits: one active split per request stores the output itself
    (no partial written: NaN-filled)."""
    n, b, nh, kvh, d, lens, cap, kind = case
    args = _case(n, b, nh, kvh, d, lens, cap, dtype, norm)
    q, k, v, kc, vc, cl, qw, kw = args
    rope = dict(inv_freq=_inv_freq(d), attention_scaling=1.1, scale=0.7 * d ** -0.5)
    (ref, ref_k, _), (lowp, lowp_k, _) = _reference(args, **rope)
    kc_in, vc_in, where, buffers, index = _layout(kind, kc, vc)
    before = [x.clone() for x in buffers]
    seen = nan_partials(monkeypatch)
    out = verify_attention(q, k, v, kc_in, vc_in, cl, qw, kw, num_splits=3, backend=backend, **where, **rope)
    assert out.dtype == dtype and out.shape == (n, b, nh, d)
    if backend == "triton":
        assert_slots(seen[0], lens, 3, kv_heads=kvh)
    assert_within_rule(out, ref, lowp, "verify_attention output")

    written = torch.zeros(buffers[0].shape[:2], dtype=torch.bool)
    for r, c in enumerate(lens):
        rows = [index(r, t) for t in range(c, min(c + b, cap))]   # rows past the capacity are dropped
        if not rows:
            continue
        for p in rows:
            written[p] = True
        got_k = torch.stack([buffers[0][p] for p in rows])
        got_v = torch.stack([buffers[1][p] for p in rows])
        assert torch.equal(_bits(got_v), _bits(v[r, :len(rows)])), f"request {r}: V rows are not v bit for bit"
        assert_within_rule(got_k, ref_k[r, c:c + len(rows)], lowp_k[r, c:c + len(rows)],
                           f"verify_attention written K rows of request {r}")
    for name, new, old in zip(("k_cache", "v_cache"), buffers, before):
        assert not torch.isnan(new[written]).any(), f"{name}: a row that must be written still holds NaN"
        assert torch.equal(_bits(new[~written]), _bits(old[~written])), f"{name}: a row outside the block changed"


def test_reference_definition_matches_explicit_math():
    """The definition against a hand-written fp64 formula: the rows written, then causal attention over
    context ++ block with the given scale, with and without q/k norm."""
    n, b, nh, kvh, d, c, cap = 1, 5, 4, 2, 8, 6, 9     # 3 of the 5 block rows fit
    for norm in (True, False):
        q, k, v, kc, vc, cl, qw, kw = _case(n, b, nh, kvh, d, [c], cap, torch.float64, norm)
        inv = _inv_freq(d)
        pos = torch.arange(c, c + b)
        cos, sin = rope_cos_sin_reference(pos, inv, 1.0, torch.float64)

        def norm_rope(x, wt):
            if wt is not None:
                x = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * wt
            rot = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
            return x * cos[:, None] + rot * sin[:, None]

        qn, kn = norm_rope(q[0], qw), norm_rope(k[0], kw)
        ctx_k, ctx_v = kc[0, :c].clone(), vc[0, :c].clone()
        got = da.verify_attention_reference(q, k, v, kc, vc, cl, qw, kw, inv_freq=inv, scale=0.3)
        torch.testing.assert_close(kc[0, c:], kn[:cap - c], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(vc[0, c:], v[0, :cap - c], rtol=0, atol=0)
        keys = torch.cat([ctx_k, kn]).repeat_interleave(nh // kvh, dim=1)
        vals = torch.cat([ctx_v, v[0]]).repeat_interleave(nh // kvh, dim=1)
        s = torch.einsum("ihd,thd->hit", qn, keys) * 0.3
        s = s.masked_fill(torch.arange(c + b)[None, :] > pos[:, None], float("-inf"))
        expect = torch.einsum("hit,thd->ihd", s.softmax(-1), vals)
        torch.testing.assert_close(got[0], expect, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_count_follows_the_live_length(monkeypatch, dtype):
    """MIN_CHUNK lowered to 64 rows: requests of 300, 0, 130 and 64 live rows use 4 (capped), 1, 3 and 1 of the
    grid's 4 splits and write exactly their active slots (none with one active split); the others are not
    read by the merge (NaN-filled), and the result is the same as with a grid of one split (no slot written)."""
    monkeypatch.setattr(da, "MIN_CHUNK", 64)
    lens, max_splits = [300, 0, 130, 64], 4
    active = [da.active_splits(x, max_splits) for x in lens]
    assert active == [4, 1, 3, 1]
    n, b, nh, kvh, d = 4, 3, 6, 2, 16
    args = _case(n, b, nh, kvh, d, lens, 320, dtype, True)
    (ref, _, _), (lowp, _, _) = _reference(args, inv_freq=_inv_freq(d))
    q, k, v, kc, vc, cl, qw, kw = args
    seen = nan_partials(monkeypatch)
    outs = []
    for splits in (max_splits, 1):
        kc_run, vc_run = kc.clone(), vc.clone()
        outs.append(verify_attention(q, k, v, kc_run, vc_run, cl, qw, kw, inv_freq=_inv_freq(d), num_splits=splits,
                                     backend="triton"))
        assert_slots(seen[-1], lens, splits, kv_heads=kvh)  # num_splits is the grid's maximum
    for out in outs:
        assert_within_rule(out, ref, lowp, "verify_attention splits")


def test_split_helpers():
    c = da.MIN_CHUNK
    assert [da.active_splits(x, 8) for x in (0, 1, c, c + 1, 3 * c, 100 * c)] == [1, 1, 1, 2, 3, 8]
    assert da.active_splits(5 * c, 1) == 1
    # Qwen3-8B (kvH 8) on an H200 (132 SMs): 16 programs per KV head fill one wave, capped by the bound.
    assert da.pick_max_splits(1, 8, 32768, 132) == min(16, 32768 // c)
    assert da.pick_max_splits(1, 8, 2048, 132) == 2048 // c
    assert da.pick_max_splits(8, 8, 32768, 132) == 2
    assert da.pick_max_splits(4, 8, 0, 132) == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_calls_equal_one_over_the_longer_block(backend):
    """Two verify calls in a row: the second one's context includes the rows the first one wrote (as a
    runtime does after accepting them), and equals one verify call over the concatenated block."""
    n, b, nh, kvh, d = 2, 4, 4, 2, 16
    q, k, v, kc, vc, cl, qw, kw = _case(n, 2 * b, nh, kvh, d, [3, 9], 30, torch.float32, True)
    rope = dict(inv_freq=_inv_freq(d), scale=0.2)
    kc2, vc2 = kc.clone(), vc.clone()
    whole = verify_attention(q, k, v, kc, vc, cl, qw, kw, backend=backend, **rope)
    verify_attention(q[:, :b], k[:, :b], v[:, :b], kc2, vc2, cl, qw, kw, backend=backend, **rope)
    second = verify_attention(q[:, b:].contiguous(), k[:, b:].contiguous(), v[:, b:].contiguous(), kc2, vc2, cl + b,
                              qw, kw, backend=backend, **rope)
    torch.testing.assert_close(second, whole[:, b:], rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(kc2, kc, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(_bits(vc2), _bits(vc))


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck(backend):
    q, k, v, kc, vc, cl, qw, kw = _case(2, 3, 4, 2, 8, [4, 0], 12, torch.float32, True)
    inv = _inv_freq(8)
    table, num_pages = random_block_table(2, 12, 4)
    kp, vp = to_paged(kc, table, num_pages, 4), to_paged(vc, table, num_pages, 4)
    for args in ((q, k, v, kc, vc, cl, qw, kw, inv, 1.0, 1e-6, None, None, None, None, None, None, None, backend),
                 (q, k, v, kp, vp, cl, None, None, inv, 1.1, 1e-6, 0.25, table, None, 2, 8, None, None, backend)):
        torch.library.opcheck(torch.ops.dflash.verify_attention.default, args)


def test_bad_inputs():
    q, k, v, kc, vc, cl, qw, kw = _case(2, 3, 4, 2, 8, [3, 4], 10, torch.float32, True)
    rope = dict(inv_freq=_inv_freq(8))
    with pytest.raises(TypeError, match="dtype .* must equal q's dtype"):
        verify_attention(q, k, v, kc.bfloat16(), vc.bfloat16(), cl, qw, kw, **rope)
    with pytest.raises(ValueError, match="both q_norm_weight and k_norm_weight"):
        verify_attention(q, k, v, kc, vc, cl, qw, None, **rope)
    with pytest.raises(ValueError, match="q_norm_weight must be"):
        verify_attention(q, k, v, kc, vc, cl, qw[:4], kw, **rope)
    for bad in (0.0, -1.0, True, "0.1"):
        with pytest.raises(ValueError, match="scale"):
            verify_attention(q, k, v, kc, vc, cl, qw, kw, scale=bad, **rope)
    with pytest.raises(ValueError, match="verify_attention: cache_lens"):
        verify_attention(q, k, v, kc, vc, cl[:1], qw, kw, **rope)
    with pytest.raises(ValueError, match="not both"):
        verify_attention(q, k, v, kc, vc, cl, qw, kw, block_table=torch.zeros(2, 1, dtype=torch.int32),
                         cache_batch_idx=torch.zeros(2, dtype=torch.int64), **rope)
    with pytest.raises(ValueError, match="num_splits"):
        verify_attention(q, k, v, kc, vc, cl, qw, kw, num_splits=0, **rope)


@pytest.mark.skipif(DEVICE != "cpu", reason="CPU tensors only")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", [c for c in CASES if c[-1] != "paged"], ids=lambda c: f"{c[-1]}-b{c[1]}")
def test_cpu_backend_torch_formulas_are_the_reference_bit_for_bit(monkeypatch, dtype, case, seed):
    """backend="cpu" without its native kernel (bf16, a paged cache, no compiler, DFLASH_CPU_NATIVE=0) runs the
    reference's formula with less Python per call: output and caches identical."""
    monkeypatch.setenv(cpu_native.ENV, "0")
    n, b, nh, kvh, d, lens, cap, kind = case
    q, k, v, kc, vc, cl, qw, kw = _case(n, b, nh, kvh, d, lens, cap, dtype, True)
    rope = dict(inv_freq=_inv_freq(d), attention_scaling=1.1, scale=0.7 * d ** -0.5)
    for norms in ((qw, kw), (None, None)):
        results = []
        for backend in ("torch", "cpu"):
            torch.manual_seed(seed)  # the same layout for both backends
            kc_in, vc_in, where, buffers, _ = _layout(kind, kc, vc)
            out = verify_attention(q, k, v, kc_in, vc_in, cl, *norms, backend=backend, **where, **rope)
            results.append((out, *buffers))
        for got, want in zip(results[1], results[0]):
            assert torch.equal(_bits(got), _bits(want))


@pytest.mark.skipif(DEVICE != "cpu", reason="CPU tensors only")
@pytest.mark.parametrize("native", ["1", "0"], ids=["native", "torch_formulas"])
def test_cpu_backend_sees_inv_freq_changed_in_place(monkeypatch, native):
    """The "cpu" path keeps the last RoPE tables (both its native kernel and its torch formulas read them);
    changing inv_freq in place (same tensor, same positions) must not reuse them. Torch formulas: the
    reference's bits; native: the 2x rule against fp64 (stale tables would be off by O(1))."""
    monkeypatch.setenv(cpu_native.ENV, native)
    n, b, nh, kvh, d, lens, cap, _ = CASES[0]
    args = _case(n, b, nh, kvh, d, lens, cap, torch.float32, True)
    q, k, v, kc, vc, cl, qw, kw = args
    for inference in (False, True):  # an inference tensor has no version counter
        with torch.inference_mode(inference):
            inv_freq = _inv_freq(d)
            for _ in range(2):
                got = verify_attention(q, k, v, kc.clone(), vc.clone(), cl, qw, kw, inv_freq=inv_freq, backend="cpu")
                (ref, _, _), (lowp, _, _) = _reference(args, inv_freq=inv_freq.clone())
                if native == "0":
                    assert torch.equal(got, lowp)
                else:
                    assert_within_rule(got, ref, lowp, "cpu verify_attention after an in-place inv_freq change")
                inv_freq.mul_(1.7)


@pytest.mark.parametrize("backend", BACKENDS)
def test_int32_index_tensors_give_the_int64_result(backend):
    """int32 cache_lens and cache_batch_idx (vLLM's dtype) index exactly as int64 ones on every backend: same output
    bits, same caches (the native kernel once read them as int64 and crashed)."""
    q, k, v, kc, vc, cl, qw, kw = _case(3, 4, 4, 2, 16, [5, 0, 9], 16, torch.float32, True)
    kc, vc = torch.cat([kc, kc[:1]]), torch.cat([vc, vc[:1]])  # 4 batch rows, requests on rows 3, 0, 2
    rows = torch.tensor([3, 0, 2])
    results = []
    for dtype in (torch.int64, torch.int32):
        kn, vn = kc.clone(), vc.clone()
        out = verify_attention(q, k, v, kn, vn, cl.to(dtype), qw, kw, inv_freq=_inv_freq(16),
                               cache_batch_idx=rows.to(dtype), backend=backend)
        results.append((out, kn, vn))
    for a, b in zip(*results):
        assert torch.equal(_bits(a), _bits(b))
    assert torch.equal(_bits(results[0][1][1]), _bits(kc[1]))  # batch row 1 belongs to no request


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", ["negative length", "negative row", "row past the cache"])
def test_bad_index_values_raise_before_any_write(backend, bad):
    """Negative cache_lens or cache_batch_idx (which host indexing would take from the end) and rows past the cache
    are a ValueError naming the argument, from the public function and from the registered op alike, before any
    cache row is written."""
    q, k, v, kc, vc, cl, qw, kw = _case(2, 3, 4, 2, 8, [3, 4], 10, torch.float32, True)
    rows = torch.tensor([0, 1])
    name = "cache_lens"
    if bad == "negative length":
        cl = torch.tensor([3, -2], dtype=torch.int32)
    else:
        name = "cache_batch_idx"
        rows = torch.tensor([0, -1] if bad == "negative row" else [0, 2])
    kn, vn = kc.clone(), vc.clone()
    with pytest.raises(ValueError, match=f"verify_attention: {name} values must be"):
        verify_attention(q, k, v, kn, vn, cl, qw, kw, inv_freq=_inv_freq(8), cache_batch_idx=rows, backend=backend)
    with pytest.raises(ValueError, match=f"verify_attention: {name} values must be"):
        torch.ops.dflash.verify_attention(q, k, v, kn, vn, cl, qw, kw, _inv_freq(8), 1.0, 1e-6, None, None, rows, None,
                                          None, None, None, backend)
    assert torch.equal(_bits(kn), _bits(kc)) and torch.equal(_bits(vn), _bits(vc))


@pytest.mark.skipif(DEVICE != "cpu", reason="CPU tensors only")
@pytest.mark.parametrize("where", ["q", "k", "v", "k_cache"])
def test_cpu_backend_propagates_nan_as_the_reference(where):
    """A NaN in one request's q, k, v or cached K gives NaN exactly where the reference's SDPA gives it (q: that
    row and head; a key: every row of its KV head group, seen or masked; a V element: that column of the group);
    the other request's output is bit for bit the one without the NaN (the native kernel once turned NaN scores
    into zero weights and returned finite values)."""
    q, k, v, kc, vc, cl, qw, kw = _case(2, 4, 4, 2, 16, [5, 7], 16, torch.float32, False)
    clean = verify_attention(q, k, v, kc.clone(), vc.clone(), cl, inv_freq=_inv_freq(16), backend="cpu")
    t = {"q": q, "k": k, "v": v, "k_cache": kc}[where]
    t[0, 3 if where == "k_cache" else 2, 0, 1] = float("nan")
    ref = da.verify_attention_reference(q, k, v, kc.clone(), vc.clone(), cl, inv_freq=_inv_freq(16))
    out = verify_attention(q, k, v, kc.clone(), vc.clone(), cl, inv_freq=_inv_freq(16), backend="cpu")
    assert ref[0].isnan().any()
    assert torch.equal(out.isnan(), ref.isnan())
    assert torch.equal(_bits(out[1]), _bits(clean[1]))
