import pytest
import torch

from dflash_kernels.inject_context_kv import inject_context_kv, inject_context_kv_reference
from helpers.caches import paged_view, random_block_table
from helpers.device import DEVICE
from helpers.tol import assert_within_rule

BACKENDS = ["torch", "triton", pytest.param("cpu", marks=pytest.mark.skipif(DEVICE != "cpu", reason="CPU tensors only"))]


def _inv_freq(d, theta=10000.0):
    return 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))


def _case(q_cols, kvh, d, new_rows, cached, dtype):
    """k, v as column views of one [M, q_cols + 2*kvH*D] merged projection (strided rows, as the engine passes them)."""
    m = sum(new_rows)
    qkv = torch.randn(m, q_cols + 2 * kvh * d).to(dtype)
    k = qkv[:, q_cols:q_cols + kvh * d].view(m, kvh, d)
    v = qkv[:, q_cols + kvh * d:].view(m, kvh, d)
    knw = (1 + 0.3 * torch.randn(d)).to(dtype)
    cu = torch.tensor([0] + new_rows).cumsum(0)
    lens = torch.tensor(cached, dtype=torch.int64)
    capacity = max(c + r for c, r in zip(cached, new_rows)) + 3
    return k, v, knw, cu, lens, capacity


def _references(args, capacity, n, shape_tail, **kw):
    k, v, knw, cu, lens = args
    outs = []
    for dt in (torch.float64, k.dtype):
        kc = torch.full((n, capacity) + shape_tail, float("nan"), dtype=dt)
        vc = kc.clone()
        inject_context_kv_reference(k.to(dt), v.to(dt), knw.to(dt), cu, lens, kc, vc, **kw)
        outs.append((kc, vc))
    return outs


def _check(kc, vc, refs):
    (k64, v64), (klo, vlo) = refs
    for got, r64, lo, name in ((kc, k64, klo, "K"), (vc, v64, vlo, "V")):
        written = ~torch.isnan(r64)
        assert torch.equal(~torch.isnan(got), written), f"{name}: wrote outside the new rows or missed some"
        assert_within_rule(got[written], r64[written], lo[written], f"inject_context_kv {name}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_cols,kvh,d,new_rows,cached", [
    (5, 2, 24, [5, 0, 17], [0, 3, 1]),
    (0, 1, 16, [1, 40], [17, 0]),
    (9, 3, 8, [7, 1, 2, 16, 3], [300, 0, 1, 17, 2]),
])
@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_matches_reference(backend, dtype, q_cols, kvh, d, new_rows, cached, layout):
    k, v, knw, cu, lens, cap = _case(q_cols, kvh, d, new_rows, cached, dtype)
    _inject_and_check(backend, layout, (k, v, knw, cu, lens), cap)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("new_rows,cached", [([0, 1, 2], [0, 2, 0]), ([3, 0, 5, 19], [1, 4, 0, 2]), ([0, 7], [3, 0])])
@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_rows_past_the_last_offset_are_not_written(backend, dtype, new_rows, cached, layout):
    """k's rows at or past cu_ctx_lens[-1] (allowed: cu[-1] <= M) belong to no request: nothing of them reaches
    the cache, on every backend (the last request's rows would otherwise run on past its segment)."""
    k, v, knw, cu, lens, cap = _case(3, 2, 16, new_rows, cached, dtype)
    assert int(cu[-2]) < k.shape[0]  # the last request's rows become rows past the offsets
    _inject_and_check(backend, layout, (k, v, knw, cu[:-1], lens[:-1]), cap)


def _inject_and_check(backend, layout, args, cap):
    """Inject into NaN-filled caches (contiguous, or paged under a random block table) and compare with the
    references: the same rows written, the values within the tolerance rule."""
    k, v, knw, cu, lens = args
    n, (_, kvh, d), dtype = lens.shape[0], k.shape, k.dtype
    rope = dict(inv_freq=_inv_freq(d), attention_scaling=0.9, eps=1e-6)
    if layout == "contiguous":
        kc = torch.full((n, cap, kvh, d), float("nan"), dtype=dtype)
        vc = kc.clone()
        inject_context_kv(k, v, knw, cu, lens, kc, vc, backend=backend, **rope)
    else:
        table, num_pages = random_block_table(n, cap, 4)
        kp = torch.full((num_pages, 4, kvh, d), float("nan"), dtype=dtype)
        vp = kp.clone()
        inject_context_kv(k, v, knw, cu, lens, kp, vp, block_table=table, backend=backend, **rope)
        kc, vc = paged_view(kp, table, cap), paged_view(vp, table, cap)
    _check(kc, vc, _references(args, cap, n, (kvh, d), **rope))


@pytest.mark.parametrize("backend", BACKENDS)
def test_cache_batch_idx_and_rope_init(backend):
    # inv_freq/attention_scaling as transformers builds them for a yarn config.
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    d = 16
    cfg = Qwen3Config(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=d,
                      max_position_embeddings=4096,
                      rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                       "original_max_position_embeddings": 1024})
    inv_freq, scaling = ROPE_INIT_FUNCTIONS["yarn"](cfg, torch.get_default_device())
    assert scaling != 1.0
    k, v, knw, cu, lens, cap = _case(3, 1, d, [3, 4], [2, 0], torch.float32)
    idx = torch.tensor([2, 0])
    kc = torch.full((3, cap, 1, d), float("nan"))
    vc = kc.clone()
    rope = dict(inv_freq=inv_freq, attention_scaling=scaling)
    inject_context_kv(k, v, knw, cu, lens, kc, vc, cache_batch_idx=idx, backend=backend, **rope)
    assert torch.isnan(kc[1]).all()
    refs = _references((k, v, knw, cu, lens), cap, 2, (1, d), **rope)
    _check(kc[idx], vc[idx], refs)


def test_bad_inputs():
    k, v, knw, cu, lens, cap = _case(0, 1, 8, [2, 3], [0, 1], torch.float32)
    kc = torch.zeros(2, cap, 1, 8)
    vc = kc.clone()
    rope = dict(inv_freq=_inv_freq(8))
    with pytest.raises(ValueError, match="cache_lens"):
        inject_context_kv(k, v, knw, cu, lens[:1], kc, vc, **rope)
    with pytest.raises(ValueError, match="v must have k's shape"):
        inject_context_kv(k, v[:-1], knw, cu, lens, kc, vc, **rope)
    with pytest.raises(TypeError, match="v has dtype"):
        inject_context_kv(k, v.double(), knw, cu, lens, kc, vc, **rope)
    with pytest.raises(ValueError, match="k_norm_weight"):
        inject_context_kv(k, v, knw[:4], cu, lens, kc, vc, **rope)
    with pytest.raises(ValueError, match="inv_freq"):
        inject_context_kv(k, v, knw, cu, lens, kc, vc, inv_freq=_inv_freq(16))
    with pytest.raises(ValueError, match="k_cache"):
        inject_context_kv(k, v, knw, cu, lens, kc[None], vc[None], **rope)
    with pytest.raises(ValueError, match="v_cache"):
        inject_context_kv(k, v, knw, cu, lens, kc, vc[:1], **rope)
    with pytest.raises(ValueError, match="block_table"):
        inject_context_kv(k, v, knw, cu, lens, kc, vc, block_table=torch.zeros(3, 2, dtype=torch.int32), **rope)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_past_capacity_are_dropped_not_wrapped(backend):
    k, v, knw, cu, lens, cap = _case(0, 1, 8, [6], [0], torch.float32)
    kc = torch.full((1, 4, 1, 8), float("nan"))        # capacity 4 < 6 new rows
    vc = kc.clone()
    inject_context_kv(k, v, knw, cu, lens, kc, vc, inv_freq=_inv_freq(8), backend=backend)
    full_k = torch.full((1, 6, 1, 8), float("nan"))
    full_v = full_k.clone()
    inject_context_kv(k, v, knw, cu, lens, full_k, full_v, inv_freq=_inv_freq(8), backend=backend)
    assert torch.equal(kc, full_k[:, :4]) and torch.equal(vc, full_v[:, :4])


@pytest.mark.parametrize("backend", BACKENDS)
def test_int32_index_tensors_give_the_int64_result(backend):
    """int32 cu_ctx_lens, cache_lens and cache_batch_idx write exactly the caches int64 ones write, on every
    backend (the native kernel reads int64 copies)."""
    k, v, knw, cu, lens, cap = _case(3, 2, 16, [4, 0, 6], [2, 5, 0], torch.float32)
    rows = torch.tensor([3, 0, 1])
    caches = []
    for dtype in (torch.int64, torch.int32):
        kc, vc = torch.zeros(4, cap, 2, 16), torch.zeros(4, cap, 2, 16)
        inject_context_kv(k, v, knw, cu.to(dtype), lens.to(dtype), kc, vc, inv_freq=_inv_freq(16),
                          cache_batch_idx=rows.to(dtype), backend=backend)
        caches.append((kc, vc))
    assert caches[0][0].any() and not caches[0][0][2].any()  # rows written; batch row 2 belongs to no request
    for a, b in zip(*caches):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name, value", [("cache_lens", [0, -1, 2]), ("cache_batch_idx", [0, -1, 1]),
                                         ("cache_batch_idx", [0, 4, 1]), ("cu_ctx_lens", [0, 4, 3, 10]),
                                         ("cu_ctx_lens", [1, 4, 4, 10]), ("cu_ctx_lens", [0, 4, 4, 11])])
def test_bad_index_values_raise_before_any_write(backend, name, value):
    """Negative lengths or rows, rows past the cache and offsets that are not a partition of k's rows are a
    ValueError naming the argument (host indexing would have written other rows; the kernels past the caches)."""
    k, v, knw, cu, lens, cap = _case(3, 2, 16, [4, 0, 6], [2, 5, 0], torch.float32)
    args = dict(cu_ctx_lens=cu, cache_lens=lens, cache_batch_idx=torch.tensor([3, 0, 1]))
    args[name] = torch.tensor(value)
    kc, vc = torch.zeros(4, cap, 2, 16), torch.zeros(4, cap, 2, 16)
    with pytest.raises(ValueError, match=f"inject_context_kv: {name}"):
        inject_context_kv(k, v, knw, args["cu_ctx_lens"], args["cache_lens"], kc, vc, inv_freq=_inv_freq(16),
                          cache_batch_idx=args["cache_batch_idx"], backend=backend)
    assert not kc.any() and not vc.any()


def vllm_cpu_cache(num_pages, page_size, kvh, d, dtype):
    """vLLM's CPU KV cache of one layer ``[pages, kvH, page_size, 2*D]``, NaN-filled, and its K and V as
    ``[pages, page_size, kvH, D]`` views: per page and head, K is stored transposed (``[D, page_size]``), then V."""
    cache = torch.full((num_pages, kvh, page_size, 2 * d), float("nan"), dtype=dtype)
    halves = cache.view(num_pages, kvh, 2, page_size * d)
    k_view = halves[:, :, 0].view(num_pages, kvh, d, page_size).permute(0, 3, 1, 2)
    v_view = halves[:, :, 1].view(num_pages, kvh, page_size, d).permute(0, 2, 1, 3)
    return cache, k_view, v_view


@pytest.mark.parametrize("backend", ["torch", pytest.param("cpu", marks=pytest.mark.skipif(
    DEVICE != "cpu", reason="CPU tensors only"))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slot_mapping_writes_each_row_to_its_slot_in_vllms_cpu_layout(backend, dtype):
    """Row i lands at vLLM's flat slot ``slot_mapping[i]`` (-1 skips it) with the K and V the reference writes into a
    contiguous cache at its position; nothing else of the cache (NaN-filled, K transposed per page) is written."""
    k, v, knw, cu, lens, cap = _case(3, 3, 16, [5, 1, 9], [40, 0, 7], dtype)
    m, pages, page_size = k.shape[0], 6, 8
    slots = torch.randperm(pages * page_size)[:m]
    slots[torch.randperm(m)[:3]] = -1
    rope = dict(inv_freq=_inv_freq(16), attention_scaling=0.75, eps=1e-5)
    cache, kc, vc = vllm_cpu_cache(pages, page_size, 3, 16, dtype)
    inject_context_kv(k, v, knw, cu, lens, kc, vc, slot_mapping=slots.to(torch.int32), backend=backend, **rope)
    plain_k = torch.full((3, cap, 3, 16), float("nan"), dtype=dtype)
    plain_v = plain_k.clone()
    inject_context_kv(k, v, knw, cu, lens, plain_k, plain_v, backend="torch", **rope)  # both run the reference
    written = torch.zeros(pages * page_size, dtype=torch.bool)
    for n in range(3):
        for i in range(int(cu[n]), int(cu[n + 1])):
            s = int(slots[i])
            if s < 0:
                continue
            written[s] = True
            t = int(lens[n]) + i - int(cu[n])
            assert torch.equal(kc[s // page_size, s % page_size], plain_k[n, t])
            assert torch.equal(vc[s // page_size, s % page_size], plain_v[n, t])
    untouched = ~written.view(pages, page_size)
    assert torch.isnan(kc[untouched]).all() and torch.isnan(vc[untouched]).all()
    assert not torch.isnan(kc[~untouched]).any() and not torch.isnan(vc[~untouched]).any()


@pytest.mark.parametrize("slots, message", [
    ([0, 1, 2], r"slot_mapping must be \[M=5\]"),
    ([0, 1, 2, 3, 48], r"slot_mapping.*\[-1, 48\)"),
    ([0, 1, -2, 3, 4], r"slot_mapping.*\[-1, 48\)"),
], ids=["length", "past-the-cache", "below-minus-one"])
def test_bad_slot_mapping_raises_before_any_write(slots, message):
    k, v, knw, cu, lens, cap = _case(0, 1, 8, [2, 3], [0, 1], torch.float32)
    cache, kc, vc = vllm_cpu_cache(6, 8, 1, 8, torch.float32)
    with pytest.raises(ValueError, match=message):
        inject_context_kv(k, v, knw, cu, lens, kc, vc, inv_freq=_inv_freq(8), slot_mapping=torch.tensor(slots),
                          backend="torch")
    assert torch.isnan(cache).all()
    with pytest.raises(ValueError, match="neither block_table nor cache_batch_idx"):
        inject_context_kv(k, v, knw, cu, lens, kc, vc, inv_freq=_inv_freq(8), slot_mapping=torch.arange(5),
                          cache_batch_idx=torch.tensor([0, 1]), backend="torch")
    with pytest.raises(ValueError, match="not 'triton'"):
        inject_context_kv(k, v, knw, cu, lens, kc, vc, inv_freq=_inv_freq(8), slot_mapping=torch.arange(5),
                          backend="triton")
    assert torch.isnan(cache).all()
