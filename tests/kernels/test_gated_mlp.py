import pytest
import torch

from dflash_kernels import gate_up_silu
from dflash_kernels import gated_mlp, grouped_dynamic_conv
from dflash_kernels.conv_prepare import dynamic_conv_prepare
from dflash_kernels.gated_mlp import MAX_FUSED_ROWS, gate_up_silu_cost, gate_up_silu_reference
from helpers.tol import assert_within_rule

BACKENDS = ["torch", "triton"]
DTYPES = [torch.float32, torch.bfloat16]
# (leading dims of x, K, I): odd K and I (masked K and column tails), one row, leading dims, empty, and
# MAX_FUSED_ROWS + 2 rows (the cuBLAS + silu_mul path).
SHAPES = [((5,), 70, 40), ((1,), 33, 17), ((2, 3), 24, 50), ((0,), 16, 8), ((MAX_FUSED_ROWS + 2,), 20, 12)]


def _inputs(lead, k, i, dtype):
    x = (torch.randn(*lead, k) * 2).to(dtype)
    w = (torch.randn(2 * i, k) * k ** -0.5).to(dtype)
    return x, w


def _storages(*ts):
    return {t.untyped_storage().data_ptr() for t in ts}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lead,k,i", SHAPES)
def test_gate_up_silu(backend, dtype, lead, k, i):
    x, w = _inputs(lead, k, i, dtype)
    out = torch.full((*lead, i), float("nan"), dtype=dtype)
    assert gate_up_silu(x, w, out=out, backend=backend) is out
    assert_within_rule(out, gate_up_silu_reference(x.double(), w.double()), gate_up_silu_reference(x, w),
                       "gate_up_silu")
    fresh = gate_up_silu(x, w, backend=backend)
    assert fresh.shape == (*lead, i) and fresh.dtype == dtype and fresh.is_contiguous()
    assert torch.equal(fresh, out)
    if fresh.numel():
        assert not _storages(fresh) & _storages(x, w), "the output aliases an input"


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_rows_and_fp16(backend):
    """x rows with a stride (a column view of a wider buffer), rows that do not flatten to one stride, fp16."""
    k, i = 24, 20
    wide = torch.randn(7, k + 9)[:, 4:k + 4]
    w = torch.randn(2 * i, k) / 5
    ref = lambda a, b: (gate_up_silu_reference(a.double(), b.double()), gate_up_silu_reference(a, b))  # noqa: E731
    assert_within_rule(gate_up_silu(wide, w, backend=backend), *ref(wide, w))
    permuted = torch.randn(3, 2, k).transpose(0, 1)  # [2, 3, k], rows not one stride apart
    assert_within_rule(gate_up_silu(permuted, w, backend=backend), *ref(permuted, w))
    x16, w16 = _inputs((9,), k, i, torch.float16)
    assert_within_rule(gate_up_silu(x16, w16, backend=backend), *ref(x16, w16))


@pytest.mark.parametrize("rows", [5, MAX_FUSED_ROWS + 1])
def test_empty_k_gives_zeros(rows):
    """K = 0: every projection is an empty sum, 0, so silu(0) * 0 = 0 in every row, as the reference gives (the
    launcher used to reshape to [-1, 0], which raises)."""
    out = torch.full((rows, 3), float("nan"))
    gate_up_silu(torch.randn(rows, 0), torch.randn(6, 0), out=out, backend="triton")
    assert torch.equal(out, gate_up_silu_reference(torch.randn(rows, 0), torch.randn(6, 0)))


def test_bf16_rounds_where_the_reference_rounds():
    """bf16: gate and up rounded to bf16 before silu·mul, as HF's projections are. The GEMM sums K in another
    order than torch's CPU GEMM, so a few fp32 sums fall on the other side of a bf16 rounding boundary:
    at most 2 bf16 steps apart (a gate off by one step moves silu(gate) and the product by one each) and
    at most 1% of the elements not bit-equal (0.008-0.02% over 5 seeds of this shape). Not rounding gate and
    up (silu·mul on the fp32 sums) made 41% of the elements differ, up to 4 steps, and fails here."""
    x, w = _inputs((MAX_FUSED_ROWS,), 200, 300, torch.bfloat16)
    got = gate_up_silu(x, w, backend="triton")
    want = gate_up_silu(x, w, backend="torch")
    steps = (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()
    assert steps.max() <= 2
    assert (steps > 0).float().mean() <= 1e-2, "the kernel does not round where the reference rounds"


@pytest.mark.parametrize("m", [MAX_FUSED_ROWS, MAX_FUSED_ROWS + 1])
def test_path_follows_the_cost_rule(monkeypatch, m):
    """Rows above MAX_FUSED_ROWS take cuBLAS + silu_mul (two launches), the rest the fused kernel (one), as
    gate_up_silu_cost (the traffic accountant's contract) says."""
    calls = []
    unfused = gated_mlp._silu_mul_triton
    monkeypatch.setattr(gated_mlp, "_silu_mul_triton", lambda *a, **kw: calls.append(1) or unfused(*a, **kw))
    x, w = _inputs((m,), 16, 16, torch.float32)
    assert_within_rule(gate_up_silu(x, w, backend="triton"), gate_up_silu_reference(x.double(), w.double()),
                       gate_up_silu_reference(x, w))
    launches, nbytes = gate_up_silu_cost(m, 16, 16, 4)
    assert launches == 1 + len(calls)
    assert nbytes == (m * 16 + 32 * 16 + m * 16) * 4 + (launches - 1) * 4 * m * 16 * 4
    assert gate_up_silu_cost(0, 16, 16, 4) == (0, 0)


def test_bad_inputs():
    x, w = _inputs((4,), 8, 6, torch.float32)
    out = torch.full((4, 6), float("nan"))
    with pytest.raises(ValueError, match=r"weight must be \[2I, K=8\]"):
        gate_up_silu(x, w[:, :5])
    with pytest.raises(ValueError, match=r"weight must be \[2I, K=8\]"):
        gate_up_silu(x, w[:11])
    with pytest.raises(TypeError, match="weight has dtype"):
        gate_up_silu(x, w.to(torch.bfloat16))
    with pytest.raises(ValueError, match="weight must have 2 dims"):
        gate_up_silu(x, w[None])
    with pytest.raises(ValueError, match="weight must be contiguous in its last dim"):
        gate_up_silu(x, torch.randn(8, 12).t())
    with pytest.raises(ValueError, match="x must be contiguous in its last dim"):
        gate_up_silu(torch.randn(8, 4).t(), w)
    with pytest.raises(TypeError, match="x has dtype"):
        gate_up_silu(x.long(), w)
    with pytest.raises(ValueError, match="0-d"):
        gate_up_silu(torch.tensor(1.0), w)
    with pytest.raises(ValueError, match=r"out must be a contiguous tensor of shape \(4, 6\)"):
        gate_up_silu(x, w, out=torch.empty(4, 12))
    with pytest.raises(ValueError, match="not contiguous"):
        gate_up_silu(x, w, out=torch.empty(6, 4).t())
    with pytest.raises(TypeError, match="out has dtype"):
        gate_up_silu(x, w, out=torch.empty(4, 6, dtype=torch.float64))
    with pytest.raises(ValueError, match="backend"):
        gate_up_silu(x, w, backend="ext")
    with pytest.raises(ValueError, match="backend"):
        gate_up_silu(x, w, out=out, backend="cuda")
    assert torch.isnan(out).all(), "a rejected call must not write out"


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck(backend):
    x, w = _inputs((2, 3), 20, 12, torch.bfloat16)
    torch.library.opcheck(torch.ops.dflash.gate_up_silu.default, (x, w, x.new_empty(2, 3, 12), None, None, backend))
    dynamic, base = _conv_inputs(2, 3, 20, 2, 4, torch.bfloat16)
    torch.library.opcheck(torch.ops.dflash.gate_up_silu.default,
                          (x, w, x.new_empty(2, 3, 12), dynamic, base, backend))


# DFlash2's prepare convolution in the x-tile load: (N, B, K, I, taps, G): odd block sizes (one x tile spans
# several requests' rows), more taps than rows, G = 1 and G = K, masked K and column tails, and N*B above
# MAX_FUSED_ROWS (grouped_dynamic_conv, then cuBLAS + silu_mul).
CONV_SHAPES = [(3, 7, 40, 24, 3, 8), (2, 5, 24, 17, 2, 1), (1, 2, 12, 9, 5, 12), (2, 16, 96, 50, 2, 16),
               (0, 4, 16, 8, 2, 4), (10, 13, 16, 12, 2, 4)]


def _conv_inputs(n, b, k, taps, g, dtype):
    """One side's dynamic kernels (a view of a [N, B, 2, taps, K/G] projection output, as the engine passes) and
    its fp32 base."""
    proj = (0.5 * torch.randn(n, b, 2, taps, k // g)).to(dtype)
    return proj[:, :, 0], torch.randn(taps, k)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,b,k,i,taps,g", CONV_SHAPES)
def test_gate_up_silu_with_conv(backend, dtype, n, b, k, i, taps, g):
    wide = (torch.randn(n, b, k + 6) * 2).to(dtype)
    x = wide[..., 3:k + 3]  # rows of a wider buffer
    w = (torch.randn(2 * i, k) * k ** -0.5).to(dtype)
    projection = (torch.randn(2 * taps * (k // g), k) * k ** -0.5).to(dtype)
    base = torch.randn(taps, k)
    # the engine's operands: prepare's dynamic kernels (side 0) and, for the rows it materialised, its output
    convolved, dynamic = dynamic_conv_prepare(x, projection, base, backend=backend)
    dynamic = dynamic[:, :, 0]
    before = [t.clone() for t in (x, dynamic, base)]
    out = torch.full((n, b, i), float("nan"), dtype=dtype)  # an element not written stays NaN
    assert gate_up_silu(x, w, out=out, conv_dynamic=dynamic, conv_base=base, backend=backend) is out
    assert all(torch.equal(t, c) for t, c in zip((x, dynamic, base), before)), "an input was written"
    assert_within_rule(out, gate_up_silu_reference(x.double(), w.double(), dynamic.double(), base.double()),
                       gate_up_silu_reference(x, w, dynamic, base), "gate_up_silu conv")
    # bit for bit what the materialised rows gave: the convolution rounded once, where prepare stored it (above
    # MAX_FUSED_ROWS, where grouped_dynamic_conv stores it), then the same GEMM
    if n * b > MAX_FUSED_ROWS:
        convolved = grouped_dynamic_conv(x, dynamic, base, backend=backend)
    assert torch.equal(out, gate_up_silu(convolved, w, backend=backend))


@pytest.mark.parametrize("m", [MAX_FUSED_ROWS, MAX_FUSED_ROWS + 1])
def test_conv_path_follows_the_cost_rule(monkeypatch, m):
    """With a convolution: one launch up to MAX_FUSED_ROWS rows; above, grouped_dynamic_conv, cuBLAS and
    silu_mul (three), with the convolved rows written and read back, as gate_up_silu_cost says."""
    calls = []
    for name in ("_silu_mul_triton", "_grouped_dynamic_conv_triton"):
        unfused = getattr(gated_mlp, name)
        monkeypatch.setattr(gated_mlp, name, lambda *a, _f=unfused, **kw: calls.append(1) or _f(*a, **kw))
    x = torch.randn(1, m, 16)
    w = torch.randn(32, 16) / 4
    dynamic, base = _conv_inputs(1, m, 16, 2, 4, torch.float32)
    assert_within_rule(gate_up_silu(x, w, conv_dynamic=dynamic, conv_base=base, backend="triton"),
                       gate_up_silu_reference(x.double(), w.double(), dynamic.double(), base.double()),
                       gate_up_silu_reference(x, w, dynamic, base))
    conv_bytes = (dynamic.numel() + base.numel()) * 4
    launches, nbytes = gate_up_silu_cost(m, 16, 16, 4, conv_bytes)
    assert launches == 1 + len(calls)
    fused = (m * 16 + 32 * 16 + m * 16) * 4 + conv_bytes
    assert nbytes == (fused if launches == 1 else fused + 4 * m * 16 * 4 + 2 * m * 16 * 4)


def test_conv_bad_inputs_raise_before_work():
    x = torch.randn(2, 5, 8)
    w = torch.randn(12, 8)
    dynamic, base = _conv_inputs(2, 5, 8, 2, 4, torch.float32)
    out = torch.full((2, 5, 6), float("nan"))
    with pytest.raises(ValueError, match="pass conv_dynamic and conv_base together"):
        gate_up_silu(x, w, out=out, conv_dynamic=dynamic)
    with pytest.raises(ValueError, match=r"conv_dynamic must have shape \(2, 5, 2, 2\)"):
        gate_up_silu(x, w, out=out, conv_dynamic=torch.randn(2, 5, 3, 2), conv_base=base)
    with pytest.raises(ValueError, match="x must have 3 dims"):
        gate_up_silu(x.view(10, 8), w, conv_dynamic=dynamic, conv_base=base)
    with pytest.raises(TypeError, match="conv_dynamic has dtype"):
        gate_up_silu(x, w, out=out, conv_dynamic=dynamic.double(), conv_base=base)
    with pytest.raises(ValueError, match="conv_base must be contiguous"):
        gate_up_silu(x, w, out=out, conv_dynamic=dynamic, conv_base=torch.randn(8, 2).t())
    shared = torch.randn(2, 5, 8)
    with pytest.raises(ValueError, match="out overlaps x"):
        gate_up_silu(shared, torch.randn(2 * 8, 8), out=shared, conv_dynamic=dynamic, conv_base=base)
    assert torch.isnan(out).all(), "a rejected call must not write out"
