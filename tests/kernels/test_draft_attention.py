import pytest
import torch

from dflash_kernels.cpu import native as cpu_native
from dflash_kernels._triton_utils import rope_cos_sin_reference
from dflash_kernels.draft_attention import draft_attention, draft_attention_reference
from helpers.caches import random_block_table, to_paged
from helpers.splits import assert_slots, da, nan_partials
from helpers.device import DEVICE
from helpers.tol import assert_within_rule

BACKENDS = ["torch", "triton", pytest.param("cpu", marks=pytest.mark.skipif(DEVICE != "cpu", reason="CPU tensors only"))]


def _inv_freq(d, theta=10000.0):
    return 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))


def _case(n, b, nh, kvh, d, lens, dtype):
    cap = max(lens) + 5
    q = torch.randn(n, b, nh, d).to(dtype)
    k = torch.randn(n, b, kvh, d).to(dtype)
    v = torch.randn(n, b, kvh, d).to(dtype)
    kc = torch.randn(n, cap, kvh, d).to(dtype)
    vc = torch.randn(n, cap, kvh, d).to(dtype)
    qw = (1 + 0.3 * torch.randn(d)).to(dtype)
    kw = (1 + 0.3 * torch.randn(d)).to(dtype)
    return q, k, v, kc, vc, torch.tensor(lens, dtype=torch.int64), qw, kw


def _refs(args, **kw):
    q, k, v, kc, vc, lens, qw, kw_ = args
    norms = (None, None) if qw is None else (qw.double(), kw_.double())
    ref = draft_attention_reference(*(x.double() for x in (q, k, v, kc, vc)), lens, *norms, **kw)
    lowp = draft_attention_reference(q, k, v, kc, vc, lens, qw, kw_, **kw)
    return ref, lowp


CASES = [  # n, b, nh, kvh, d, context lengths
    (2, 7, 4, 2, 24, [17, 0]),
    (3, 16, 4, 1, 16, [300, 1, 17]),
    (1, 1, 2, 2, 32, [300]),
    (5, 2, 6, 3, 8, [0, 1, 17, 300, 2]),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("window", [None, 20])
def test_matches_reference(backend, dtype, case, window):
    n, b, nh, kvh, d, lens = case
    args = _case(n, b, nh, kvh, d, lens, dtype)
    rope = dict(inv_freq=_inv_freq(d), attention_scaling=1.1, sliding_window=window)
    out = draft_attention(*args, backend=backend, **rope)
    ref, lowp = _refs(args, **rope)
    assert out.dtype == dtype and out.shape == (n, b, nh, d)
    assert_within_rule(out, ref, lowp, "draft_attention")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", [CASES[0], CASES[3]])
@pytest.mark.parametrize("window,causal", [(None, True), (5, False)])
def test_causal_override(backend, dtype, case, window, causal):
    """dflash_config.causal-style overrides: causal without a window, and a non-causal window."""
    n, b, nh, kvh, d, lens = case
    args = _case(n, b, nh, kvh, d, lens, dtype)
    rope = dict(inv_freq=_inv_freq(d), sliding_window=window, causal=causal)
    out = draft_attention(*args, backend=backend, **rope)
    ref, lowp = _refs(args, **rope)
    assert_within_rule(out, ref, lowp, "draft_attention causal override")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("window,causal", [(None, None), (None, True), (3, None), (20, False)])
def test_cache_lens_past_the_capacity_read_up_to_it(backend, dtype, paged, window, causal):
    """A length past the capacity reads the context up to the capacity (the block rows stay at positions
    cache_lens + i, and a window counts from there), on every backend and in the reference alike."""
    n, b, nh, kvh, d, lens = 4, 5, 4, 2, 16, [40, 33, 31, 50]
    q, k, v, kc, vc, cl, qw, kw = _case(n, b, nh, kvh, d, lens, dtype)
    cap = 32  # under three of the four lengths, one of them by less than the window
    kc, vc = kc[:, :cap].contiguous(), vc[:, :cap].contiguous()
    rope = dict(inv_freq=_inv_freq(d), attention_scaling=1.1, sliding_window=window, causal=causal)
    where = {}
    if paged:
        table, num_pages = random_block_table(n, cap, 16)
        where = dict(block_table=table)
        kc_in, vc_in = to_paged(kc, table, num_pages, 16), to_paged(vc, table, num_pages, 16)
    else:
        kc_in, vc_in = kc, vc
    out = draft_attention(q, k, v, kc_in, vc_in, cl, qw, kw, backend=backend, **where, **rope)
    ref, lowp = _refs((q, k, v, kc, vc, cl, qw, kw), **rope)
    assert_within_rule(out, ref, lowp, "draft_attention")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window", [None, 5])
def test_paged_equals_contiguous(backend, window):
    n, b, nh, kvh, d, lens = 3, 7, 4, 2, 16, [300, 0, 17]
    q, k, v, kc, vc, cl, qw, kw = _case(n, b, nh, kvh, d, lens, torch.bfloat16)
    cap = kc.shape[1]
    table, num_pages = random_block_table(n, cap, 16)
    kp, vp = to_paged(kc, table, num_pages, 16), to_paged(vc, table, num_pages, 16)
    rope = dict(inv_freq=_inv_freq(d), sliding_window=window)
    contiguous = draft_attention(q, k, v, kc, vc, cl, qw, kw, backend=backend, **rope)
    paged = draft_attention(q, k, v, kp, vp, cl, qw, kw, block_table=table, backend=backend, **rope)
    assert torch.equal(contiguous, paged)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", [CASES[1], CASES[3]])
@pytest.mark.parametrize("window", [None, 20])
def test_without_qk_norm(backend, dtype, case, window):
    """q_norm_weight = k_norm_weight = None: RoPE only (LLaMA-style layers)."""
    n, b, nh, kvh, d, lens = case
    args = _case(n, b, nh, kvh, d, lens, dtype)[:6] + (None, None)
    rope = dict(inv_freq=_inv_freq(d), attention_scaling=1.1, sliding_window=window)
    out = draft_attention(*args, backend=backend, **rope)
    ref, lowp = _refs(args, **rope)
    assert_within_rule(out, ref, lowp, "draft_attention without q/k norm")


@pytest.mark.parametrize("window", [None, 100])
def test_split_count_follows_the_live_length(monkeypatch, window):
    """MIN_CHUNK lowered to 64 rows, a grid of 4 splits: each request's active split count follows its live
    rows (the context, or its last W - 1 rows with a window), it writes exactly its active slots (none with
    one active split), inactive slots are not read by the merge (NaN-filled partials), and the result is
    within the rule."""
    monkeypatch.setattr(da, "MIN_CHUNK", 64)
    lens = [300, 0, 130, 65, 64]
    live = [c if window is None else min(c, window - 1) for c in lens]
    active = [da.active_splits(x, 4) for x in live]
    assert max(active) > 1 and min(active) < 4, active
    args = _case(len(lens), 3, 6, 2, 16, lens, torch.bfloat16)
    rope = dict(inv_freq=_inv_freq(16), sliding_window=window)
    seen = nan_partials(monkeypatch)
    out = draft_attention(*args, num_splits=4, backend="triton", **rope)
    assert_slots(seen[0], live, 4, kv_heads=2)
    ref, lowp = _refs(args, **rope)
    assert_within_rule(out, ref, lowp, "draft_attention live splits")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("window,block_lens", [(None, None), (20, [2, 5, 1, 5])])
def test_one_active_split_stores_the_output(monkeypatch, dtype, paged, window, block_lens):
    """MIN_CHUNK lowered to 64 rows, a grid of 4 splits, at most 64 live rows per request: the one active
    split normalises and stores the output itself, no partial slot is written (NaN-filled: the merge would
    be poisoned by reading one), and the result is within the rule (rows past block_lens: finite)."""
    monkeypatch.setattr(da, "MIN_CHUNK", 64)
    lens = [64, 0, 17, 40]
    n, b, nh, kvh, d = 4, 5, 6, 2, 16
    q, k, v, kc, vc, cl, qw, kw = _case(n, b, nh, kvh, d, lens, dtype)
    caches = dict()
    kc_in, vc_in = kc, vc
    if paged:
        table, num_pages = random_block_table(n, kc.shape[1], 16)
        kc_in, vc_in = to_paged(kc, table, num_pages, 16), to_paged(vc, table, num_pages, 16)
        caches = dict(block_table=table)
    blens = None if block_lens is None else torch.tensor(block_lens)
    rope = dict(inv_freq=_inv_freq(d), sliding_window=window)
    seen = nan_partials(monkeypatch)
    out = draft_attention(q, k, v, kc_in, vc_in, cl, qw, kw, block_lens=blens, num_splits=4, backend="triton",
                          **caches, **rope)
    assert_slots(seen[0], [c if window is None else min(c, window - 1) for c in lens], 4, kv_heads=2)
    assert torch.isfinite(out).all()
    for r in range(n):
        nb = b if block_lens is None else block_lens[r]
        short = tuple(x[r:r + 1, :nb] for x in (q, k, v)) + (kc[r:r + 1], vc[r:r + 1], cl[r:r + 1], qw, kw)
        ref, lowp = _refs(short, **rope)
        assert_within_rule(out[r:r + 1, :nb], ref, lowp, f"draft_attention one split, request {r}")


@pytest.mark.skipif(DEVICE != "cpu", reason="reorders the interpreter's programs")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_does_not_depend_on_which_split_finishes_last(monkeypatch, dtype):
    """MIN_CHUNK lowered to 64 rows, a grid of 4 splits, 1 to 4 active: the interpreter runs a request's splits
    in order (split A-1 finishes last and merges) or, patched, in reverse (split 0 merges, its own slot from
    registers amid the others'). Bit-identical outputs, and the merging split's slot never written."""
    from triton.runtime import interpreter

    monkeypatch.setattr(da, "MIN_CHUNK", 64)
    lens = [300, 130, 0, 200]
    active = [da.active_splits(x, 4) for x in lens]
    assert active == [4, 3, 1, 4]
    args = _case(len(lens), 5, 6, 2, 16, lens, dtype)
    rope = dict(inv_freq=_inv_freq(16), attention_scaling=1.1)
    seen = nan_partials(monkeypatch)
    in_order = draft_attention(*args, num_splits=4, backend="triton", **rope)
    set_idx = interpreter.interpreter_builder.set_grid_idx
    monkeypatch.setattr(interpreter.interpreter_builder, "set_grid_idx",
                        lambda x, y, z: set_idx(x, y, interpreter.interpreter_builder.grid_dim[2] - 1 - z))
    reversed_order = draft_attention(*args, num_splits=4, backend="triton", **rope)
    assert torch.equal(in_order, reversed_order)
    for partials, merger in zip(seen, (lambda a: a - 1, lambda a: 0)):
        assert_slots(partials, lens, 4, kv_heads=2)
        for r, a in enumerate(active):
            if a > 1:
                assert torch.isnan(partials[1][r, merger(a)]).all(), (r, a)
    ref, lowp = _refs(args, **rope)
    assert_within_rule(in_order, ref, lowp, "draft_attention merge")


def test_split_count_does_not_change_result():
    args = _case(2, 7, 4, 2, 16, [300, 17], torch.float32)
    rope = dict(inv_freq=_inv_freq(16))
    outs = [draft_attention(*args, num_splits=s, backend="triton", **rope) for s in (1, 3, 7)]
    ref, lowp = _refs(args, **rope)
    for o in outs:
        assert_within_rule(o, ref, lowp, "num_splits")


@pytest.mark.parametrize("backend", BACKENDS)
def test_cache_batch_idx_and_strided_inputs(backend):
    n, b, nh, kvh, d = 2, 2, 4, 2, 16
    q, k, v, kc, vc, cl, qw, kw = _case(n, b, nh, kvh, d, [17, 1], torch.float32)
    qkv = torch.randn(n, b, (nh + 2 * kvh) * d)          # a fused QKV projection, viewed per head
    q = qkv[..., : nh * d].unflatten(-1, (nh, d))
    k = qkv[..., nh * d:(nh + kvh) * d].unflatten(-1, (kvh, d))
    v = qkv[..., (nh + kvh) * d:].unflatten(-1, (kvh, d))
    big_k = torch.randn(4, kc.shape[1], kvh, d)
    big_v = torch.randn(4, kc.shape[1], kvh, d)
    idx = torch.tensor([3, 1])
    big_k[idx], big_v[idx] = kc, vc
    rope = dict(inv_freq=_inv_freq(d))
    out = draft_attention(q, k, v, big_k, big_v, cl, qw, kw, cache_batch_idx=idx, backend=backend, **rope)
    ref, lowp = _refs((q, k, v, kc, vc, cl, qw, kw), **rope)
    assert_within_rule(out, ref, lowp, "cache_batch_idx")


def test_reference_definition_matches_explicit_math():
    """The reference (SDPA) against a hand-written fp64 formulation of the DFlash draft attention."""
    n, b, nh, kvh, d, w = 1, 5, 4, 2, 8, 4
    q, k, v, kc, vc, cl, qw, kw = (x.double() if x.is_floating_point() else x
                                   for x in _case(n, b, nh, kvh, d, [6], torch.float64))
    inv = _inv_freq(d)
    c = 6
    pos = torch.arange(c, c + b)
    cos, sin = rope_cos_sin_reference(pos, inv, 1.0, torch.float64)

    def norm_rope(x, wt):
        x = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * wt
        rot = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
        return x * cos[:, None] + rot * sin[:, None]

    qn, kn = norm_rope(q[0], qw), norm_rope(k[0], kw)
    keys = torch.cat([kc[0, :c], kn]).repeat_interleave(nh // kvh, dim=1)    # [c+b, nh, d]
    vals = torch.cat([vc[0, :c], v[0]]).repeat_interleave(nh // kvh, dim=1)
    scores = torch.einsum("ihd,thd->hit", qn, keys) / d ** 0.5
    qp, kp = pos[:, None], torch.arange(c + b)[None, :]
    for window, causal in ((None, False), (w, True), (w, False), (None, True)):
        s = scores.clone()
        if causal:
            s = s.masked_fill(kp > qp, float("-inf"))
        if window is not None:
            s = s.masked_fill((qp - kp).abs() >= window, float("-inf"))
        expect = torch.einsum("hit,thd->ihd", s.softmax(-1), vals)
        got = draft_attention_reference(q, k, v, kc, vc, cl, qw, kw, inv_freq=inv, sliding_window=window,
                                        causal=causal)
        torch.testing.assert_close(got[0], expect, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("rope_type", ["default", "yarn"])
def test_rope_tables_match_transformers(rope_type):
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    torch.set_default_device("cpu")  # a pure reference check (the autouse fixture restores the device)
    params = {"rope_type": rope_type, "rope_theta": 10000.0}
    if rope_type == "yarn":
        params.update(factor=4.0, original_max_position_embeddings=256)
    cfg = Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=1024, rope_parameters=params)
    pos = torch.tensor([[0, 1, 17, 300, 1000]])
    cos_hf, sin_hf = Qwen3RotaryEmbedding(cfg)(torch.zeros(1, dtype=torch.float32), pos)
    if rope_type in ROPE_INIT_FUNCTIONS:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu")
    else:  # transformers 5.x keeps the default rope out of the table
        inv_freq, scaling = _inv_freq(16), 1.0
    cos, sin = rope_cos_sin_reference(pos, inv_freq, scaling, torch.float32)
    torch.testing.assert_close(cos, cos_hf)
    torch.testing.assert_close(sin, sin_hf)


def test_bad_inputs():
    q, k, v, kc, vc, cl, qw, kw = _case(2, 3, 4, 2, 8, [3, 4], torch.float32)
    rope = dict(inv_freq=_inv_freq(8))
    with pytest.raises(ValueError, match="cache_lens"):
        draft_attention(q, k, v, kc, vc, cl[:1], qw, kw, **rope)
    with pytest.raises(TypeError, match="k"):
        draft_attention(q, k.double(), v, kc, vc, cl, qw, kw, **rope)
    with pytest.raises(ValueError, match="KV heads"):
        draft_attention(q, k[:, :, :1].expand(2, 3, 3, 8).contiguous(), v[:, :, :1].expand(2, 3, 3, 8).contiguous(),
                        kc, vc, cl, qw, kw, **rope)
    with pytest.raises(ValueError, match="even"):
        draft_attention(q[..., :7], k[..., :7], v[..., :7], kc[..., :7], vc[..., :7], cl, qw[:7], kw[:7],
                        inv_freq=_inv_freq(8)[:3])
    with pytest.raises(ValueError, match="sliding_window"):
        draft_attention(q, k, v, kc, vc, cl, qw, kw, sliding_window=0, **rope)
    with pytest.raises(TypeError, match="causal"):
        draft_attention(q, k, v, kc, vc, cl, qw, kw, causal="yes", **rope)
    with pytest.raises(ValueError, match="inv_freq"):
        draft_attention(q, k, v, kc, vc, cl, qw, kw, inv_freq=_inv_freq(16))
    with pytest.raises(ValueError, match="not both"):
        draft_attention(q, k, v, kc, vc, cl, qw, kw, block_table=torch.zeros(2, 1, dtype=torch.int32),
                        cache_batch_idx=torch.zeros(2, dtype=torch.int64), **rope)
    with pytest.raises(ValueError, match="k_cache"):
        draft_attention(q, k, v, kc[..., :1, :], vc, cl, qw, kw, **rope)
    with pytest.raises(ValueError, match="both q_norm_weight and k_norm_weight"):
        draft_attention(q, k, v, kc, vc, cl, None, kw, **rope)


@pytest.mark.parametrize("backend", BACKENDS)
def test_inject_then_attend_matches_one_shot_reference(backend):
    """Two rounds of inject_context_kv (prefill, then accepted rows) into a paged cache, then
    draft_attention per layer == attention computed directly from all raw context rows."""
    from dflash_kernels.inject_context_kv import inject_context_kv

    layers, h, nh, kvh, d, b = 2, 24, 4, 2, 8, 4
    rounds = [[5, 0, 17], [3, 1, 0]]                      # new context rows per request per round
    n = len(rounds[0])
    totals = [sum(r[i] for r in rounds) for i in range(n)]
    ctx_all = [torch.randn(t, h) for t in totals]          # each request's context rows in position order
    kw = torch.randn(layers, kvh * d, h) / h ** 0.5
    vw = torch.randn(layers, kvh * d, h) / h ** 0.5
    knw = 1 + 0.3 * torch.randn(layers, d)
    qnw = 1 + 0.3 * torch.randn(layers, d)
    inv = _inv_freq(d)
    cap = max(totals) + 2
    table, num_pages = random_block_table(n, cap, 4)
    kc = torch.full((layers, num_pages, 4, kvh, d), float("nan"))
    vc = kc.clone()
    lens = torch.zeros(n, dtype=torch.int64)
    done = [0] * n
    for new in rounds:
        rows = torch.cat([ctx_all[i][done[i]:done[i] + new[i]] for i in range(n)])
        cu = torch.tensor([0] + new).cumsum(0)
        for layer in range(layers):
            inject_context_kv((rows @ kw[layer].T).view(-1, kvh, d), (rows @ vw[layer].T).view(-1, kvh, d), knw[layer],
                              cu, lens, kc[layer], vc[layer], inv_freq=inv, block_table=table, backend=backend)
        lens += torch.tensor(new)
        done = [done[i] + new[i] for i in range(n)]
    q = torch.randn(layers, n, b, nh, d)
    k = torch.randn(layers, n, b, kvh, d)
    v = torch.randn(layers, n, b, kvh, d)
    for layer in range(layers):
        out = draft_attention(q[layer], k[layer], v[layer], kc[layer], vc[layer], lens, qnw[layer], knw[layer],
                              inv_freq=inv, block_table=table, backend=backend)
        for i in range(n):
            c = totals[i]
            allpos = torch.arange(c + b)
            cos, sin = rope_cos_sin_reference(allpos, inv, 1.0, torch.float64)

            def norm_rope(x, wt, cs, sn):
                x = x.double()
                x = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * wt.double()
                rot = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
                return x * cs[:, None] + rot * sn[:, None]

            ck = (ctx_all[i].double() @ kw[layer].double().t()).view(c, kvh, d)
            cv = (ctx_all[i].double() @ vw[layer].double().t()).view(c, kvh, d)
            keys = torch.cat([norm_rope(ck, knw[layer], cos[:c], sin[:c]),
                              norm_rope(k[layer, i], knw[layer], cos[c:], sin[c:])])
            vals = torch.cat([cv, v[layer, i].double()])
            qq = norm_rope(q[layer, i], qnw[layer], cos[c:], sin[c:])
            expect = torch.nn.functional.scaled_dot_product_attention(
                qq.transpose(0, 1), keys.transpose(0, 1), vals.transpose(0, 1), scale=d ** -0.5,
                enable_gqa=True).transpose(0, 1)
            assert (out[i].double() - expect).abs().max() < 2e-6, (out[i].double() - expect).abs().max()


BLOCK_LENS_CASES = [  # n, b, nh, kvh, d, context lengths, block_lens, paged
    (3, 7, 4, 2, 24, [17, 0, 70], [1, 7, 4], False),
    (4, 16, 6, 3, 8, [5, 70, 0, 1], [3, 16, 1, 9], True),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", BLOCK_LENS_CASES, ids=["contiguous", "paged"])
@pytest.mark.parametrize("window,causal", [(None, None), (None, True), (3, None), (5, False)])
def test_block_lens_equals_the_shorter_block(backend, dtype, case, window, causal):
    """block_lens[n] = v: rows i < v equal an fp64 run on the literal v-row block [:, :v] (2x rule). The
    block K/V rows >= v are NaN-filled (they must not be read), and every output row stays finite."""
    n, b, nh, kvh, d, lens, blens, paged = case
    q, k, v, kc, vc, cl, qw, kw = _case(n, b, nh, kvh, d, lens, dtype)
    k_nan, v_nan = k.clone(), v.clone()
    for r, nb in enumerate(blens):
        k_nan[r, nb:] = float("nan")
        v_nan[r, nb:] = float("nan")
    caches = dict()
    if paged:
        table, num_pages = random_block_table(n, kc.shape[1], 16)
        kc_in, vc_in = to_paged(kc, table, num_pages, 16), to_paged(vc, table, num_pages, 16)
        caches = dict(block_table=table)
    else:
        kc_in, vc_in = kc, vc
    rope = dict(inv_freq=_inv_freq(d), attention_scaling=1.1, sliding_window=window, causal=causal)
    out = draft_attention(q, k_nan, v_nan, kc_in, vc_in, cl, qw, kw, block_lens=torch.tensor(blens), backend=backend,
                          **caches, **rope)
    assert out.shape == (n, b, nh, d) and torch.isfinite(out).all()
    for r, nb in enumerate(blens):
        short = tuple(x[r:r + 1, :nb] for x in (q, k, v)) + (kc[r:r + 1], vc[r:r + 1], cl[r:r + 1], qw, kw)
        ref, lowp = _refs(short, **rope)
        assert_within_rule(out[r:r + 1, :nb], ref, lowp, f"draft_attention block_lens request {r} (v={nb})")


@pytest.mark.parametrize("backend", BACKENDS)
def test_block_lens_of_b_is_the_default(backend):
    args = _case(3, 5, 4, 2, 16, [17, 0, 3], torch.bfloat16)
    rope = dict(inv_freq=_inv_freq(16), sliding_window=4)
    full = draft_attention(*args, block_lens=torch.full((3,), 5), backend=backend, **rope)
    assert torch.equal(full, draft_attention(*args, backend=backend, **rope))


def test_block_lens_bad_inputs():
    q, k, v, kc, vc, cl, qw, kw = _case(2, 3, 4, 2, 8, [3, 4], torch.float32)
    rope = dict(inv_freq=_inv_freq(8))
    with pytest.raises(TypeError, match="block_lens"):
        draft_attention(q, k, v, kc, vc, cl, qw, kw, block_lens=torch.tensor([1, 2], dtype=torch.int32), **rope)
    with pytest.raises(ValueError, match="block_lens must be"):
        draft_attention(q, k, v, kc, vc, cl, qw, kw, block_lens=torch.tensor([1, 2, 3]), **rope)


@pytest.mark.skipif(DEVICE != "cpu", reason="CPU tensors only")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_cpu_backend_torch_formulas_are_the_reference_bit_for_bit(monkeypatch, dtype, case):
    """backend="cpu" without its native kernel (bf16, a window, no compiler, DFLASH_CPU_NATIVE=0) runs the
    reference's formula with less Python per call: the same output bits on the rows the contract defines
    (i < block_lens), for every mask the reference builds, with and without q/k norm."""
    monkeypatch.setenv(cpu_native.ENV, "0")
    n, b, nh, kvh, d, lens = case
    q, k, v, kc, vc, cl, qw, kw = _case(n, b, nh, kvh, d, lens, dtype)
    idx = torch.randperm(n)
    block_lens = torch.randint(1, b + 1, (n,))
    valid = torch.arange(b)[None, :] < block_lens[:, None]
    for window, causal, norms in ((None, None, (qw, kw)), (None, True, (None, None)), (20, None, (qw, kw)),
                                  (3, False, (qw, kw))):
        kwargs = dict(inv_freq=_inv_freq(d), attention_scaling=1.1, sliding_window=window, causal=causal,
                      cache_batch_idx=idx, block_lens=block_lens)
        want = draft_attention(q, k, v, kc, vc, cl, *norms, backend="torch", **kwargs)
        got = draft_attention(q, k, v, kc, vc, cl, *norms, backend="cpu", **kwargs)
        assert torch.equal(got[valid], want[valid]), (window, causal)


@pytest.mark.parametrize("backend", BACKENDS)
def test_int32_index_tensors_give_the_int64_result(backend):
    """int32 cache_lens and cache_batch_idx index exactly as int64 ones on every backend (same output bits)."""
    q, k, v, kc, vc, cl, qw, kw = _case(3, 4, 4, 2, 16, [5, 0, 9], torch.float32)
    rows = torch.tensor([2, 0, 1])
    outs = [draft_attention(q, k, v, kc, vc, cl.to(dtype), qw, kw, inv_freq=_inv_freq(16),
                            cache_batch_idx=rows.to(dtype), block_lens=torch.tensor([4, 2, 3]), backend=backend)
            for dtype in (torch.int64, torch.int32)]
    assert torch.equal(outs[0].view(torch.int32), outs[1].view(torch.int32))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name, value", [("cache_lens", [3, -1]), ("cache_batch_idx", [-1, 0]),
                                         ("cache_batch_idx", [0, 2]), ("block_lens", [0, 3]), ("block_lens", [4, 3])])
def test_bad_index_values_raise(backend, name, value):
    """Negative lengths or rows, rows past the cache and block_lens outside [1, B] are a ValueError naming the
    argument, from the public function and from the registered op alike."""
    q, k, v, kc, vc, cl, qw, kw = _case(2, 3, 4, 2, 8, [3, 4], torch.float32)
    args = dict(cache_lens=cl, cache_batch_idx=None, block_lens=None)
    args[name] = torch.tensor(value)
    with pytest.raises(ValueError, match=f"draft_attention: {name} values must be"):
        draft_attention(q, k, v, kc, vc, args["cache_lens"], qw, kw, inv_freq=_inv_freq(8),
                        cache_batch_idx=args["cache_batch_idx"], block_lens=args["block_lens"], backend=backend)
    with pytest.raises(ValueError, match=f"draft_attention: {name} values must be"):
        torch.ops.dflash.draft_attention(q, k, v, kc, vc, args["cache_lens"], qw, kw, _inv_freq(8), 1.0, 1e-6, None,
                                         None, None, args["cache_batch_idx"], args["block_lens"], None, None, backend)


@pytest.mark.skipif(DEVICE != "cpu", reason="CPU tensors only")
@pytest.mark.parametrize("where", ["q", "k", "v", "k_cache", "v past block_lens"])
def test_cpu_backend_propagates_nan_as_the_reference(where):
    """A NaN in one request's q, k, v or cached K gives NaN exactly where the reference does, and a NaN in a block
    row past block_lens (never read by the reference) none; the other request's output keeps its bits."""
    q, k, v, kc, vc, cl, qw, kw = _case(2, 4, 4, 2, 16, [5, 7], torch.float32)
    block_lens = torch.tensor([3, 4])
    rope = dict(inv_freq=_inv_freq(16), block_lens=block_lens)
    clean = draft_attention(q, k, v, kc, vc, cl, qw, kw, backend="cpu", **rope)
    if where == "v past block_lens":
        v[0, 3, 0, 1] = float("nan")
    else:
        t = {"q": q, "k": k, "v": v, "k_cache": kc}[where]
        t[0, 3 if where == "k_cache" else 1, 0, 1] = float("nan")
    ref = draft_attention_reference(q, k, v, kc, vc, cl, qw, kw, **rope)
    out = draft_attention(q, k, v, kc, vc, cl, qw, kw, backend="cpu", **rope)
    assert ref[0].isnan().any() == (where != "v past block_lens")
    assert torch.equal(out.isnan(), ref.isnan())
    assert torch.equal(out[1].view(torch.int32), clean[1].view(torch.int32))


ORDERS = {  # the order the interpreter runs a request's split programs in
    "in-order": lambda s: list(range(s)),
    "reversed": lambda s: list(range(s))[::-1],
    "interleaved": lambda s: list(range(1, s, 2)) + list(range(0, s, 2)),
}


@pytest.mark.skipif(DEVICE != "cpu", reason="reorders the interpreter's programs")
@pytest.mark.parametrize("window", [None, 1500])
def test_merge_is_independent_of_the_split_order_at_the_real_chunk_sizes(monkeypatch, window):
    """The default plan (MIN_CHUNK 256, an H200's SMs): 11, 3, 1, 2 and 1 active splits, more than one tile of
    maxima and sums and several unrolled steps in the merge. In order, reversed and interleaved, the outputs are
    bit-identical, each request writes exactly its active slots but the merging one's (NaN-filled partials: a
    slot read unwritten poisons the output), and the result is within the rule."""
    from helpers.splits import merger, run_splits_in_order

    lens = [2600, 700, 256, 257, 0]
    live = [c if window is None else min(c, window - 1) for c in lens]
    args = _case(len(lens), 3, 2, 1, 16, lens, torch.bfloat16)
    rope = dict(inv_freq=_inv_freq(16), attention_scaling=1.1, sliding_window=window)
    grid = da.pick_max_splits(len(lens), 1, args[3].shape[1])
    active = [da.active_splits(x, grid) for x in live]
    assert grid == 11 and active == ([11, 3, 1, 2, 1] if window is None else [6, 3, 1, 2, 1]), (grid, active)
    seen = nan_partials(monkeypatch)
    outs = {}
    for name, order in ORDERS.items():
        run_splits_in_order(monkeypatch, order)
        outs[name] = draft_attention(*args, backend="triton", **rope)
    for name, partials in zip(ORDERS, seen):
        assert torch.equal(outs[name], outs["in-order"]), name
        assert_slots(partials, live, grid, kv_heads=1)
        for r, a in enumerate(active):
            if a > 1:
                assert torch.isnan(partials[1][r, merger(ORDERS[name](grid), a)]).all(), (name, r, a)
    ref, lowp = _refs(args, **rope)
    assert_within_rule(outs["in-order"], ref, lowp, "draft_attention merge, real chunk sizes")


def test_split_plan_follows_the_sm_count_with_a_256_row_floor():
    """Qwen3-8B (kvH 8) at batch 1 and 2k context: 8 splits a KV head on an H200 (64 programs on 132 SMs), 2 on
    16 SMs, 2 at batch 8 (128 programs); a split takes at least 256 rows; grids stop at MAX_SPLITS."""
    assert da.MIN_CHUNK == 256 and da.pick_max_splits(1, 8, 2048) == 8 and da.active_splits(2048, 8) == 8
    assert da.pick_max_splits(1, 8, 2048, num_sms=16) == 2 and da.pick_max_splits(8, 8, 2048) == 2
    assert [da.active_splits(x, 64) for x in (255, 256, 257, 1000)] == [1, 1, 2, 4]
    assert da.pick_max_splits(1, 1, 1 << 20) == da.MAX_SPLITS == 64


def test_a_grid_beyond_max_splits_is_lowered_to_it(monkeypatch):
    args = _case(2, 3, 4, 2, 16, [300, 17], torch.float32)
    rope = dict(inv_freq=_inv_freq(16))
    seen = nan_partials(monkeypatch)
    out = draft_attention(*args, num_splits=100, backend="triton", **rope)
    assert seen[0][0].shape[1] == da.MAX_SPLITS
    assert_slots(seen[0], [300, 17], da.MAX_SPLITS, kv_heads=2)
    ref, lowp = _refs(args, **rope)
    assert_within_rule(out, ref, lowp, "num_splits above MAX_SPLITS")


def test_launches_never_share_merge_counters(monkeypatch):
    """Each launch gets its own merge counters, zeroed for it: two launches (two streams, two graphs) never
    meet on one (request, head) pair's counters, and a launch cut short leaves nothing for the next."""
    made = []
    alloc = da._merge_counters

    def recording(*a):
        counters = alloc(*a)
        made.append((counters, counters.clone()))
        return counters

    monkeypatch.setattr(da, "_merge_counters", recording)
    args = _case(2, 3, 4, 2, 16, [600, 300], torch.float32)
    rope = dict(inv_freq=_inv_freq(16))
    first = draft_attention(*args, backend="triton", **rope)
    second = draft_attention(*args, backend="triton", **rope)
    assert torch.equal(first, second) and len(made) == 2
    (a, a_at_launch), (b, b_at_launch) = made
    assert a.data_ptr() != b.data_ptr() and not a_at_launch.any() and not b_at_launch.any()
    assert a.any(), "the launch used its counters (3 and 2 active splits per KV head)"
