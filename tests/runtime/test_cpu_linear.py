"""dflash_kernels.cpu.linear.linear: F.linear's result (the 2x error rule vs fp64) on the fast path, F.linear elsewhere."""
from __future__ import annotations

import functools
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dflash_kernels.cpu import linear as cpu_linear
from dflash_kernels.cpu import native as cpu_native
from helpers.tol import assert_within_rule

FAST = cpu_linear.available()
needs_fast = pytest.mark.skipif(not FAST, reason=f"{cpu_linear.unavailable_reason()}")

# SmolLM2-135M's projections (K -> N): merged QKV, o_proj, merged gate/up, down, LM head, a draft-vocab head.
SHAPES = {"qkv": (576, 960), "o_proj": (576, 576), "gate_up": (576, 3072), "down": (1536, 576),
          "lm_head": (576, 49152), "draft_head": (576, 10000)}


@functools.lru_cache(maxsize=1)
def _weight(k: int, n: int) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(k * n)) * k**-0.5


def _check(x, w, b=None, what=""):
    out = cpu_linear.linear(x, w, b)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert_within_rule(out, ref, F.linear(x, w, b), what)
    return out


@pytest.fixture
def fast_calls(monkeypatch):
    """How many calls reached the compiled kernel."""
    calls = []
    monkeypatch.setattr(cpu_linear, "_kernel", _spy(cpu_linear._kernel, calls))
    return calls


def _spy(kernel, calls: list):
    """``kernel`` (an op taking x first) recording the rows of x of each call in ``calls``."""
    def call(x, *args):
        calls.append(x.numel() // x.shape[-1])
        return kernel(x, *args)
    return call


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 16])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_smollm2_shapes(shape, rows):
    k, n = SHAPES[shape]
    w = _weight(k, n)
    bias = torch.randn(n) if rows % 2 else None
    _check(torch.randn(rows, k), w, bias, f"{shape} rows={rows}")


@pytest.mark.parametrize("k,n", [(1, 1), (5, 3), (15, 17), (17, 33), (100, 7), (577, 61)])
# Rows 5-7 and 9: a full pass of the AVX-512 tile's 4 x rows and a partial one; 9: the AVX2 tile's 8 and then 1.
@pytest.mark.parametrize("rows", [2, 3, 5, 6, 7, 9, 16])
def test_ugly_shapes(k, n, rows):
    for bias in (None, torch.randn(n)):
        _check(torch.randn(rows, k), torch.randn(n, k), bias, f"K={k} N={n} rows={rows}")


@needs_fast
def test_strided_inputs_and_leading_dims(fast_calls):
    k, n = 70, 45
    big = torch.randn(n, k + 9)
    w = big[:, 3:3 + k]  # row stride k + 9: a slice of a merged buffer
    x = torch.randn(k, 8).t()  # [8, k], last dim not contiguous
    _check(x, w, torch.randn(n), "strided")
    out = _check(torch.randn(2, 3, k), w, None, "leading dims")
    assert out.shape == (2, 3, n)
    assert fast_calls == [8, 6]


@needs_fast
def test_two_threads():
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for k, n in [(576, 960), (33, 35), (1536, 3)]:
            _check(torch.randn(8, k), torch.randn(n, k), torch.randn(n), f"2 threads K={k} N={n}")
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("shape", [(0, 16), (0, 3, 16), (4, 0)])
def test_empty(shape):
    x = torch.randn(shape)
    w, b = torch.randn(5, shape[-1]), torch.randn(5)
    torch.testing.assert_close(cpu_linear.linear(x, w, b), F.linear(x, w, b))


@needs_fast
def test_fast_path_taken_where_it_should(fast_calls):
    k, n = 64, 48
    w, b = torch.randn(n, k), torch.randn(n)
    for rows in (cpu_linear.MIN_ROWS, 8, cpu_linear.MAX_ROWS):
        cpu_linear.linear(torch.randn(rows, k), w, b)
    with torch.no_grad():  # parameters under no_grad: the inference case
        cpu_linear.linear(torch.randn(8, k), torch.nn.Parameter(w), b)
    assert fast_calls == [cpu_linear.MIN_ROWS, 8, cpu_linear.MAX_ROWS, 8]


@needs_fast
def test_fallbacks(fast_calls):
    k, n = 64, 48
    w, x = torch.randn(n, k), torch.randn(8, k)
    _check(torch.randn(1, k), w, what="one row")
    _check(torch.randn(cpu_linear.MAX_ROWS + 1, k), w, what="many rows")
    _check(x, torch.randn(k, n).t(), what="transposed weight")
    for dtype in (torch.float64, torch.bfloat16):
        torch.testing.assert_close(cpu_linear.linear(x.to(dtype), w.to(dtype)), F.linear(x.to(dtype), w.to(dtype)))
    assert cpu_linear.linear(x.to("meta"), w.to("meta")).shape == (8, n)
    wg = w.clone().requires_grad_()
    out = cpu_linear.linear(x, wg)
    assert out.grad_fn is not None
    out.sum().backward()
    torch.testing.assert_close(wg.grad, x.sum(0).expand(n, k))
    assert fast_calls == []


# A layer's q/k/v (SmolLM2: 576 + 192 + 192 rows) and gate/up blocks, and ugly ones: block sizes that do not fill
# the AVX-512 tile's 4 weight rows, a one-row block.
BLOCKS = {"qkv": (576, (576, 192, 192)), "gate_up": (576, (1536, 1536)), "ugly3": (37, (5, 1, 7)),
          "ugly2": (100, (3, 9))}


@pytest.mark.parametrize("rows", [1, 2, 5, 8, 16, cpu_linear.MAX_ROWS + 1])
@pytest.mark.parametrize("name", list(BLOCKS))
def test_row_blocks_are_the_stacked_weight(name, rows, seed):
    """RowBlocks: F.linear of the blocks' concatenation (2x rule vs fp64), on the kernel and on the fallback."""
    k, sizes = BLOCKS[name]
    g = torch.Generator().manual_seed(seed)
    ws = [torch.randn(n, k, generator=g) * k**-0.5 for n in sizes]
    bs = [torch.randn(n, generator=g) for n in sizes]
    x = torch.randn(rows, k, generator=g)
    for bias in (None, bs):
        _check_blocks(x, ws, bias, f"{name} rows={rows}")


def _check_blocks(x, ws, bias, what):
    out = cpu_linear.linear(x, cpu_linear.RowBlocks(ws, bias))
    cat_b = None if bias is None else torch.cat(bias)
    ref = F.linear(x.double(), torch.cat(ws).double(), None if cat_b is None else cat_b.double())
    assert_within_rule(out, ref, F.linear(x, torch.cat(ws), cat_b), what)


@needs_fast
def test_row_blocks_take_the_kernel_from_one_row(fast_calls):
    k = 64
    blocks = cpu_linear.RowBlocks([torch.randn(8, k), torch.randn(4, k), torch.randn(4, k)])
    for rows in (1, 8, cpu_linear.MAX_ROWS, cpu_linear.MAX_ROWS + 1):
        cpu_linear.linear(torch.randn(rows, k), blocks)
    cpu_linear.linear(torch.randn(1, k), blocks.weights[0])  # one plain weight at one row: F.linear's GEMV
    w = torch.randn(8, k)
    seen = cpu_linear.RowBlocks([w])
    w.mul_(2)  # an in-place update is seen
    torch.testing.assert_close(cpu_linear.linear(torch.ones(3, k), seen), w.sum(1)[None].expand(3, 8))
    assert fast_calls == [1, 8, cpu_linear.MAX_ROWS, 3]


@needs_fast
def test_row_blocks_follow_or_refuse_a_block_resized_in_place(fast_calls):
    """A block whose storage an in-place resize_ reallocated (the recorded pointer freed) is never read at the old
    address: resized to another shape it is a ValueError naming the block; back at its shape (in the new storage)
    the kernel reads the new storage, exactly as a RowBlocks built afresh."""
    k = 64
    ws = [torch.randn(8, k), torch.randn(4, k)]
    biases = [torch.randn(8), torch.randn(4)]
    blocks = cpu_linear.RowBlocks(ws, biases)
    x = torch.randn(3, k)
    cpu_linear.linear(x, blocks)
    old = ws[0].data_ptr()
    ws[0].resize_(2048, 2048)
    assert ws[0].data_ptr() != old, "the resize reallocated"
    with pytest.raises(ValueError, match=r"weights\[0\] changed in place from shape \(8, 64\)"):
        cpu_linear.linear(x, blocks)
    ws[0].resize_(8, k)
    biases[1].resize_(4000)
    with pytest.raises(ValueError, match=r"biases\[1\] changed in place"):
        cpu_linear.linear(x, blocks)
    biases[1].resize_(4)
    assert torch.equal(cpu_linear.linear(x, blocks), cpu_linear.linear(x, cpu_linear.RowBlocks(ws, biases)))
    assert blocks.args[0][0].data_ptr() == ws[0].data_ptr() and fast_calls == [3, 3, 3]


def test_row_blocks_bad_input():
    k = 16
    ws = [torch.randn(4, k) for _ in range(4)]
    with pytest.raises(ValueError, match="1 to 3 row blocks"):
        cpu_linear.RowBlocks(ws)
    with pytest.raises(ValueError, match=r"weights\[1\] is \(4, 15\)"):
        cpu_linear.RowBlocks([ws[0], torch.randn(4, 15)])
    with pytest.raises(ValueError, match="one \\[N_i\\] per block"):
        cpu_linear.RowBlocks(ws[:2], [torch.randn(4)])
    with pytest.raises(ValueError, match="in the weights' dtype and device"):
        cpu_linear.RowBlocks(ws[:2], [torch.randn(4), torch.randn(4, dtype=torch.float64)])
    with pytest.raises(ValueError, match="bias must be None with RowBlocks"):
        cpu_linear.linear(torch.randn(2, k), cpu_linear.RowBlocks(ws[:2]), torch.randn(8))


def test_weight_updated_in_place():
    k, n = 96, 40
    w, x = torch.randn(n, k), torch.randn(8, k)
    _check(x, w)
    w.mul_(-3).add_(1)
    _check(x, w, what="after an in-place update")
    with torch.no_grad():
        lin = torch.nn.Linear(k, n)
        lin.weight.copy_(torch.randn(n, k))
        _check(x, lin.weight, lin.bias, "Linear after copy_")


def test_unavailable_kernel_falls_back(monkeypatch):
    """Without the compiled kernels (no extension, or a CPU without AVX-512 / AVX2 + FMA: isas() empty) linear is
    F.linear, with one warning saying why."""
    monkeypatch.setattr(cpu_linear, "_kernel", None)
    monkeypatch.setattr(cpu_linear, "_tried", False)
    monkeypatch.setattr(cpu_linear, "_reason", None)
    monkeypatch.setattr(cpu_native, "isas", lambda: ())
    with pytest.warns(RuntimeWarning, match="unavailable"):
        assert not cpu_linear.available()
    assert "F.linear" in cpu_linear.unavailable_reason()
    x, w = torch.randn(8, 32), torch.randn(16, 32)
    torch.testing.assert_close(cpu_linear.linear(x, w), F.linear(x, w))


@pytest.mark.skipif(not FAST or "avx2" not in cpu_native.isas(), reason="needs the kernel and AVX2 + FMA")
def test_avx2_build(monkeypatch, seed):
    """The AVX2 + FMA build (CPUs without AVX-512, e.g. AMD Zen 3) on this CPU: same rule, every runtime shape."""
    monkeypatch.setattr(cpu_linear, "_kernel", None)
    monkeypatch.setattr(cpu_linear, "_tried", False)
    monkeypatch.setattr(cpu_linear, "_isa", None)
    monkeypatch.setenv(cpu_linear.ISA_ENV, "avx2")
    assert cpu_linear.isa() == "avx2"
    for name, (k, n) in SHAPES.items():
        for rows in (2, 7, 8, 16):
            _check(torch.randn(rows, k), _weight(k, n), torch.randn(n) if rows % 2 else None, f"avx2 {name} {rows}")
    for name in BLOCKS:
        for rows in (1, 9):
            test_row_blocks_are_the_stacked_weight(name, rows, seed)
    for k, n in [(1, 1), (5, 3), (17, 33), (577, 61)]:
        _check(torch.randn(9, k), torch.randn(n, k), torch.randn(n), f"avx2 K={k} N={n}")


def test_bad_isa_request(monkeypatch):
    monkeypatch.setenv(cpu_linear.ISA_ENV, "sse2")
    with pytest.raises(RuntimeError, match="not one of"):
        cpu_linear._pick_isa(["avx512", "avx2"])
    monkeypatch.setenv(cpu_linear.ISA_ENV, "avx512")
    with pytest.raises(RuntimeError, match="lacks"):
        cpu_linear._pick_isa(["avx2"])
    monkeypatch.delenv(cpu_linear.ISA_ENV)
    assert cpu_linear._pick_isa(["avx512", "avx2", "amx"]) == "avx512"
    assert cpu_linear._pick_isa(["avx2"]) == "avx2"
    with pytest.raises(RuntimeError, match="neither"):
        cpu_linear._pick_isa([])


@needs_fast
def test_dispatch_mode_takes_f_linear(fast_calls):
    """Under a TorchDispatchMode (the graph emulator records dispatched ops) the opaque kernel call is not made."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    x, w = torch.randn(8, 64), torch.randn(48, 64)
    with Seen():
        out = cpu_linear.linear(x, w)
    torch.testing.assert_close(out, F.linear(x, w))
    assert fast_calls == []


# ------------------------------------------------------------------------------------------------ the AMX path
AMX = cpu_linear.amx_active()
needs_amx = pytest.mark.skipif(not AMX, reason=f"{cpu_linear.amx_unavailable_reason()}")


def _bf16_values(t: torch.Tensor) -> torch.Tensor:
    return t.bfloat16().float()


@functools.lru_cache(maxsize=1)
def _bf16_weight(k: int, n: int) -> torch.Tensor:
    return _bf16_values(_weight(k, n))


@pytest.fixture
def amx_calls(monkeypatch):
    """The rows of each call that reached the AMX kernel, and of each that reached the fp32 kernel; the bf16-packed
    copies off, so that one row takes the AMX kernel too (test_amx_one_row_route: with them on)."""
    calls = {"amx": [], "fp32": []}
    monkeypatch.setattr(cpu_linear, "_bf16_on", False)
    amx = cpu_linear._amx

    class Counted:  # torch.ops.dflash_cpu with amx_linear counted
        def __getattr__(self, name):
            return _spy(amx.amx_linear, calls["amx"]) if name == "amx_linear" else getattr(amx, name)
    monkeypatch.setattr(cpu_linear, "_amx", Counted())
    monkeypatch.setattr(cpu_linear, "_kernel", _spy(cpu_linear._kernel, calls["fp32"]))
    return calls


@needs_amx
def test_amx_takes_every_row_count(amx_calls, seed):
    """With the bf16-packed copies on, every row count takes the AMX tiles (one row too, two column groups a step up
    to five rows), never the packed copy, and linear_argmax screens with AMX at each of them."""
    g = torch.Generator().manual_seed(seed)
    k, n = 96, 4099  # 257 column groups: the last of a pair alone
    w = _bf16_values(torch.randn(n, k, generator=g) * k**-0.5)
    cpu_linear.set_bf16(True)  # (the fixture's monkeypatch restores it)
    calls = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu_linear, "_amx_argmax", _spy(cpu_linear._amx_argmax, calls))
        mp.setattr(cpu_linear, "bf16_rows", lambda w: pytest.fail("a bf16-packed copy was made"))
        for rows in (1, 5, 6, 8):
            x = torch.randn(rows, k, generator=g)
            got = _check(x, w, what=f"rows={rows}")
            assert torch.equal(cpu_linear.linear_argmax(x, w), got.argmax(-1))
    assert amx_calls["amx"] == [1, 5, 6, 8]
    assert calls == [1, 5, 6, 8]


@needs_amx
def test_amx_split_is_exact(seed):
    """x times a power-of-two identity: one exact product per output, so the output is x itself, bit for bit, only
    if hi + mid + lo == x (a two-part split, or a lost remainder, fails this). Values over the whole exponent range,
    24-bit significands, both signs."""
    g = torch.Generator().manual_seed(seed)
    k = 96
    x = torch.randn(9, k, generator=g) * torch.exp2(torch.randint(-60, 60, (9, k), generator=g).float())
    x[0, :4] = torch.tensor([1 + 2.0**-23, -(1 - 2.0**-24), 3.0e-30, -7.5e30])
    for scale in (1.0, 0.5, 4.0):
        out = cpu_linear.linear(x, torch.eye(k) * scale)
        assert torch.equal(out, x * scale), (scale, (out - x * scale).abs().max())


@needs_amx
@pytest.mark.parametrize("rows", [1, 2, 7, 8, 16, 17, 40])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_amx_smollm2_shapes(shape, rows, amx_calls):
    k, n = SHAPES[shape]
    bias = torch.randn(n) if rows % 2 else None
    _check(torch.randn(rows, k), _bf16_weight(k, n), bias, f"amx {shape} rows={rows}")
    assert amx_calls == {"amx": [rows], "fp32": []}


@needs_amx
@pytest.mark.parametrize("k,n", [(1, 1), (5, 3), (15, 17), (17, 33), (100, 7), (577, 61), (1536, 576)])
@pytest.mark.parametrize("rows", [1, 3, 5, 6, 10, 16, 33])
def test_amx_ugly_shapes(k, n, rows, amx_calls):
    """Columns that leave a tile part empty, depths that are not a multiple of 32, odd column group counts (up to
    five rows two groups share a step), rows over a 16-row tile."""
    w = _bf16_values(torch.randn(n, k))
    for bias in (None, torch.randn(n)):
        _check(torch.randn(rows, k), w, bias, f"amx K={k} N={n} rows={rows}")
    assert amx_calls["amx"] == [rows, rows] and not amx_calls["fp32"]


@needs_amx
def test_amx_only_for_bf16_values(amx_calls):
    """A weight with a value that is not a bf16 value takes the fp32 kernel; set_amx(False) leaves AMX alone (the
    bf16-packed rows then, or with set_bf16(False) the fp32 kernel)."""
    k, n = 64, 48
    w = _bf16_values(torch.randn(n, k))
    x = torch.randn(8, k)
    _check(x, w)
    near = w.clone()
    near[5, 7] = torch.nextafter(near[5, 7], torch.tensor(9.0))
    _check(x, near, what="one value off the bf16 grid")
    before, bf16_before = cpu_linear.set_amx(False), cpu_linear.set_bf16(True)
    try:
        assert cpu_linear.route((w,), (w,), 8, cpu_linear.MIN_ROWS)[0] == cpu_linear.isa() + "_bf16"
        _check(x, w, what="amx off, bf16-packed rows")
        cpu_linear.set_bf16(False)
        _check(x, w, what="amx and bf16 rows off")
    finally:
        assert cpu_linear.set_bf16(bf16_before) is False
        assert cpu_linear.set_amx(before) is False
    assert amx_calls == {"amx": [8], "fp32": [8, 8]}


def _check_in_place_updates():
    """Seven calls of 4 rows on bf16-exact weights, updated in place or fresh between them (a stale packed copy
    gives the old weight's product and fails the rule), then one on a weight moved off the bf16 grid."""
    k, n = 64, 40
    w, x = _bf16_values(torch.randn(n, k)), torch.randn(4, k)
    _check(x, w)
    w.mul_(-2)
    _check(x, w, what="after mul_")
    with torch.no_grad():
        lin = torch.nn.Linear(k, n, bias=False)
        lin.weight.copy_(_bf16_values(torch.randn(n, k)))
        _check(x, lin.weight, what="Linear after copy_")
        lin.weight.copy_(_bf16_values(torch.randn(n, k)))
        _check(x, lin.weight, what="Linear after a second copy_")
    w.add_(1e-3)
    _check(x, w, what="off the bf16 grid")
    for _ in range(3):  # fresh tensors (ids may repeat once the last one is freed)
        _check(x, _bf16_values(torch.randn(n, k)), what="fresh weight")


@needs_amx
def test_amx_sees_in_place_updates(amx_calls):
    """The packed copy follows the tensor's version: updates in place repack (and one that leaves the bf16 grid
    goes to the fp32 kernel); a new tensor at a reused id is not mistaken for the old one."""
    _check_in_place_updates()
    assert amx_calls == {"amx": [4] * 7, "fp32": [4]}


@needs_amx
@pytest.mark.parametrize("name", list(BLOCKS))
def test_amx_row_blocks(name, amx_calls, seed):
    k, sizes = BLOCKS[name]
    g = torch.Generator().manual_seed(seed)
    ws = [_bf16_values(torch.randn(n, k, generator=g) * k**-0.5) for n in sizes]
    bs = [torch.randn(n, generator=g) for n in sizes]
    for rows in (1, 8, 20):
        x = torch.randn(rows, k, generator=g)
        for bias in (None, bs):
            _check_blocks(x, ws, bias, f"amx {name} rows={rows}")
    mixed = cpu_linear.RowBlocks([ws[0], torch.randn(3, k)])  # one block off the bf16 grid: the fp32 kernel
    cpu_linear.linear(torch.randn(8, k), mixed)
    assert amx_calls == {"amx": [1, 1, 8, 8, 20, 20], "fp32": [8]}


@needs_amx
def test_amx_non_finite_inputs():
    """inf and NaN in x: the rows they reach equal F.linear's (inf, -inf or NaN), the other rows stay finite."""
    k, n = 40, 24
    w = _bf16_values(torch.randn(n, k))
    w[3, 5] = 0.0  # inf * 0 = NaN in that column, as in F.linear
    x = torch.randn(4, k)
    x[1, 5], x[2, 9] = float("inf"), float("nan")
    out, ref = cpu_linear.linear(x, w), F.linear(x, w)
    torch.testing.assert_close(out[1:3], ref[1:3], equal_nan=True)
    assert torch.isfinite(out[[0, 3]]).all()
    assert_within_rule(out[[0, 3]], F.linear(x[[0, 3]].double(), w.double()), ref[[0, 3]], "finite rows")
    x[1:3] = torch.randn(2, k)
    x.view(torch.int32)[2, 11] = 0x7F800001  # a NaN whose top 16 bits alone would read as inf
    out = cpu_linear.linear(x, w)
    assert out[2].isnan().all() and torch.isfinite(out[[0, 1, 3]]).all()


@needs_amx
def test_amx_dispatch_mode_and_autograd_take_f_linear(amx_calls):
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    x, w = torch.randn(8, 64), _bf16_values(torch.randn(48, 64))
    with Seen():
        torch.testing.assert_close(cpu_linear.linear(x, w), F.linear(x, w))
    out = cpu_linear.linear(x, w.clone().requires_grad_())
    assert out.grad_fn is not None
    assert amx_calls == {"amx": [], "fp32": []}


# ------------------------------------------------------------------------------------------ linear_argmax's screen
@pytest.fixture(params=["int8", "hi"])
def amx_screen(request, monkeypatch):
    """Each screen of amx_argmax: the AMX-INT8 one (int8 codes of the weight; without a bias, where the CPU has
    AMX-INT8) and the hi parts' (set_int8_screen off)."""
    if request.param == "int8" and not (AMX and torch.ops.dflash_cpu.amx_int8()):
        pytest.skip("the CPU lacks AMX-INT8")
    monkeypatch.setattr(cpu_linear, "_int8_on", request.param == "int8")
    return request.param


def _argmax_exact_pairs(x, w, b=None):
    """linear_argmax's AMX entry: (ids, (row, 16-column group) pairs computed exactly)."""
    return cpu_linear._amx_argmax(x.contiguous(), w, cpu_linear.bf16_tiles(w), b)


@needs_amx
@pytest.mark.parametrize("k,n", [(576, 49152), (7, 1), (33, 17), (64, 4099), (100, 300)])
@pytest.mark.parametrize("rows", [1, 3, 8, 17, 24, 40])
def test_argmax_is_the_linears_argmax(k, n, rows, amx_screen):
    """The same indices as linear(x, w, b).argmax(-1), bias or not, while most groups are only screened."""
    w = _bf16_weight(k, n) if (k, n) == (576, 49152) else _bf16_values(torch.randn(n, k))
    b = _bf16_values(torch.randn(n)) if rows % 2 else None
    x = torch.randn(rows, k) * 3
    want = cpu_linear.linear(x, w, b).argmax(-1)
    got = cpu_linear.linear_argmax(x, w, b)
    assert got.dtype == torch.int64 and torch.equal(got, want)
    _, exact = _argmax_exact_pairs(x, w, b)
    groups = -(-n // 16)
    assert rows <= exact <= rows * groups
    if groups >= 64:  # (hi parts: up to 7 a row in 400 random draws at the LM head's shape; int8: ~10x that)
        assert exact <= (16 if amx_screen == "hi" else 160) * rows, "the screen decided almost nothing"


@needs_amx
def test_argmax_decided_below_the_hi_parts(amx_screen):
    """Row 0: column 0 = x0 + x2 = 1 + 2^-9 (all in the hi parts), column 17 = x1 = 1 + 2^-8 - 2^-20 (hi part 1.0):
    the hi parts alone rank column 0 first (the wrong rule, which a screen without its bound would follow: the
    columns sit in different 16-column groups), the linear column 17. Row 1: column 0 wins and ties column 33, a
    copy of it: the first index."""
    w = torch.zeros(40, 32)
    w[0, 0] = w[0, 2] = w[17, 1] = 1.0
    w[33] = w[0]
    x = torch.zeros(2, 32)
    x[0, 0], x[0, 1], x[0, 2] = 1.0, 1 + 2.0**-8 - 2.0**-20, 2.0**-9
    x[1, 0], x[1, 1], x[1, 2] = 1 + 2.0**-8 - 2.0**-20, 1.0, 2.0**-9
    hi = (x.view(torch.int32) & -65536).view(torch.float32)
    assert torch.equal(F.linear(hi, w).argmax(-1), torch.tensor([0, 0]))  # the wrong rule
    assert torch.equal(cpu_linear.linear(x, w).argmax(-1), torch.tensor([17, 0]))
    assert torch.equal(cpu_linear.linear_argmax(x, w), torch.tensor([17, 0]))


@needs_amx
def test_argmax_many_near_ties(seed, amx_screen):
    """300 columns one bf16 ulp apart in one element (logits within ~1e-3 of each other) and exact duplicates: many
    groups reach the exact pass, the result is still the linear's argmax."""
    g = torch.Generator().manual_seed(seed)
    base = _bf16_values(torch.randn(96, generator=g))
    w = base.repeat(300, 1)
    idx = torch.randint(0, 96, (300,), generator=g)
    w[torch.arange(300), idx] = _bf16_values(w[torch.arange(300), idx] * (1 + 2.0**-7))
    w[150:160] = w[140]
    for rows in (12, 7):  # (7: the packed rows of the AMX path)
        x = torch.randn(rows, 96, generator=g)
        assert torch.equal(cpu_linear.linear_argmax(x, w), cpu_linear.linear(x, w).argmax(-1))
        _, exact = _argmax_exact_pairs(x, w)
        assert exact > rows


@needs_amx
@pytest.mark.parametrize("rows", [1, 12])
def test_argmax_sums_in_the_linears_order(rows, seed, monkeypatch):
    """The exact pass adds a value's three part sums in linear's order, (hi + mid) + lo: a column whose value is the
    other order's, hi + (mid + lo), 1 ulp off, sits first; the argmax must still be the linear's (1: packed rows,
    12: a row chunk; the bf16-packed copies off, so that one row is AMX's too)."""
    monkeypatch.setattr(cpu_linear, "_bf16_on", False)
    def parts(v: float):
        u = np.float32(v).view(np.uint32)
        hi = (u & np.uint32(0xFFFF0000)).view(np.float32)
        r = np.float32(v) - hi
        mid = (r.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
        return hi, mid, np.float32(r - mid)

    c = np.float32(1 + 2.0**-7)  # 8 significant bits: each part's product with it is exact in fp32
    rng = np.random.default_rng(seed)
    for _ in range(1000):  # an input whose two orders round apart
        x0 = np.float32(rng.uniform(1, 2))
        hi, mid, lo = (c * p for p in parts(x0))
        ours, other = (hi + mid) + lo, hi + (mid + lo)
        if ours != other:
            break
    assert ours != other
    w = torch.zeros(2, 1)
    w[1, 0] = float(c)
    b = torch.tensor([float(min(ours, other)), 0.0])  # column 0: the smaller of the two orders' values, exactly
    x = torch.full((rows, 1), float(x0))
    out = cpu_linear.linear(x, w, b)
    assert out[:, 1].eq(float(ours)).all()
    want = torch.full((rows,), 1 if ours > other else 0)  # the tie goes to column 0
    assert torch.equal(out.argmax(-1), want)
    assert torch.equal(cpu_linear.linear_argmax(x, w, b), want)


@pytest.mark.parametrize("screen", ["amx hi", "amx int8", "int8"])
def test_argmax_non_finite_and_huge_rows(screen, monkeypatch):
    """NaN, inf and overflowing rows: torch.argmax's rule on the linear's values (the first NaN, the first inf),
    with each AMX screen and with the int8 one of the bf16-packed route (the AMX path off); a weight holding inf
    gets no int8 screen (the AMX route then takes the hi parts)."""
    runs = {"amx hi": AMX, "amx int8": AMX and torch.ops.dflash_cpu.amx_int8(), "int8": FAST}[screen]
    if not runs:
        pytest.skip(f"the {screen} screen does not run here")
    monkeypatch.setattr(cpu_linear, "_int8_on", screen != "amx hi")
    if screen == "int8":
        monkeypatch.setattr(cpu_linear, "_amx_on", False)
    k, n = 40, 70
    w = _bf16_values(torch.randn(n, k))
    w[3, 5] = 0.0
    x = torch.randn(5, k)
    x[1, 5] = float("inf")   # column 3: inf * 0 = NaN
    x[2, 9] = float("nan")
    x[3] *= 1e37             # overflows to +-inf
    w_inf = w.clone()
    w_inf[60, 0] = float("inf")  # a bf16 value too: every row meets inf in column 60
    for weight in (w, w_inf):
        want = cpu_linear.linear(x, weight).argmax(-1)
        assert torch.equal(cpu_linear.linear_argmax(x, weight), want)
    if screen.startswith("amx"):
        assert cpu_linear.bf16_tiles(w_inf) is not None
    else:
        assert cpu_linear.bf16_rows(w_inf) is not None and cpu_linear.int8_screen(w_inf) is None
        assert cpu_linear._int8_argmax(x, w, cpu_linear.int8_screen(w))[1] >= 3 * -(-n // 16)  # rows 1-3 whole


@needs_amx
def test_argmax_fallbacks_and_shapes(amx_calls):
    """Leading dims kept; an off-grid weight, the screen turned off, autograd: linear(...).argmax(-1)."""
    w = _bf16_values(torch.randn(50, 64))
    x = torch.randn(2, 3, 64)
    got = cpu_linear.linear_argmax(x, w)
    assert got.shape == (2, 3) and torch.equal(got, cpu_linear.linear(x, w).argmax(-1))
    assert amx_calls["amx"] == [6]  # only the reference call: the screen has its own entry
    off_grid = w + 1e-3
    assert torch.equal(cpu_linear.linear_argmax(x, off_grid), F.linear(x, off_grid).argmax(-1))
    before = cpu_linear.set_argmax_screen(False)
    try:
        amx_calls["amx"].clear()
        assert torch.equal(cpu_linear.linear_argmax(x, w), got)
        assert amx_calls["amx"] == [6]  # the whole linear
    finally:
        cpu_linear.set_argmax_screen(before)
    grad = cpu_linear.linear_argmax(x, w.clone().requires_grad_())
    assert torch.equal(grad, got)


@needs_amx
def test_argmax_sees_in_place_updates(amx_screen):
    """The column norms (the screen's bounds) go with the tiles: rounded up, and recomputed after an in-place update
    (stale ones, 64x too small, would drop groups that hold the argmax)."""
    w = _bf16_values(torch.randn(64, 32))
    x = torch.randn(4, 32)
    cpu_linear.linear_argmax(x, w)

    def norms():
        return cpu_linear._column_norms(w, cpu_linear.bf16_tiles(w))
    exact = w.double().norm(dim=1)
    assert (norms() >= exact).all() and torch.allclose(norms(), exact, rtol=1e-9)
    with torch.no_grad():
        w.mul_(64.0)
        w[7] = _bf16_values(x[0] * 1000.0)
    assert (norms() >= w.double().norm(dim=1)).all()
    assert torch.equal(cpu_linear.linear_argmax(x, w), cpu_linear.linear(x, w).argmax(-1))
    assert int(cpu_linear.linear_argmax(x[:1], w)) == 7


# -------------------------------------------------------------------- bf16-packed weights on the fp32 kernel
RUNTIME_ROWS = range(1, 33)  # the rows of a projection call in decoding: the one-token step to trees of 31
BF16_SHAPES = [(1, 1), (5, 3), (15, 17), (17, 33), (33, 4), (100, 7), (577, 61), (576, 960)]


def _kernels_of(isa: str):
    """The fp32 kernel of ``isa`` on fp32 weights and on bf16-packed ones (``linear_<isa>``, ``linear_<isa>_bf16``)."""
    if isa not in cpu_native.isas():
        pytest.skip(f"this CPU lacks {isa}")
    ops = torch.ops.dflash_cpu
    return getattr(ops, f"linear_{isa}"), getattr(ops, f"linear_{isa}_bf16")


def _nan_out(rows: int, n: int) -> torch.Tensor:
    return torch.full((rows, n), float("nan"))


@pytest.mark.parametrize("isa", ["avx512", "avx2"])
def test_bf16_kernel_is_the_fp32_kernel_bit_for_bit(isa, seed):
    """On a weight of bf16 values, the kernel reading the bf16-packed copy writes the fp32 kernel's bits, at every
    row count 1-32, ugly K and N (tails of the 16 / 8 lanes and of the 4-row weight tile), with and without bias,
    into NaN-prefilled outputs; and both keep the 2x rule against fp64."""
    fp32, bf16 = _kernels_of(isa)
    g = torch.Generator().manual_seed(seed)
    for k, n in BF16_SHAPES:
        w = _bf16_values(torch.randn(n, k, generator=g) * k**-0.5)
        packed = cpu_linear.bf16_rows(w)
        assert packed is not None and packed.dtype == torch.int16 and packed.shape == (n, k)
        b = torch.randn(n, generator=g)
        for rows in RUNTIME_ROWS:
            x = torch.randn(rows, k, generator=g)
            bias = b if rows % 2 else None
            want, got = _nan_out(rows, n), _nan_out(rows, n)
            fp32(x, [w], [bias], want)
            bf16(x, [packed], [bias], got)
            assert torch.equal(got, want), f"{isa} K={k} N={n} rows={rows}"
            ref = F.linear(x.double(), w.double(), None if bias is None else bias.double())
            assert_within_rule(got, ref, F.linear(x, w, bias), f"{isa} bf16 K={k} N={n} rows={rows}")


@pytest.mark.parametrize("isa", ["avx512", "avx2"])
@pytest.mark.parametrize("name", list(BLOCKS))
def test_bf16_kernel_row_blocks_bit_for_bit(isa, name, seed):
    """Row blocks (a layer's q/k/v, gate/up, ugly block sizes), packed block by block: the fp32 kernel's bits."""
    fp32, bf16 = _kernels_of(isa)
    k, sizes = BLOCKS[name]
    g = torch.Generator().manual_seed(seed)
    ws = [_bf16_values(torch.randn(n, k, generator=g) * k**-0.5) for n in sizes]
    packed = [cpu_linear.bf16_rows(w) for w in ws]
    bs = [torch.randn(n, generator=g) for n in sizes]
    for rows in (1, 3, 8, 17, 32):
        x = torch.randn(rows, k, generator=g)
        for biases in ([None] * len(ws), bs):
            want, got = _nan_out(rows, sum(sizes)), _nan_out(rows, sum(sizes))
            fp32(x, ws, biases, want)
            bf16(x, packed, biases, got)
            assert torch.equal(got, want), f"{isa} {name} rows={rows}"


def test_bf16_rows_only_for_bf16_values():
    """bf16_rows: the upper halves of the bits when every value is a bf16 value (also inf, NaN and -0 of bf16), else
    None (one value a ulp off the grid, an fp32 denormal below bf16's); other dtypes and layouts: None."""
    w = _bf16_values(torch.randn(6, 40))
    w[0, :4] = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0])
    packed = cpu_linear.bf16_rows(w)
    assert torch.equal(packed, w.view(torch.int32).bitwise_right_shift(16).to(torch.int16))
    near = w.clone()
    near[5, 7] = torch.nextafter(near[5, 7], torch.tensor(9.0))
    assert cpu_linear.bf16_rows(near) is None
    tiny = torch.zeros(2, 3)
    tiny[1, 2] = 1e-45
    assert cpu_linear.bf16_rows(tiny) is None
    assert cpu_linear.bf16_rows(w.double()) is None
    assert cpu_linear.bf16_rows(w.t()) is None  # not unit stride along K
    strided = _bf16_values(torch.randn(6, 80))[:, :40]  # a row stride past K: packed contiguous
    assert torch.equal(cpu_linear.bf16_rows(strided), cpu_linear.bf16_rows(strided.contiguous()))


@pytest.fixture
def bf16_calls(monkeypatch):
    """The rows of each call that reached the bf16-packed kernel, and of each that reached the fp32 kernel."""
    calls = {"bf16": [], "fp32": []}
    ops = torch.ops.dflash_cpu

    class Counted:  # torch.ops.dflash_cpu with the bf16 kernels counted
        def __getattr__(self, name):
            op = getattr(ops, name)
            return _spy(op, calls["bf16"]) if name.endswith("_bf16") else op
    monkeypatch.setattr(torch.ops, "dflash_cpu", Counted())
    monkeypatch.setattr(cpu_linear, "_kernel", _spy(cpu_linear._kernel, calls["fp32"]))
    monkeypatch.setattr(cpu_linear, "_amx_on", False)  # the path of CPUs without AMX
    return calls


# ------------------------------------------------------------------------ linear_argmax's int8 screen (bf16 route)
@pytest.fixture
def int8_calls(monkeypatch):
    """The AMX path off (the bf16-packed route of CPUs without AMX); the (row, group) pairs each int8-screened argmax
    computed exactly."""
    monkeypatch.setattr(cpu_linear, "_amx_on", False)
    calls = []
    real = cpu_linear._int8_argmax

    def counted(x, w, screen):
        out = real(x, w, screen)
        calls.append(out[1])
        return out
    monkeypatch.setattr(cpu_linear, "_int8_argmax", counted)
    return calls


@needs_fast
@pytest.mark.parametrize("k,n", [(576, 49152), (7, 1), (33, 17), (64, 4099), (100, 300)])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 32])
def test_int8_screen_argmax_is_the_linears_argmax(k, n, rows, int8_calls, seed):
    """On the bf16-packed route the same indices as linear(x, w).argmax(-1), up to INT8_SCREEN_MAX_ROWS rows while
    most groups are only screened (the kernel itself checked at 9 and 32 rows too), above them the whole linear."""
    g = torch.Generator().manual_seed(seed)
    w = _bf16_weight(k, n) if (k, n) == (576, 49152) else _bf16_values(torch.randn(n, k, generator=g))
    x = torch.randn(rows, k, generator=g) * 3
    want = cpu_linear.linear(x, w).argmax(-1)
    got = cpu_linear.linear_argmax(x, w)
    assert got.dtype == torch.int64 and torch.equal(got, want)
    direct, pairs = cpu_linear._int8_argmax(x, w, cpu_linear.int8_screen(w))
    assert torch.equal(direct, want)
    screened = rows <= cpu_linear.INT8_SCREEN_MAX_ROWS
    groups = -(-n // 16)
    assert int8_calls == ([pairs] * 2 if screened else [pairs]) and rows <= pairs <= rows * groups
    if groups >= 64:
        assert pairs <= rows * groups // 16, pairs  # the screen rules most groups out


@needs_fast
def test_int8_screen_ties_near_ties_and_updates(int8_calls, seed):
    """Exact ties across groups (duplicate columns: the first index), columns one bf16 step apart, rows along a
    column (its duplicates win together), and an update in place (a new screen): always linear's argmax."""
    g = torch.Generator().manual_seed(seed)
    k, n = 64, 300
    w = _bf16_values(torch.randn(n, k, generator=g))
    w[150], w[290] = w[37], w[37]
    w[200] = w[37]
    w[200, 5] = torch.nextafter(w[200, 5].bfloat16(), torch.tensor(9.0, dtype=torch.bfloat16)).float()
    x = torch.randn(8, k, generator=g)
    x[:4] = w[37] * torch.arange(1, 5)[:, None]
    x[4:6] = w[200] * 3
    for flip in (False, True):
        if flip:
            w.mul_(-1)  # the screen follows the tensor's version
        want = cpu_linear.linear(x, w).argmax(-1)
        assert torch.equal(cpu_linear.linear_argmax(x, w), want)
        assert flip or set(want[:4].tolist()) <= {37, 200}
    assert len(int8_calls) == 2


@needs_fast
def test_int8_screen_bound_is_what_keeps_it_exact():
    """A column whose int8 code loses its small component (0.0039 quantizes to 0 beside 1.0) is the true argmax,
    and a column of another group screens higher: the screen's bound keeps the first group in, and with the bounds
    zeroed (a wrong rule) the kernel returns the other column. Each kernel where the CPU has it: AVX-512, AVX2 and
    amx_argmax's AMX-INT8 screen."""
    w = torch.zeros(32, 2)
    w[0] = torch.tensor([1.0, 0.00390625])
    w[16] = torch.tensor([1.0078125, 0.0])
    x = torch.tensor([[1.0, 4.0]])
    assert cpu_linear.linear(x, w).argmax(-1).item() == 0
    codes, scales, bounds, max_scale, code_norms = cpu_linear.int8_screen(w)
    assert codes[0, 1] == 0  # the small component is lost in the screen
    zero = torch.zeros_like(bounds)
    for isa in [i for i in ("avx512", "avx2") if i in cpu_native.isas()]:
        op = getattr(torch.ops.dflash_cpu, f"argmax_int8_{isa}")
        for b, want in ((bounds, 0), (zero, 16)):
            ids = torch.full((1,), -1)
            op(x, codes, scales, b, max_scale, cpu_linear.bf16_rows(w), ids)
            assert ids.item() == want, (isa, b)
    if AMX and torch.ops.dflash_cpu.amx_int8():
        tiles = cpu_linear.bf16_tiles(w)
        for b, c, want in ((bounds, code_norms, 0), (zero, zero, 16)):
            ids = torch.full((1,), -1)
            torch.ops.dflash_cpu.amx_argmax(x, tiles, None, cpu_linear._column_norms(w, tiles), ids,
                                            int8_tiles=cpu_linear.amx_int8_tiles(w), scales=scales, int8_bounds=b,
                                            code_norms=c, max_scale=max_scale)
            assert ids.item() == want, ("amx int8", b)


@needs_fast
def test_bf16_route(bf16_calls):
    """linear() takes the bf16-packed kernel for a bf16-exact weight at every row count the runtime uses (1-32), with
    the fp32 kernel's bits there; the fp32 kernel for a weight off the grid; F.linear above BF16_MAX_ROWS."""
    k, n = 64, 48
    w, b = _bf16_values(torch.randn(n, k)), torch.randn(n)
    _route_bits_every_row_count(w, b, getattr(torch.ops.dflash_cpu, "linear_" + cpu_linear.isa()), cpu_linear.isa())
    _check(torch.randn(cpu_linear.BF16_MAX_ROWS + 1, k), w, b, "many rows")
    near = w.clone()
    near[5, 7] = torch.nextafter(near[5, 7], torch.tensor(9.0))
    _check(torch.randn(8, k), near, b, "one value off the bf16 grid")
    blocks = cpu_linear.RowBlocks([w[:20], w[20:]], [b[:20], b[20:]])
    torch.testing.assert_close(cpu_linear.linear(torch.randn(1, k), blocks).shape, (1, n))
    assert bf16_calls == {"bf16": list(RUNTIME_ROWS) + [1], "fp32": [8]}


def _route_bits_every_row_count(w, b, fp32_kernel, what):
    """At every row count the runtime uses, linear() on the bf16-exact ``w`` writes ``fp32_kernel``'s bits (with a
    bias at odd counts) and keeps the 2x rule."""
    k, n = w.shape[1], w.shape[0]
    for rows in RUNTIME_ROWS:
        x, bias = torch.randn(rows, k), b if rows % 2 else None
        got = _check(x, w, bias, f"{what} bf16 rows={rows}")
        want = _nan_out(rows, n)
        fp32_kernel(x, [w], [bias], want)
        assert torch.equal(got, want), f"{what} rows={rows}"


@needs_fast
def test_bf16_copy_follows_in_place_updates(bf16_calls):
    """The packed copy follows the tensor's version: an update in place repacks (one that leaves the bf16 grid goes
    to the fp32 kernel); a stale copy would give the old weight's product and fail the rule."""
    _check_in_place_updates()
    assert bf16_calls == {"bf16": [4] * 7, "fp32": [4]}


@pytest.mark.skipif(not FAST or "avx2" not in cpu_native.isas(), reason="needs the kernel and AVX2 + FMA")
def test_bf16_route_avx2(monkeypatch, bf16_calls):
    """DFLASH_CPU_LINEAR_ISA=avx2: bf16-exact weights take the AVX2 build's bf16-packed kernel at every row count the
    runtime uses, same bits as its fp32 kernel."""
    monkeypatch.setattr(cpu_linear, "_tried", False)
    monkeypatch.setattr(cpu_linear, "_isa", None)
    monkeypatch.setenv(cpu_linear.ISA_ENV, "avx2")
    assert cpu_linear.isa() == "avx2"
    k, n = 577, 61
    _route_bits_every_row_count(_bf16_values(torch.randn(n, k)), torch.randn(n), torch.ops.dflash_cpu.linear_avx2,
                                "avx2")
    assert bf16_calls["bf16"] == list(RUNTIME_ROWS)


def test_bf16_route_on_an_avx2_only_cpu():
    """DFLASH_CPU_ISA=avx2 (as on a CPU without AVX-512; in a subprocess: the choice is made once, at load): the
    bf16-packed tests above and the native forward's routes pass on the AVX2 build alone."""
    if "avx2" not in cpu_native.isas() or os.environ.get("DFLASH_CPU_ISA"):
        pytest.skip("needs AVX2 + FMA, uncapped")
    forward_tests = os.path.join(os.path.dirname(__file__), "test_native_forward.py")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, forward_tests,
                           "-k", "bf16 and not avx2_only or each_fp32_kernel_route"],
                          env={**os.environ, "DFLASH_CPU_ISA": "avx2"}, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0 and " passed" in done.stdout, done.stdout[-3000:]


@needs_fast
@pytest.mark.parametrize("bad", ["k", "out", "bias", "stride"])
def test_native_linear_checks_extents(bad):
    """The native entry points themselves refuse extents their pointers would walk past (a caller that skips
    ``linear``'s checks gets an error, not a read outside the tensors)."""
    x, w, b, out = torch.randn(3, 16), torch.randn(5, 16), torch.randn(5), torch.full((3, 5), float("nan"))
    if bad == "k":
        w = torch.randn(5, 8)
    elif bad == "out":
        out = torch.empty(3, 4)
    elif bad == "bias":
        b = torch.randn(4)
    else:
        w = torch.randn(16, 5).t()
    ops = [getattr(torch.ops.dflash_cpu, f"linear_{isa}") for isa in cpu_native.isas() if isa != "amx"]
    for op in ops:
        with pytest.raises(RuntimeError, match="dflash_cpu::linear"):
            op(x, [w], [b], out)
