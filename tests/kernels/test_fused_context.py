import pytest
import torch

from dflash_kernels.fused_context import fused_context, fused_context_reference
from helpers.tol import assert_within_rule

BACKENDS = ["torch", "triton"]
DTYPES = [torch.float32, torch.bfloat16]


def _inputs(n, h, t, dtype):
    taps = [torch.randn(n, h, dtype=dtype) * (1 + i) for i in range(t)]
    w = (torch.randn(h, t * h) / (t * h) ** 0.5).to(dtype)
    nw = (1 + 0.5 * torch.randn(h)).to(dtype)
    return taps, w, nw


def _check(out, taps, w, nw, eps=1e-6):
    ref = fused_context_reference([x.double() for x in taps], w.double(), nw.double(), eps)
    lowp = fused_context_reference(taps, w, nw, eps)
    assert out.dtype == taps[0].dtype
    assert_within_rule(out, ref, lowp, "fused_context")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,h,t", [(1, 37, 3), (17, 24, 5), (5, 300, 2), (3, 16, 1)])
def test_list_of_taps(backend, dtype, n, h, t):
    taps, w, nw = _inputs(n, h, t, dtype)
    _check(fused_context(taps, w, nw, backend=backend), taps, w, nw)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["N_TH", "T_N_H", "strided_rows", "many_taps"])
def test_layouts(backend, layout):
    n, h, t = 6, 20, 3
    dtype = torch.bfloat16
    if layout == "N_TH":
        buf = torch.randn(n, t * h).to(dtype)
        taps_arg, taps = buf, list(buf.split(h, dim=1))
    elif layout == "T_N_H":
        buf = torch.randn(t, n, h).to(dtype)
        taps_arg, taps = buf, list(buf.unbind(0))
    elif layout == "strided_rows":
        big = torch.randn(2 * n, h + 5).to(dtype)
        taps = [big[::2, :h], torch.randn(n, h).to(dtype), big[1::2, 3:h + 3]]
        taps_arg = taps
    else:  # more separate buffers than the kernel's pointer slots
        t = 10
        taps = [torch.randn(n, h).to(dtype) for _ in range(t)]
        taps_arg = taps
    w = (torch.randn(h, t * h) / (t * h) ** 0.5).to(dtype)
    nw = torch.randn(h).to(dtype)
    _check(fused_context(taps_arg, w, nw, eps=1e-5, backend=backend), taps, w, nw, eps=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_rows(backend):
    taps, w, nw = _inputs(0, 12, 2, torch.float32)
    out = fused_context(taps, w, nw, backend=backend)
    assert out.shape == (0, 12)


def test_wide_hidden_uses_two_pass_norm():
    # H wider than one column tile: GEMM into an fp32 workspace, then the separate RMSNorm kernel.
    taps, w, nw = _inputs(3, 301, 2, torch.bfloat16)
    _check(fused_context(taps, w, nw, backend="triton"), taps, w, nw)


def test_bad_inputs():
    taps, w, nw = _inputs(4, 8, 2, torch.float32)
    with pytest.raises(ValueError, match="fc_weight"):
        fused_context(taps, w[:, :8], nw)
    with pytest.raises(ValueError, match="norm_weight"):
        fused_context(taps, w, nw[:4])
    with pytest.raises(TypeError, match="taps\\[1\\]"):
        fused_context([taps[0], taps[1].double()], w, nw)
    with pytest.raises(ValueError, match="taps\\[1\\]"):
        fused_context([taps[0], taps[1][:2]], w, nw)
    with pytest.raises(TypeError, match="taps"):
        fused_context([], w, nw)
    with pytest.raises(ValueError, match="T\\*H"):
        fused_context(torch.randn(4, 15), w, nw)
    with pytest.raises(ValueError, match="backend"):
        fused_context(taps, w, nw, backend="cuda")
    with pytest.raises(ValueError, match="out must be \\[N, H\\]"):
        fused_context(taps, w, nw, out=torch.empty(3, 8))
    with pytest.raises(TypeError, match="out has dtype"):
        fused_context(taps, w, nw, out=torch.empty(4, 8, dtype=torch.float64))


@pytest.mark.parametrize("split_k", [1, 2, 3, 7])
def test_split_k_partials_sum_to_the_same_result(split_k):
    from dflash_kernels.fused_context import _fused_context_triton

    taps, w, nw = _inputs(5, 37, 3, torch.bfloat16)
    out = torch.full((5, 37), float("nan"), dtype=torch.bfloat16)
    _fused_context_triton(taps, w, nw, 1e-6, out, split_k=split_k)
    _check(out, taps, w, nw)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("h", [12, 301])  # the norm fused into the GEMM, and the two-pass norm
def test_out_rows_of_a_buffer(backend, h):
    """out=: the rows land in the given (row-strided) view and nowhere else."""
    taps, w, nw = _inputs(3, h, 2, torch.bfloat16)
    buffer = torch.full((8, h + 5), float("nan"), dtype=torch.bfloat16)
    out = buffer[4:7, 2:2 + h]
    assert fused_context(taps, w, nw, out=out, backend=backend) is out
    _check(out, taps, w, nw)
    untouched = torch.ones_like(buffer, dtype=torch.bool)
    untouched[4:7, 2:2 + h] = False
    assert torch.isnan(buffer[untouched]).all()
