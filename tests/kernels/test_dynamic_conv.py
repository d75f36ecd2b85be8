import pytest
import torch

from dflash_kernels.conv_prepare import dynamic_conv_prepare, dynamic_conv_prepare_reference
from dflash_kernels.dynamic_conv import grouped_dynamic_conv, grouped_dynamic_conv_reference
from helpers.device import DEVICE
from helpers.tol import assert_within_rule

BACKENDS = ["torch", "triton", pytest.param("cpu", marks=pytest.mark.skipif(DEVICE != "cpu", reason="CPU tensors only"))]
DTYPES = [torch.float32, torch.bfloat16]
# (N, B, H, K, G): odd block sizes, more taps than rows, G = 1 and G = H, empty batches
SHAPES = [(2, 5, 24, 3, 6), (3, 7, 40, 4, 8), (1, 2, 12, 5, 12), (2, 16, 96, 4, 1), (0, 4, 16, 2, 4),
          (3, 1, 8, 3, 2), (1, 3, 1030, 2, 10)]


def _inputs(n, b, h, k, g, dtype, strided=False):
    """x, the dynamic kernels of one side and base; ``strided``: x rows of a wider buffer, the kernels a side of
    one [N, B, 2, K, H/G] projection output (what the engine passes)."""
    pad = 3 if strided else 0
    x = torch.randn(n, b, h + 2 * pad, device=DEVICE).to(dtype)[..., pad:h + pad]
    proj = (0.5 * torch.randn(n, b, 2, k, h // g, device=DEVICE)).to(dtype)
    base = torch.randn(2, k, h, device=DEVICE)
    return x, proj[:, :, 1], base[1]


def _expected64(x, dynamic, base):
    """The definition written out per row and tap, in fp64."""
    n, b, h = x.shape
    g = h // dynamic.shape[-1]
    out = torch.zeros(n, b, h, dtype=torch.float64, device=x.device)
    for t in range(b):
        for o in range(min(base.shape[0], t + 1)):
            weight = base[o].double() + dynamic[:, t, o].double().repeat_interleave(g, dim=-1)
            out[:, t] += weight * x[:, t - o].double()
    return out


def test_reference_is_the_definition():
    x, dynamic, base = _inputs(2, 5, 24, 3, 6, torch.float64)
    torch.testing.assert_close(grouped_dynamic_conv_reference(x, dynamic, base), _expected64(x, dynamic, base),
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("strided", [False, True])
def test_grouped_dynamic_conv(backend, dtype, shape, strided):
    x, dynamic, base = _inputs(*shape, dtype, strided)
    before = [t.clone() for t in (x, dynamic, base)]
    out = torch.full(x.shape, float("nan"), dtype=dtype, device=DEVICE)  # an element not written stays NaN
    assert grouped_dynamic_conv(x, dynamic, base, out=out, backend=backend) is out
    assert all(torch.equal(t, b) for t, b in zip((x, dynamic, base), before)), "an input was written"
    assert torch.equal(grouped_dynamic_conv(x, dynamic, base, backend=backend), out), "out= changed the result"
    assert_within_rule(out, _expected64(x, dynamic, base), grouped_dynamic_conv_reference(x, dynamic, base),
                       "grouped_dynamic_conv")


def test_triton_bf16_rounds_to_nearest_even():
    """The kernel sums the taps in fp32 and rounds once to nearest even, as a GPU store does and as
    dynamic_conv_prepare's epilogue does: under the interpreter too, whose fp32 -> bf16 cast truncates. The fp32 sum
    is written out in the kernel's order (tap 0, then each later tap added), so the bits must match exactly."""
    x, dynamic, base = _inputs(3, 7, 40, 3, 8, torch.bfloat16)
    got = grouped_dynamic_conv(x, dynamic, base, backend="triton")
    g = x.shape[-1] // dynamic.shape[-1]
    weight = base.float()[None, None] + dynamic.float().repeat_interleave(g, dim=-1)  # [N, B, K, H]
    acc = torch.zeros(x.shape)
    for o in range(base.shape[0]):
        shifted = torch.zeros(x.shape)
        shifted[:, o:] = x[:, :x.shape[1] - o].float()
        acc = weight[:, :, o] * shifted if o == 0 else acc + weight[:, :, o] * shifted
    assert torch.equal(got, acc.to(torch.bfloat16))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_tail_rows_do_not_reach_earlier_rows(backend):
    x, dynamic, base = _inputs(2, 8, 16, 3, 4, torch.float32)
    full = grouped_dynamic_conv(x, dynamic, base, backend=backend)
    short = grouped_dynamic_conv(x[:, :5], dynamic[:, :5], base, backend=backend)
    assert torch.equal(full[:, :5], short)


def test_bad_arguments_raise_before_work():
    x, dynamic, base = _inputs(2, 5, 24, 3, 6, torch.float32)
    with pytest.raises(TypeError, match="grouped_dynamic_conv: dynamic has dtype"):
        grouped_dynamic_conv(x, dynamic.to(torch.bfloat16), base)
    with pytest.raises(ValueError, match=r"dynamic must have shape \(2, 5, 3, 4\)"):
        grouped_dynamic_conv(x, torch.randn(2, 5, 2, 4, device=DEVICE), base)
    with pytest.raises(ValueError, match="must divide H = 24"):
        grouped_dynamic_conv(x, torch.randn(2, 5, 3, 5, device=DEVICE), base)
    with pytest.raises(ValueError, match=r"base must have shape \(3, 24\)"):
        grouped_dynamic_conv(x, dynamic, base[:, :20])
    with pytest.raises(ValueError, match="x must be contiguous in its last dim"):
        grouped_dynamic_conv(x.transpose(1, 2).contiguous().transpose(1, 2), dynamic, base)
    with pytest.raises(ValueError, match="at least one tap"):
        grouped_dynamic_conv(x, dynamic[:, :, :0], base[:0])
    out = torch.full_like(x, float("nan"))
    with pytest.raises(ValueError, match="out overlaps x"):
        grouped_dynamic_conv(x, dynamic, base, out=x)
    with pytest.raises(ValueError, match=r"out must be a contiguous tensor of x's shape"):
        grouped_dynamic_conv(x, dynamic, base, out=out[:, :4])
    with pytest.raises(TypeError, match="out has dtype"):
        grouped_dynamic_conv(x, dynamic, base, out=out.double())
    assert torch.isnan(out).all(), "a rejected call wrote out"


# ------------------------------------------------------------------------- dynamic_conv_prepare (GEMM + conv)
def _prepare_inputs(n, b, h, k, g, dtype, strided=False):
    """x (rows of a wider buffer when ``strided``), kernel_projection.weight [2*K*H/G, H] and base_kernel[0]."""
    pad = 3 if strided else 0
    x = torch.randn(n, b, h + 2 * pad, device=DEVICE).to(dtype)[..., pad:h + pad]
    projection = (torch.randn(2 * k * (h // g), h, device=DEVICE) / h ** 0.5).to(dtype)
    return x, projection, torch.randn(k, h, device=DEVICE)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES + [(5, 7, 36, 2, 3)])  # 35 rows: more than one row tile at 16
@pytest.mark.parametrize("strided", [False, True])
def test_dynamic_conv_prepare(backend, dtype, shape, strided):
    """Both outputs by the 2x rule against the fp64 definition; the convolution also exactly the convolution of x
    with the returned (rounded) dynamic kernels, as grouped_dynamic_conv computes it."""
    x, projection, base = _prepare_inputs(*shape, dtype, strided)
    before = [t.clone() for t in (x, projection, base)]
    n, b, h, k, g = shape
    out = torch.full(x.shape, float("nan"), dtype=dtype, device=DEVICE)  # an element not written stays NaN
    dynamic = torch.full((n, b, 2, k, h // g), float("nan"), dtype=dtype, device=DEVICE)
    got = dynamic_conv_prepare(x, projection, base, out=out, dynamic=dynamic, backend=backend)
    assert got[0] is out and got[1] is dynamic
    assert all(torch.equal(t, b) for t, b in zip((x, projection, base), before)), "an input was written"
    again = dynamic_conv_prepare(x, projection, base, backend=backend)
    assert torch.equal(again[0], out) and torch.equal(again[1], dynamic), "out= / dynamic= changed the result"
    conv64, dyn64 = dynamic_conv_prepare_reference(x.double(), projection.double(), base.double())
    conv_low, dyn_low = dynamic_conv_prepare_reference(x, projection, base)
    assert_within_rule(dynamic, dyn64, dyn_low, "dynamic_conv_prepare dynamic")
    assert_within_rule(out, conv64, conv_low, "dynamic_conv_prepare out")
    conv_backend = "torch" if backend != "triton" else "triton"
    if dtype == torch.float32 or backend != "triton":  # (the interpreter's bf16 stores truncate in the plain op)
        assert torch.equal(out, grouped_dynamic_conv(x, dynamic[:, :, 0], base, backend=conv_backend))


def test_dynamic_conv_prepare_bad_arguments_raise_before_work():
    x, projection, base = _prepare_inputs(2, 5, 24, 3, 6, torch.float32)
    out = torch.full_like(x, float("nan"))
    dynamic = torch.full((2, 5, 2, 3, 4), float("nan"))
    with pytest.raises(TypeError, match="dynamic_conv_prepare: projection has dtype"):
        dynamic_conv_prepare(x, projection.double(), base, out=out, dynamic=dynamic)
    with pytest.raises(ValueError, match=r"projection must be \[2\*K\*H/G, H\]"):
        dynamic_conv_prepare(x, projection[:-1], base, out=out, dynamic=dynamic)
    with pytest.raises(ValueError, match=r"projection must be \[2\*K\*H/G, H\]"):
        dynamic_conv_prepare(x, projection[:, :20], base, out=out, dynamic=dynamic)
    with pytest.raises(ValueError, match=r"base must be a contiguous \[K, H\]"):
        dynamic_conv_prepare(x, projection, base[:0], out=out, dynamic=dynamic)
    with pytest.raises(ValueError, match=r"x must have 3 dims"):
        dynamic_conv_prepare(x[0], projection, base)
    with pytest.raises(ValueError, match="out overlaps x"):
        dynamic_conv_prepare(x, projection, base, out=x, dynamic=dynamic)
    with pytest.raises(ValueError, match=r"dynamic must be a contiguous \[N, B, 2, K, H/G\]"):
        dynamic_conv_prepare(x, projection, base, out=out, dynamic=dynamic[:, :4])
    with pytest.raises(ValueError, match="dynamic overlaps out"):
        dynamic_conv_prepare(x, projection, base, out=out, dynamic=out.view(-1)[:240].view(2, 5, 2, 3, 4))
    assert torch.isnan(out).all() and torch.isnan(dynamic).all(), "a rejected call wrote an output"


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_dynamic_conv_prepare_opcheck(backend):
    x, projection, base = _prepare_inputs(2, 3, 20, 2, 5, torch.bfloat16)
    torch.library.opcheck(torch.ops.dflash.dynamic_conv_prepare.default,
                          (x, projection, base, torch.empty_like(x), x.new_empty(2, 3, 2, 2, 4), backend))
