import os

import pytest
import torch

from dflash_kernels import add_rms_norm, grouped_dynamic_conv, silu_mul
from dflash_kernels.dynamic_conv import grouped_dynamic_conv_reference
from dflash_kernels.layer_ops import add_rms_norm_reference, silu_mul_reference
from helpers.device import DEVICE
from helpers.tol import assert_within_rule

BACKENDS = ["torch", "triton", pytest.param("cpu", marks=pytest.mark.skipif(DEVICE != "cpu", reason="CPU tensors only"))]
DTYPES = [torch.float32, torch.bfloat16]
SHAPES = [(5, 7), (2, 3, 100), (0, 16), (0, 3, 16), (3, 1), (2, 576)]


def _norm_inputs(shape, dtype):
    x = (torch.randn(shape) * 2).to(dtype)
    res = torch.randn(shape).to(dtype)
    w = (1 + 0.5 * torch.randn(shape[-1])).to(dtype)
    return x, res, w


def _storages(*ts):
    return {t.untyped_storage().data_ptr() for t in ts if t is not None}


def _check_norm(x, w, res, backend, eps=1e-6):
    """Run add_rms_norm once; check the output against the rule and the in-place residual bit-exactly."""
    before = None if res is None else res.clone()
    out = add_rms_norm(x, w, eps, residual=res, backend=backend)
    ref64 = add_rms_norm_reference(x.double(), w.double(), eps, residual=None if res is None else before.double())
    lowp = add_rms_norm_reference(x, w, eps, residual=None if res is None else before.clone())
    assert out.dtype == x.dtype and out.is_contiguous()
    assert_within_rule(out, ref64, lowp, "add_rms_norm")
    if res is not None:
        assert torch.equal(res, before + x), "residual must become residual + x rounded to the dtype"
    if out.numel():
        assert not _storages(out) & _storages(x, w, res), "the output aliases an input"
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm(backend, dtype, shape, with_residual):
    x, res, w = _norm_inputs(shape, dtype)
    _check_norm(x, w, res if with_residual else None, backend)


def _conv_operands(n, b, h, k, g, dtype):
    """A convolution's dynamic kernels (side 1 of one [N, B, 2, K, H/G] projection output, as the engine passes
    them) and base [K, H] (fp32, as a checkpoint stores it)."""
    proj = (0.5 * torch.randn(n, b, 2, k, h // g, device=DEVICE)).to(dtype)
    return proj[:, :, 1], torch.randn(k, h, device=DEVICE)


# (N, B, H, K, G): odd block sizes, more taps than rows, G = 1 and G = H, one row, empty batches
CONV_SHAPES = [(2, 5, 24, 3, 6), (3, 7, 40, 4, 8), (1, 2, 12, 5, 12), (2, 16, 96, 2, 1), (0, 4, 16, 2, 4),
               (3, 1, 8, 3, 2), (1, 3, 1030, 2, 10)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", CONV_SHAPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_with_conv(backend, dtype, shape, with_residual):
    """DFlash2's finish fused in front of the add: the output by the 2x rule against the reference (the
    convolution's reference, then add_rms_norm's), the residual exactly the residual + the rounded convolution."""
    x, res, w = _norm_inputs(shape[:2] + shape[2:3], dtype)
    x = x.to(DEVICE)
    res, w = res.to(DEVICE), w.to(DEVICE)
    dynamic, base = _conv_operands(*shape, dtype)
    res = res if with_residual else None
    before = None if res is None else res.clone()
    inputs = [t.clone() for t in (x, dynamic, base, w)]
    out = torch.full(x.shape, float("nan"), dtype=dtype, device=DEVICE)  # an element not written stays NaN
    assert add_rms_norm(x, w, 1e-6, residual=res, out=out, conv_dynamic=dynamic, conv_base=base,
                        backend=backend) is out
    assert all(torch.equal(a, b) for a, b in zip((x, dynamic, base, w), inputs)), "an input was written"
    copy = None if before is None else before.clone()
    lowp = add_rms_norm_reference(x, w, 1e-6, residual=copy, conv_dynamic=dynamic, conv_base=base)
    ref64 = add_rms_norm_reference(x.double(), w.double(), 1e-6, residual=None if before is None else before.double(),
                                   conv_dynamic=dynamic.double(), conv_base=base.double())
    assert_within_rule(out, ref64, lowp, "add_rms_norm with a convolution")
    if res is not None:  # the convolution as each backend rounds it: the reference per tap, the kernel once
        conv = (grouped_dynamic_conv(x.float(), dynamic.float(), base, backend=backend).to(dtype)
                if backend == "triton" else grouped_dynamic_conv_reference(x, dynamic, base))
        assert torch.equal(res, before + conv), "residual must become residual + the convolution, in the dtype"


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_conv_equals_the_two_ops(backend):
    """Fused and unfused (grouped_dynamic_conv, then add_rms_norm) give the same bits: fp32, where the
    interpreter's stores round as the GPU's do."""
    x, res, w = _norm_inputs((3, 7, 40), torch.float32)
    dynamic, base = _conv_operands(3, 7, 40, 4, 8, torch.float32)
    res2 = res.clone()
    fused = add_rms_norm(x, w, 1e-6, residual=res, conv_dynamic=dynamic, conv_base=base, backend=backend)
    two = add_rms_norm(grouped_dynamic_conv(x, dynamic, base, backend=backend), w, 1e-6, residual=res2,
                       backend=backend)
    assert torch.equal(fused, two) and torch.equal(res, res2)


def test_conv_bad_arguments_raise_before_work():
    x, res, w = _norm_inputs((2, 5, 24), torch.float32)
    dynamic, base = _conv_operands(2, 5, 24, 3, 6, torch.float32)
    out = torch.full_like(x, float("nan"))
    before = res.clone()
    with pytest.raises(ValueError, match="pass conv_dynamic and conv_base together"):
        add_rms_norm(x, w, residual=res, out=out, conv_dynamic=dynamic)
    with pytest.raises(ValueError, match=r"add_rms_norm: x must be 3-D|add_rms_norm: x must have 3 dim"):
        add_rms_norm(x[0], w, out=out[0], conv_dynamic=dynamic, conv_base=base)
    with pytest.raises(ValueError, match=r"conv_dynamic must have shape \(2, 5, 3, 4\)"):
        add_rms_norm(x, w, residual=res, out=out, conv_dynamic=dynamic[:, :, :2], conv_base=base)
    with pytest.raises(TypeError, match="add_rms_norm: conv_dynamic has dtype"):
        add_rms_norm(x, w, residual=res, out=out, conv_dynamic=dynamic.double(), conv_base=base)
    with pytest.raises(ValueError, match=r"conv_base must have shape \(3, 24\)"):
        add_rms_norm(x, w, residual=res, out=out, conv_dynamic=dynamic, conv_base=base[:, :20])
    with pytest.raises(ValueError, match="out overlaps x"):
        add_rms_norm(x, w, residual=res, out=x, conv_dynamic=dynamic, conv_base=base)
    with pytest.raises(ValueError, match="residual overlaps x"):
        add_rms_norm(x, w, residual=x, out=out, conv_dynamic=dynamic, conv_base=base)
    with pytest.raises(ValueError, match="add_rms_norm: conv_dynamic and conv_base|pass conv_dynamic"):
        torch.ops.dflash.add_rms_norm(x, w, 1e-6, res, out, None, base, "auto")
    assert torch.isnan(out).all() and torch.equal(res, before), "a rejected call wrote out or the residual"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 14), (2, 3, 200), (0, 8), (0, 3, 8), (3, 2), (2, 1152)])
def test_silu_mul(backend, dtype, shape):
    gate_up = (torch.randn(shape) * 3).to(dtype)
    out = silu_mul(gate_up, backend=backend)
    assert out.shape == (*shape[:-1], shape[-1] // 2) and out.dtype == dtype and out.is_contiguous()
    assert_within_rule(out, silu_mul_reference(gate_up.double()), silu_mul_reference(gate_up), "silu_mul")
    if out.numel():
        assert not _storages(out) & _storages(gate_up), "the output aliases gate_up"


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_rows(backend):
    """Rows with a stride (a view of a wider buffer) and leading dims that do not flatten to one stride."""
    h = 24
    big = torch.randn(6, h + 8).to(torch.bfloat16)
    w = torch.randn(h).to(torch.bfloat16)
    res = torch.randn(6, h).to(torch.bfloat16)
    _check_norm(big[:, 4:h + 4], w, res, backend)
    permuted = torch.randn(3, 2, h).transpose(0, 1)  # [2, 3, h], rows not one stride apart
    _check_norm(permuted, w.float(), None, backend)
    gu = torch.randn(5, 2 * h + 6)[:, 3:2 * h + 3]
    assert_within_rule(silu_mul(gu, backend=backend), silu_mul_reference(gu.double()), silu_mul_reference(gu))


@pytest.mark.parametrize("with_residual", [False, True])
def test_bf16_triton_equals_torch(with_residual):
    """bf16, with wide rows (H, I = 4097: more than one silu_mul column tile under the interpreter).

    The kernels round to bf16 (nearest even, emulated by integer ops because the interpreter's casts
    truncate) exactly where the reference rounds, so the outputs are bit-equal: 0 of ~2M elements differed
    in a sweep. Not asserted everywhere: the fp32 sum of squares is accumulated in another order than
    torch's mean (and differently on a GPU), which can move a value across a bf16 rounding boundary. So:
    every element within 1 ulp, and at most 0.1% not bit-equal. Skipping either intermediate rounding
    (normalised value, silu) makes ~25% of the elements differ. The residual is exact: one fp32 add, one
    rounding."""
    x, res, w = _norm_inputs((3, 4097), torch.bfloat16)
    res_t = res.clone() if with_residual else None
    res_r = res.clone() if with_residual else None
    out_t = add_rms_norm(x, w, residual=res_t, backend="triton")
    out_r = add_rms_norm(x, w, residual=res_r, backend="torch")
    gu = (torch.randn(3, 2 * 4097) * 3).to(torch.bfloat16)
    pairs = [(out_t, out_r), (silu_mul(gu, backend="triton"), silu_mul(gu, backend="torch"))]
    if with_residual:
        assert torch.equal(res_t, res_r)
    for got, want in pairs:
        # Same sign and at most one step apart in the bf16 bit pattern = within 1 ulp.
        steps = (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()
        assert torch.equal(got.signbit(), want.signbit()) and steps.max() <= 1
        assert (steps > 0).float().mean() <= 1e-3, "the kernel does not round where the reference rounds"


@pytest.mark.parametrize("backend", BACKENDS)
def test_add_rms_norm_into_rows_of_a_buffer(backend):
    """out=: the result lands in the given rows (the engine stacks them over other rows for one GEMM)."""
    x, res, w = _norm_inputs((2, 3, 40), torch.bfloat16)
    expected = _check_norm(x, w, res.clone(), backend)
    buffer = torch.full((10, 40), float("nan"), dtype=torch.bfloat16)
    out = buffer[:6].view(2, 3, 40)
    assert add_rms_norm(x, w, residual=res, out=out, backend=backend) is out
    assert torch.equal(out, expected) and torch.isnan(buffer[6:]).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("conv", [False, True])
def test_add_rms_norm_into_token_major_rows(backend, dtype, conv):
    """out= the transpose(0, 1) of a contiguous [B, N, H] buffer: the same values as a contiguous out, bit for bit,
    row t of request n at buffer[t, n] (rows 1..B-1 of every request then lie contiguous, without row 0)."""
    n, b, h = 3, 5, 40
    x, res, w = _norm_inputs((n, b, h), dtype)
    x, res, w = x.to(DEVICE), res.to(DEVICE), w.to(DEVICE)
    kwargs = dict(zip(("conv_dynamic", "conv_base"), _conv_operands(n, b, h, 2, 4, dtype))) if conv else {}
    res2 = res.clone()
    expected = add_rms_norm(x, w, residual=res, backend=backend, **kwargs)
    buffer = torch.full((b, n, h), float("nan"), dtype=dtype, device=DEVICE)
    assert add_rms_norm(x, w, residual=res2, out=buffer.transpose(0, 1), backend=backend, **kwargs) is not None
    assert torch.equal(buffer, expected.transpose(0, 1)) and torch.equal(res2, res)


def test_fp16():
    x, res, w = _norm_inputs((4, 3, 40), torch.float16)
    _check_norm(x, w, res, "triton")
    gu = torch.randn(4, 80).to(torch.float16)
    assert_within_rule(silu_mul(gu, backend="triton"), silu_mul_reference(gu.double()), silu_mul_reference(gu))


def test_bad_inputs():
    x, res, w = _norm_inputs((4, 8), torch.float32)
    res0 = res.clone()
    with pytest.raises(ValueError, match="weight must be \\[H\\]"):
        add_rms_norm(x, w[:5])
    with pytest.raises(TypeError, match="residual"):
        add_rms_norm(x, w, residual=res.double())
    with pytest.raises(ValueError, match="residual must have x's shape"):
        add_rms_norm(x, w, residual=res[:2])
    with pytest.raises(ValueError, match="residual .* contiguous"):
        add_rms_norm(x, w, residual=torch.randn(8, 4).t())
    with pytest.raises(ValueError, match="x must be contiguous in its last dim"):
        add_rms_norm(torch.randn(8, 4).t(), w)
    with pytest.raises(TypeError, match="x has dtype"):
        add_rms_norm(x.long(), w)
    with pytest.raises(ValueError, match="0-d"):
        add_rms_norm(torch.tensor(1.0), w[:1])
    with pytest.raises(ValueError, match="eps"):
        add_rms_norm(x, w, -1.0)
    with pytest.raises(ValueError, match="backend"):
        add_rms_norm(x, w, backend="ext")
    with pytest.raises(ValueError, match="out must be a tensor of x's shape .* contiguous or"):
        add_rms_norm(x, w, residual=res, out=torch.empty(8, 4).t())
    with pytest.raises(ValueError, match=r"out must be a tensor of x's shape \(2, 3, 8\).*\(neither layout\)"):
        add_rms_norm(torch.randn(2, 3, 8), w, out=torch.empty(8, 3, 2).permute(2, 1, 0))
    with pytest.raises(TypeError, match="out has dtype"):
        add_rms_norm(x, w, residual=res, out=torch.empty(4, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="2I"):
        silu_mul(torch.randn(4, 7))
    with pytest.raises(ValueError, match="gate_up must be contiguous in its last dim"):
        silu_mul(torch.randn(8, 4).t())
    with pytest.raises(TypeError, match="gate_up has dtype"):
        silu_mul(torch.zeros(4, 8, dtype=torch.int32))
    assert torch.equal(res, res0), "a rejected call must not touch residual"


def test_validate_false_skips_only_the_argument_checks():
    """validate=False (the lean target's layers after the first) computes the same; the backend is still resolved."""
    x, res, w = _norm_inputs((4, 8), torch.float32)
    res2 = res.clone()
    assert torch.equal(add_rms_norm(x, w, residual=res), add_rms_norm(x, w, residual=res2, validate=False))
    assert torch.equal(res, res2)
    gu = torch.randn(4, 16)
    assert torch.equal(silu_mul(gu), silu_mul(gu, validate=False))
    with pytest.raises(ValueError, match="backend"):
        add_rms_norm(x, w, backend="ext", validate=False)


def test_wrong_device():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device next to the CPU")
    x, _, w = _norm_inputs((4, 8), torch.float32)
    with pytest.raises(ValueError, match="weight is on"):
        add_rms_norm(x.cuda(), w.cpu())
    with pytest.raises(ValueError, match="residual is on"):
        add_rms_norm(x.cuda(), w.cuda(), residual=x.cpu().clone())


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck(backend):
    x, res, w = _norm_inputs((2, 3, 20), torch.bfloat16)
    torch.library.opcheck(torch.ops.dflash.add_rms_norm.default, (x, w, 1e-6, res, torch.empty_like(x), None, None,
                                                                  backend))
    torch.library.opcheck(torch.ops.dflash.add_rms_norm.default, (x, w.float(), 1e-5, None, torch.empty_like(x),
                                                                  None, None, backend))
    dynamic, base = _conv_operands(2, 3, 20, 2, 5, torch.bfloat16)
    torch.library.opcheck(torch.ops.dflash.add_rms_norm.default, (x, w, 1e-6, res, torch.empty_like(x), dynamic,
                                                                  base, backend))
    torch.library.opcheck(torch.ops.dflash.silu_mul.default, (torch.randn(2, 3, 40), backend))


def test_cpu_backend_resolution():
    """"cpu": the CPU body the wing registered for the op, else its reference (the op's CPU path); CPU tensors
    only; "auto" on CPU tensors takes it unless the Triton interpreter is on. The op lists only its own backends:
    a registered body is what makes "cpu" resolve to "cpu"."""
    from dflash_kernels._dispatch import registered, resolve_backend
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert registered("add_rms_norm", "cpu") is not None
    assert resolve_backend("add_rms_norm", "cpu", cpu, ("triton", "torch")) == "cpu"
    assert registered("an_op_without_a_cpu_body", "cpu") is None
    assert resolve_backend("an_op_without_a_cpu_body", "cpu", cpu, ("triton", "torch")) == "torch"
    with pytest.raises(RuntimeError, match="need CPU tensors"):
        resolve_backend("an_op_without_a_cpu_body", "cpu", cuda, ("triton", "torch"))
    with pytest.raises(RuntimeError, match="need CPU tensors"):
        resolve_backend("add_rms_norm", "cpu", cuda, ("triton", "torch"))
    auto = resolve_backend("add_rms_norm", "auto", cpu, ("triton", "torch"))
    assert auto == ("triton" if os.environ.get("TRITON_INTERPRET") == "1" else "cpu")
