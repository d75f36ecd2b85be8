"""The native fp32 kernels behind backend="cpu" (dflash_kernels.cpu.native): they build on this machine, the ops
take them where they apply (and not where they do not), and their results hold the 2x rule against fp64 at the
shapes the runtime uses (one row, a verify block, a prefill chunk) and at odd ones (a head dim with a tail)."""
import os

import pytest
import torch

from dflash_kernels import add_rms_norm, draft_attention, verify_attention

from dflash_kernels.cpu import native as cpu_native
from dflash_kernels.draft_attention import draft_attention_reference, verify_attention_reference
from dflash_kernels.layer_ops import add_rms_norm_reference
from dflash_kernels.tree import tree_ancestor_mask_reference
from helpers.device import DEVICE
from helpers.tol import assert_within_rule

pytestmark = pytest.mark.skipif(DEVICE != "cpu", reason="CPU tensors only")


@pytest.fixture
def calls(monkeypatch):
    """Count the native entry points' calls (the library loaded first)."""
    assert cpu_native.unavailable_reason() is None, "the native CPU kernels must build here (Linux x86-64, c++)"
    seen = {"norm": 0, "attention": 0, "silu": 0, "inject": 0}
    lib = cpu_native._lib
    for key, name in (("norm", "dflash_cpu_add_rms_norm_f32"), ("attention", "dflash_cpu_block_attention_f32"),
                      ("silu", "dflash_cpu_silu_mul_f32"), ("inject", "dflash_cpu_inject_kv_f32")):
        fn = getattr(lib, name)

        def counted(*args, _fn=fn, _key=key):
            seen[_key] += 1
            return _fn(*args)
        monkeypatch.setattr(lib, name, counted)
    return seen


def test_add_rms_norm_native(calls):
    for shape, strided in (((7, 576), False), ((3, 2, 40), False), ((5, 19), True), ((64, 1536), False)):
        x = torch.randn(shape[0], shape[-1] + 5)[:, 2:shape[-1] + 2] if strided else torch.randn(shape) * 2
        res, w = torch.randn(x.shape), 1 + 0.5 * torch.randn(shape[-1])
        for residual in (None, res):
            before = None if residual is None else residual.clone()
            out = add_rms_norm(x, w, 1e-5, residual=residual, backend="cpu")
            ref64 = add_rms_norm_reference(x.double(), w.double(), 1e-5,
                                           residual=None if before is None else before.double())
            lowp = add_rms_norm_reference(x, w, 1e-5, residual=None if before is None else before.clone())
            assert_within_rule(out, ref64, lowp, f"add_rms_norm {shape}")
            if residual is not None:
                assert torch.equal(residual, before + x)
    assert calls["norm"] == 8
    add_rms_norm(x.bfloat16(), w.bfloat16(), backend="cpu")  # bf16: the torch formula
    assert calls["norm"] == 8


def _inv_freq(d):
    return 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))


@pytest.mark.parametrize("n, b, nh, kvh, d, lens, cap, norm", [
    (1, 1, 9, 3, 64, [200], 512, False),      # SmolLM2's one-token step
    (2, 8, 9, 3, 64, [3, 180], 256, False),   # a verify block, ragged contexts
    (1, 40, 4, 2, 48, [17], 64, True),        # a prefill chunk, Qwen3-style q/k norm, D = 3 vectors of 16
    (3, 5, 6, 1, 32, [0, 9, 2], 16, True),    # G = 6, an empty context
])
def test_verify_attention_native(calls, n, b, nh, kvh, d, lens, cap, norm):
    q, k, v = (torch.randn(n, b, h, d) for h in (nh, kvh, kvh))
    kc, vc = (torch.randn(n + 1, cap, kvh, d) for _ in range(2))
    for r, c in enumerate(lens):
        kc[r + 1, c:c + b] = vc[r + 1, c:c + b] = float("nan")
    rows = torch.arange(1, n + 1)  # cache rows 1..n: row 0 must stay untouched
    cl = torch.tensor(lens)
    qw, kw = ((1 + 0.3 * torch.randn(d)) for _ in range(2)) if norm else (None, None)
    rope = dict(inv_freq=_inv_freq(d), attention_scaling=1.1, scale=0.7 * d ** -0.5, cache_batch_idx=rows)
    refs = []
    for conv in (torch.Tensor.double, torch.Tensor.clone):
        kr, vr = conv(kc), conv(vc)
        refs.append((verify_attention_reference(conv(q), conv(k), conv(v), kr, vr, cl, *(
            None if w is None else conv(w) for w in (qw, kw)), **rope), kr, vr))
    kn, vn = kc.clone(), vc.clone()
    out = verify_attention(q, k, v, kn, vn, cl, qw, kw, backend="cpu", **rope)
    assert calls["attention"] == 1
    assert_within_rule(out, refs[0][0], refs[1][0], "native verify_attention")
    assert_within_rule(kn, refs[0][1], refs[1][1], "native K cache")
    assert torch.equal(vn, refs[1][2]) and torch.equal(kn[0], kc[0])


@pytest.mark.parametrize("n, t, lens, cap", [
    (1, 24, [150], 256),       # trees of 23 (SmolLM2's shapes): units of 4 query rows, all full
    (2, 23, [40, 0], 96),      # a 3-row tail unit, an empty context
    (1, 70, [33], 128),        # two mask words, a 2-row tail unit
])
def test_tree_attention_native(calls, n, t, lens, cap):
    """A draft tree's verify attention (each node sees the context and its ancestors, at position start + depth)
    on the native kernel, against the fp64 definition."""
    nh, kvh, d = 9, 3, 64
    parents = torch.full((n, t), -1, dtype=torch.int64)
    depths = torch.zeros((n, t), dtype=torch.int64)
    for r in range(n):
        for i in range(1, t):
            parents[r, i] = int(torch.randint(0, i, ()))
            depths[r, i] = depths[r, parents[r, i]] + 1
    mask = tree_ancestor_mask_reference(parents)
    q, k, v = (torch.randn(n, t, h, d) for h in (nh, kvh, kvh))
    kc, vc = (torch.randn(n, cap, kvh, d) for _ in range(2))
    cl = torch.tensor(lens)
    qw, kw = ((1 + 0.3 * torch.randn(d)) for _ in range(2))
    rope = dict(inv_freq=_inv_freq(d), scale=d ** -0.5, tree_depths=depths, tree_mask=mask)
    refs = [verify_attention_reference(conv(q), conv(k), conv(v), conv(kc), conv(vc), cl, conv(qw), conv(kw), **rope)
            for conv in (torch.Tensor.double, torch.Tensor.clone)]
    out = verify_attention(q, k, v, kc.clone(), vc.clone(), cl, qw, kw, backend="cpu", **rope)
    assert calls["attention"] == 1
    assert_within_rule(out, refs[0], refs[1], "native tree attention")


def test_verify_attention_native_not_taken(calls):
    """Where the native kernel does not apply the op keeps its torch formula: bf16, a block past the capacity,
    or DFLASH_CPU_NATIVE=0."""
    d = 16
    q, k, v = (torch.randn(1, 4, h, d) for h in (2, 1, 1))
    kc, vc = torch.zeros(1, 8, 1, d), torch.zeros(1, 8, 1, d)
    args = dict(inv_freq=_inv_freq(d))
    verify_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), kc.bfloat16(), vc.bfloat16(), torch.tensor([0]),
                     backend="cpu", **args)
    verify_attention(q, k, v, kc, vc, torch.tensor([6]), backend="cpu", **args)  # 6 + 4 > 8
    assert calls["attention"] == 0
    verify_attention(q, k, v, kc, vc, torch.tensor([2]), backend="cpu", **args)
    assert calls["attention"] == 1
    with pytest.MonkeyPatch.context() as m:
        m.setenv(cpu_native.ENV, "0")
        verify_attention(q, k, v, kc, vc, torch.tensor([2]), backend="cpu", **args)
    assert calls["attention"] == 1


@pytest.mark.parametrize("causal", [False, True])
def test_draft_attention_native(calls, causal):
    """The draft step's attention: context rows from the cache (nothing written), the block's own keys aside,
    block_lens masking the block keys past each request's valid rows (rows >= block_lens are unspecified)."""
    n, b, nh, kvh, d, lens, cap = 3, 8, 8, 2, 32, [0, 13, 40], 48
    q, k, v = (torch.randn(n, b, h, d) for h in (nh, kvh, kvh))
    kc, vc = (torch.randn(n, cap, kvh, d) for _ in range(2))
    qw, kw = ((1 + 0.3 * torch.randn(d)) for _ in range(2))
    cl, block_lens = torch.tensor(lens), torch.tensor([8, 3, 1])
    kw_ = dict(inv_freq=_inv_freq(d), attention_scaling=1.1, causal=causal, block_lens=block_lens)
    ref64 = draft_attention_reference(q.double(), k.double(), v.double(), kc.double(), vc.double(), cl, qw.double(),
                                      kw.double(), **kw_)
    lowp = draft_attention_reference(q, k, v, kc, vc, cl, qw, kw, **kw_)
    kc0, vc0 = kc.clone(), vc.clone()
    out = draft_attention(q, k, v, kc, vc, cl, qw, kw, backend="cpu", **kw_)
    assert calls["attention"] == 1
    assert torch.equal(kc, kc0) and torch.equal(vc, vc0), "the draft's attention must not write its cache"
    valid = torch.arange(b)[None, :] < block_lens[:, None]
    assert_within_rule(out[valid], ref64[valid], lowp[valid], "native draft_attention")


def test_silu_mul_native(calls):
    from dflash_kernels import silu_mul
    from dflash_kernels.layer_ops import silu_mul_reference

    for shape, strided in (((8, 2 * 1536), False), ((3, 2, 2 * 40), False), ((5, 2 * 21), True)):
        gu = torch.randn(shape) * 6  # |g| up to ~25: both sides of the sigmoid, far tails included
        if strided:
            gu = torch.randn(shape[0], shape[1] + 6)[:, 3:shape[1] + 3] * 6
        out = silu_mul(gu, backend="cpu")
        assert out.is_contiguous() and out.shape == (*shape[:-1], shape[-1] // 2)
        assert_within_rule(out, silu_mul_reference(gu.double()), silu_mul_reference(gu), f"silu_mul {shape}")
        g, u = gu.double().chunk(2, -1)
        rel = ((out.double() - g * torch.sigmoid(g) * u).abs() / (g * torch.sigmoid(g) * u).abs().clamp_min(1e-30))
        assert rel.max() < 1e-5, "every element to relative accuracy (the far negative tail too)"
    assert calls["silu"] == 3


def test_cache_rows_outside_the_cache_never_reach_the_kernel(calls):
    """A cache row index past the cache is a ValueError of the op before any work; on the unchecked path
    (validate=False) it must still not become a pointer past the buffer: the native kernel is skipped and the
    torch formula raises its IndexError."""
    d = 16
    q, k, v = (torch.randn(2, 3, h, d) for h in (2, 1, 1))
    kc, vc = torch.zeros(2, 8, 1, d), torch.zeros(2, 8, 1, d)
    args = (q, k, v, kc, vc, torch.tensor([0, 1]))
    kw = dict(cache_batch_idx=torch.tensor([0, 2]), inv_freq=_inv_freq(d), backend="cpu")
    with pytest.raises(ValueError, match=r"cache_batch_idx values must be \[0, 2\)"):
        verify_attention(*args, **kw)
    assert not kc.any() and not vc.any()
    with pytest.raises(IndexError):
        verify_attention(*args, **kw, validate=False)
    assert calls["attention"] == 0


@pytest.mark.parametrize("kvh, d, new_rows, cached, rows, cap", [
    (3, 64, [8], [41], None, 64),                       # the SmolLM2 draft step: one request, a block of rows
    (3, 64, [8, 8, 8], [0, 17, 5], [2, 0, 3], 30),      # a batch on its own cache rows
    (2, 40, [5, 0, 17, 3], [0, 3, 1, 28], None, 30),    # an empty request, a head dim with a tail, rows past the cache
])
def test_inject_context_kv_native(calls, kvh, d, new_rows, cached, rows, cap):
    from dflash_kernels import inject_context_kv
    from dflash_kernels._dispatch import call_op
    from dflash_kernels.inject_context_kv import _inject_context_kv_op
    from dflash_kernels.inject_context_kv import inject_context_kv_reference

    m, q_cols = sum(new_rows), 7
    qkv = torch.randn(m, q_cols + 2 * kvh * d)  # k, v as column views of a merged projection, as the engine has them
    k = qkv[:, q_cols:q_cols + kvh * d].view(m, kvh, d)
    v = qkv[:, q_cols + kvh * d:].view(m, kvh, d)
    kw = 1 + 0.3 * torch.randn(d)
    cu = torch.tensor([0] + new_rows).cumsum(0)
    lens = torch.tensor(cached)
    idx = None if rows is None else torch.tensor(rows)
    n_cache = len(new_rows) if rows is None else max(rows) + 1
    rope = dict(inv_freq=_inv_freq(d), attention_scaling=0.9, eps=1e-6, cache_batch_idx=idx)

    def nan_caches(dt):
        kc = torch.full((n_cache, cap, kvh, d), float("nan"), dtype=dt)
        return kc, kc.clone()

    def reference(dt):
        kc, vc = nan_caches(dt)
        inject_context_kv_reference(k.to(dt), v.to(dt), kw.to(dt), cu, lens, kc, vc, **rope)
        return kc, vc

    kc, vc = nan_caches(torch.float32)
    inject_context_kv(k, v, kw, cu, lens, kc, vc, backend="cpu", **rope)
    assert calls["inject"] == 1
    (k64, v64), (klo, _) = reference(torch.float64), reference(torch.float32)
    written = ~torch.isnan(k64)
    assert written.sum() == sum(min(c, max(0, cap - p)) for c, p in zip(new_rows, cached)) * kvh * d
    assert torch.equal(~torch.isnan(kc), written) and torch.equal(~torch.isnan(vc), written), \
        "wrote outside the new rows (or past the capacity), or missed some"
    assert_within_rule(kc[written], k64[written], klo[written], "native inject_context_kv K")
    assert torch.equal(vc[written], v64[written].float()), "V rows are copied as they are"


def test_inject_context_kv_native_not_taken(calls):
    """Where the kernel does not apply (bf16 rows, a paged cache, offsets that are not a partition), the reference
    runs, so the same contract holds. Offsets past k's rows are the op's ValueError; on the unchecked body the
    kernel is skipped and the reference reads only k's rows: it writes those (as offsets ending at M would)
    and nothing past them."""
    from dflash_kernels import inject_context_kv
    from dflash_kernels._dispatch import call_op
    from dflash_kernels.inject_context_kv import _inject_context_kv_op

    d = 16
    k, v = torch.randn(4, 1, d), torch.randn(4, 1, d)
    kc, vc = torch.zeros(1, 8, 1, d, dtype=torch.bfloat16), torch.zeros(1, 8, 1, d, dtype=torch.bfloat16)
    inject_context_kv(k.bfloat16(), v.bfloat16(), torch.ones(d, dtype=torch.bfloat16), torch.tensor([0, 4]),
                      torch.tensor([2]), kc, vc, inv_freq=_inv_freq(d), backend="cpu")
    assert kc[0, 2:6].abs().sum() > 0 and calls["inject"] == 0
    kc, vc = torch.zeros(1, 8, 1, d), torch.zeros(1, 8, 1, d)
    args = (k, v, torch.ones(d), torch.tensor([0, 6]), torch.tensor([0]), kc, vc, _inv_freq(d), 1.0, 1e-6, None, None,
            None, "cpu")
    with pytest.raises(ValueError, match="cu_ctx_lens must start at 0, never decrease and end at most at M=4"):
        inject_context_kv(*args[:7], inv_freq=_inv_freq(d), backend="cpu")
    call_op(_inject_context_kv_op, *args, device=k.device, checked=True)
    want_k, want_v = torch.zeros(1, 8, 1, d), torch.zeros(1, 8, 1, d)
    inject_context_kv(*args[:3], torch.tensor([0, 4]), args[4], want_k, want_v, inv_freq=_inv_freq(d), backend="torch")
    assert calls["inject"] == 0 and torch.equal(kc, want_k) and torch.equal(vc, want_v) and not kc[0, 4:].any()


def _race(monkeypatch, kernel_name, lens, new_lens, rows, new_rows):
    """Make the native kernel ``kernel_name`` overwrite ``lens`` and ``rows`` with the new values just before it
    runs: another thread's write landing between the op's checks and the C code."""
    kernel = getattr(cpu_native._lib, kernel_name)

    def racing(*args):
        lens.copy_(torch.tensor(new_lens))
        rows.copy_(torch.tensor(new_rows))
        return kernel(*args)
    monkeypatch.setattr(cpu_native._lib, kernel_name, racing)


def test_attention_kernel_reads_the_values_that_were_checked(monkeypatch, calls):
    """Another thread writing cache_lens or cache_batch_idx between the op's checks and the kernel (simulated: the
    kernel's wrapper overwrites them first) changes nothing: the kernel reads private copies of the checked values,
    so the output and the caches are those of an undisturbed call."""
    d = 16
    q, k, v = (torch.randn(2, 4, h, d) for h in (2, 1, 1))
    kc, vc = torch.randn(3, 16, 1, d), torch.randn(3, 16, 1, d)
    args = dict(inv_freq=_inv_freq(d), backend="cpu")
    undisturbed = [kc.clone(), vc.clone()]
    expected = verify_attention(q, k, v, *undisturbed, torch.tensor([5, 9]), cache_batch_idx=torch.tensor([2, 0]),
                                **args)
    lens, rows = torch.tensor([5, 9], dtype=torch.int32), torch.tensor([2, 0])
    _race(monkeypatch, "dflash_cpu_block_attention_f32", lens, [0, 1], rows, [1, 1])
    kn, vn = kc.clone(), vc.clone()
    out = verify_attention(q, k, v, kn, vn, lens, cache_batch_idx=rows, **args)
    assert lens.tolist() == [0, 1], "the wrapper ran"
    assert torch.equal(out, expected) and torch.equal(kn, undisturbed[0]) and torch.equal(vn, undisturbed[1])


def test_inject_kernel_reads_the_values_that_were_checked(monkeypatch, calls):
    """inject_context_kv's kernel likewise reads copies of the checked lengths and rows."""
    from dflash_kernels import inject_context_kv

    d = 16
    k, v = torch.randn(6, 1, d), torch.randn(6, 1, d)
    kc, vc = torch.zeros(3, 12, 1, d), torch.zeros(3, 12, 1, d)
    args = (k, v, torch.ones(d), torch.tensor([0, 2, 6]))
    expected = [kc.clone(), vc.clone()]
    inject_context_kv(*args, torch.tensor([3, 1]), *expected, cache_batch_idx=torch.tensor([2, 0]),
                      inv_freq=_inv_freq(d), backend="cpu")
    lens, rows = torch.tensor([3, 1]), torch.tensor([2, 0], dtype=torch.int32)
    _race(monkeypatch, "dflash_cpu_inject_kv_f32", lens, [11, 0], rows, [1, 1])
    inject_context_kv(*args, lens, kc, vc, cache_batch_idx=rows, inv_freq=_inv_freq(d), backend="cpu")
    assert lens.tolist() == [11, 0], "the wrapper ran"
    assert torch.equal(kc, expected[0]) and torch.equal(vc, expected[1])


@pytest.mark.parametrize("op", [verify_attention, draft_attention])
def test_attention_scratch_too_large_is_a_memory_error(calls, op):
    """A block whose scratch cannot be allocated (300,000 rows: B x keys scores per thread) is a MemoryError, not
    an abort of the process from the C++ allocator."""
    b, d = 300_000, 16
    q, k, v = (torch.randn(1, b, 1, d) for _ in range(3))
    kc, vc = torch.zeros(1, b, 1, d), torch.zeros(1, b, 1, d)
    with pytest.raises(MemoryError, match="block_attention: not enough memory"):
        op(q, k, v, kc, vc, torch.tensor([0]), None, None, inv_freq=_inv_freq(d), backend="cpu")
    assert calls["attention"] == 1


_TINY = 'extern "C" int dflash_test_value() { return 7; }'


def test_build_library_refuses_a_cache_others_can_write(tmp_path, monkeypatch):
    """A cache folder writable by group or others, or owned by another user, is refused with an error naming
    DFLASH_CACHE and the fix, before anything is compiled or loaded."""
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path))
    for mode in (0o777, 0o775):
        tmp_path.chmod(mode)
        with pytest.raises(RuntimeError, match=r"DFLASH_CACHE.*writable by .*chmod go-w"):
            cpu_native.build_library("tiny", _TINY, cpu_native.FLAGS)
    tmp_path.chmod(0o700)
    sub = tmp_path / "tiny"
    sub.mkdir(mode=0o700)
    if os.getuid() == 0:  # only root can hand a folder to another user
        os.chown(sub, 12345, -1)
        with pytest.raises(RuntimeError, match=r"DFLASH_CACHE.*owned by uid 12345"):
            cpu_native.build_library("tiny", _TINY, cpu_native.FLAGS)
        os.chown(sub, 0, -1)
    assert cpu_native.build_library("tiny", _TINY, cpu_native.FLAGS).dflash_test_value() == 7


def test_build_library_never_loads_a_file_it_did_not_build(tmp_path, monkeypatch):
    """A library planted under the name of a build (no sidecar; a sidecar for it but the file writable by others;
    a sidecar whose digest is another file's) is not loaded: the builder rebuilds it. (Each case under its own
    name: the process never loaded that path before, so dlopen cannot answer from its cache.)"""
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path))
    lib = cpu_native.build_library("other", _TINY.replace("7", "666"), cpu_native.FLAGS)
    assert lib.dflash_test_value() == 666
    (other,) = (tmp_path / "other").glob("*.so")
    digest = cpu_native._digest(str(other))
    for case in ("no sidecar", "file writable by others", "digest of another file"):
        name = "tiny_" + case.replace(" ", "_")
        _, key, path = cpu_native.library_path(name, _TINY, cpu_native.FLAGS)
        cpu_native.private_dir(os.path.dirname(path))
        with open(path, "wb") as f:
            f.write(other.read_bytes())
        if case != "no sidecar":
            with open(f"{path}.sha256", "w") as f:
                f.write(f"{key} {digest if case == 'file writable by others' else '0' * 64}\n")
        os.chmod(path, 0o666 if case == "file writable by others" else 0o700)
        assert cpu_native.build_library(name, _TINY, cpu_native.FLAGS).dflash_test_value() == 7, case
