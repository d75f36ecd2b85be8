"""The native fp32 kernels behind backend="cpu" (dflash_kernels.cpu.native): they build on this machine, the ops
take them where they apply (and not where they do not), and their results hold the 2x rule against fp64 at the
shapes the runtime uses (one row, a verify block, a prefill chunk) and at odd ones (a head dim with a tail)."""
import os
import subprocess
import sys

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


class _Wrapped:
    """``torch.ops.dflash_cpu`` with some ops replaced by wrappers (as ``cpu_native._ops``: patching the torch.ops
    namespace itself would also route torch's own re-dispatch of a call, e.g. under a TorchFunctionMode, through
    the wrapper)."""

    def __init__(self, ops, wrappers):
        self._ops, self._wrappers = ops, wrappers

    def __getattr__(self, name):
        fn = getattr(self._ops, name)
        return self._wrappers[name](fn) if name in self._wrappers else fn


def _wrap_ops(monkeypatch, wrappers) -> None:
    """Replace the native ops named in ``wrappers`` (name -> fn -> wrapped fn) for the test (the kernels loaded)."""
    assert cpu_native.unavailable_reason() is None, "the native CPU kernels must be built here (make install)"
    monkeypatch.setattr(cpu_native, "_ops", _Wrapped(cpu_native._ops, wrappers))


@pytest.fixture
def calls(monkeypatch):
    """Count the native ops' calls."""
    seen = {"norm": 0, "attention": 0, "silu": 0, "inject": 0}

    def counter(key):
        def wrap(fn):
            def counted(*args):
                seen[key] += 1
                return fn(*args)
            return counted
        return wrap
    _wrap_ops(monkeypatch, {name: counter(key) for key, name in (
        ("norm", "add_rms_norm"), ("attention", "block_attention"), ("silu", "silu_mul"),
        ("inject", "inject_context_kv"))})
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
    def wrap(kernel):
        def racing(*args):
            lens.copy_(torch.tensor(new_lens))
            rows.copy_(torch.tensor(new_rows))
            return kernel(*args)
        return racing
    _wrap_ops(monkeypatch, {kernel_name: wrap})


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
    _race(monkeypatch, "block_attention", lens, [0, 1], rows, [1, 1])
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
    _race(monkeypatch, "inject_context_kv", lens, [11, 0], rows, [1, 1])
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


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        return set(next((line for line in f if line.startswith("flags")), "").split())


def test_isas_follow_the_cpu():
    """The instruction sets the kernels are chosen from at load are the CPU's: AVX-512 (F, BW, DQ, VL) + FMA, AVX2 +
    FMA and AMX-TILE + AMX-BF16 exactly where /proc/cpuinfo lists them, widest first."""
    if os.environ.get("DFLASH_CPU_ISA"):
        pytest.skip("DFLASH_CPU_ISA caps the list")
    flags = _cpu_flags()
    want = [isa for isa, needs in (("amx", {"amx_tile", "amx_bf16", "avx512f", "avx512bw", "avx512dq", "avx512vl"}),
                                   ("avx512", {"avx512f", "avx512bw", "avx512dq", "avx512vl", "fma"}),
                                   ("avx2", {"avx2", "fma"}))
            if needs <= flags]
    assert list(cpu_native.isas()) == want


def test_avx2_build_of_the_vector_kernels():
    """DFLASH_CPU_ISA=avx2 (as on a CPU without AVX-512): isas() is capped to AVX2 and this file's op tests pass on
    the AVX2 build of the norm, silu and attention kernels (in a subprocess: the choice is made once, at load)."""
    if "avx2" not in cpu_native.isas() or os.environ.get("DFLASH_CPU_ISA"):
        pytest.skip("needs AVX2 + FMA, uncapped")
    env = {**os.environ, "DFLASH_CPU_ISA": "avx2"}
    check = ("from dflash_kernels.cpu import linear, native; "
             "assert native.isas() == ('avx2',) and linear.isa() == 'avx2', (native.isas(), linear.isa())")
    done = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                           "not avx2_build and not isas_follow"], env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0 and " passed" in done.stdout, done.stdout[-3000:]


def test_native_sources_only_on_x86(monkeypatch):
    """The extension compiles the native kernels (every csrc/cpu/*.cpp: x86 pragmas and intrinsics) on x86-64 only;
    elsewhere it builds without them and the "cpu" backend keeps its torch formulas."""
    import platform

    from dflash_kernels import _ext

    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    assert {"csrc/torch/ops.cpp", "csrc/cpu/bindings.cpp", "csrc/cpu/isa_avx512.cpp"} <= set(_ext.sources(False))
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    assert _ext.sources(False) == ["csrc/torch/ops.cpp"]


def test_bad_isa_cap_is_the_reason(tmp_path):
    """DFLASH_CPU_ISA naming no instruction set: the kernels are unavailable with the reason, nothing crashes."""
    check = ("import warnings; warnings.simplefilter('ignore'); from dflash_kernels.cpu import native; "
             "print(native.unavailable_reason())")
    done = subprocess.run([sys.executable, "-c", check], env={**os.environ, "DFLASH_CPU_ISA": "sse9"},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "DFLASH_CPU_ISA=sse9 is not one of amx, avx512, avx2" in done.stdout, done


@pytest.mark.parametrize("isa", ["avx512", "avx2"])
def test_every_isa_build_holds_the_rule(isa):
    """Each instruction set's build of the vector kernels (the table the CPU would choose) computes the ops: the
    fp32 linear of that build against fp64 by the 2x rule (the norm and attention of the widest are covered
    above)."""
    if isa not in cpu_native.isas():
        pytest.skip(f"this CPU lacks {isa}")
    from dflash_kernels.cpu import linear as cpu_linear

    kernel, got = cpu_linear._build(isa)
    assert got == isa
    for k, n, rows in ((576, 960, 8), (17, 33, 3), (1, 1, 2)):
        x, w, b = torch.randn(rows, k), torch.randn(n, k), torch.randn(n)
        out = torch.full((rows, n), float("nan"))
        kernel(x, [w], [b], out)
        assert_within_rule(out, torch.nn.functional.linear(x.double(), w.double(), b.double()),
                           torch.nn.functional.linear(x, w, b), f"{isa} K={k} N={n}")


def test_without_the_extension_the_torch_formulas_run(monkeypatch):
    """No compiled extension (DFLASH_BUILD_EXT=0, a failed build): the kernels are off with the reason and one
    warning, and the "cpu" ops run their torch formulas (bit-equal to the references)."""
    from dflash_kernels import _ext

    monkeypatch.setattr(_ext, "load", lambda *a, **k: (False, "dflash_kernels._C is not built (test)"))
    for name, value in (("_ops", None), ("_isas", ()), ("_reason", None), ("_tried", False)):
        monkeypatch.setattr(cpu_native, name, value)
    with pytest.warns(RuntimeWarning, match=r"unavailable \(dflash_kernels._C is not built \(test\)\)"):
        assert not cpu_native.enabled()
    assert "torch formulas" in cpu_native.unavailable_reason() and cpu_native.library() is None
    x, w = torch.randn(5, 40), 1 + 0.5 * torch.randn(40)
    assert torch.equal(add_rms_norm(x, w, 1e-5, backend="cpu"), add_rms_norm_reference(x, w, 1e-5))
