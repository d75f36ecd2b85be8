import pytest
import torch

from dflash_kernels import grouped_dynamic_conv, qkv_proj
from dflash_kernels.qkv_proj import qkv_proj_cost, qkv_proj_reference
from helpers.tol import assert_within_rule

BACKENDS = ["torch", "triton"]
DTYPES = [torch.float32, torch.bfloat16]
# (M, q_rows, K, N, q_cols): odd K, N and q_cols (masked tails, a column tile holding Q and K/V columns), no
# context rows, no block rows, no Q columns, all Q columns, empty, and M = 70 over 35 block rows with q_cols = 64
# (the interpreter's 32-row, 64-column tiles: a Q-only column tile whose third row tile holds no block row).
SHAPES = [(37, 21, 70, 90, 40), (5, 5, 33, 17, 9), (40, 0, 24, 50, 30), (12, 6, 16, 20, 0), (12, 6, 16, 20, 20),
          (0, 0, 16, 8, 4), (70, 35, 20, 130, 64)]


def _check_written(out, x, w, q_rows, q_cols, dynamic=None, base=None, what=""):
    """out holds the reference but in [q_rows:, :q_cols], which stays NaN (never written)."""
    d = None if dynamic is None else (dynamic.double(), base.double())
    want64 = qkv_proj_reference(x.double(), w.double(), q_rows, *(d or (None, None)))
    want = qkv_proj_reference(x, w, q_rows, dynamic, base)
    assert torch.isnan(out[q_rows:, :q_cols]).all(), f"{what}: a context row's Q column was written"
    assert_within_rule(out[:q_rows], want64[:q_rows], want[:q_rows], what)
    assert_within_rule(out[q_rows:, q_cols:], want64[q_rows:, q_cols:], want[q_rows:, q_cols:], what)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,q_rows,k,n,q_cols", SHAPES)
def test_qkv_proj(backend, dtype, m, q_rows, k, n, q_cols):
    wide = (torch.randn(m, k + 5) * 2).to(dtype)
    x = wide[:, 2:k + 2]  # rows of a wider buffer
    w = (torch.randn(n, k) * k ** -0.5).to(dtype)
    out = torch.full((m, n), float("nan"), dtype=dtype)
    assert qkv_proj(x, w, q_cols=q_cols, q_rows=q_rows, out=out, backend=backend) is out
    _check_written(out, x, w, q_rows, q_cols, what="qkv_proj")
    fresh = qkv_proj(x, w, q_cols=q_cols, q_rows=q_rows, backend=backend)
    assert torch.equal(fresh[:q_rows], out[:q_rows]) and torch.equal(fresh[q_rows:, q_cols:], out[q_rows:, q_cols:])


def _conv_inputs(n, b, k, taps, g, dtype):
    """One side's dynamic kernels (a view of a [n, B, 2, taps, K/G] projection output, as the engine passes) and
    its fp32 base."""
    proj = (0.5 * torch.randn(n, b, 2, taps, k // g)).to(dtype)
    return proj[:, :, 0], torch.randn(taps, k)


# DFlash2's prepare convolution of the block rows in the x-tile load: (n, B, context rows, K, N, q_cols, taps, G):
# odd block sizes (a 32-row tile spans several requests' rows and the block/context boundary), more taps than rows,
# G = 1 and G = K, masked tails, the engine's layout (as many context rows as block rows) and no context rows.
CONV_SHAPES = [(3, 7, 21, 40, 50, 24, 3, 8), (2, 5, 10, 24, 17, 9, 2, 1), (1, 2, 2, 12, 9, 4, 5, 12),
               (2, 16, 32, 96, 80, 64, 2, 16), (4, 3, 0, 16, 12, 8, 2, 4), (0, 4, 6, 16, 8, 4, 2, 4)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,b,ctx,k,nc,q_cols,taps,g", CONV_SHAPES)
def test_qkv_proj_with_conv(backend, dtype, n, b, ctx, k, nc, q_cols, taps, g):
    q_rows = n * b
    wide = (torch.randn(q_rows + ctx, k + 6) * 2).to(dtype)
    x = wide[:, 3:k + 3]
    w = (torch.randn(nc, k) * k ** -0.5).to(dtype)
    dynamic, base = _conv_inputs(n, b, k, taps, g, dtype)
    before = [t.clone() for t in (x, dynamic, base)]
    out = torch.full((q_rows + ctx, nc), float("nan"), dtype=dtype)
    assert qkv_proj(x, w, q_cols=q_cols, q_rows=q_rows, out=out, conv_dynamic=dynamic, conv_base=base,
                    backend=backend) is out
    assert all(torch.equal(t, c) for t, c in zip((x, dynamic, base), before)), "an input was written"
    _check_written(out, x, w, q_rows, q_cols, dynamic, base, "qkv_proj conv")
    # bit for bit what the materialised rows give: the convolution rounded once where grouped_dynamic_conv stores
    # it, then the same GEMM
    convolved = torch.cat([grouped_dynamic_conv(x[:q_rows].reshape(n, b, k), dynamic, base,
                                                backend=backend).reshape(q_rows, k), x[q_rows:]])
    plain = torch.full_like(out, float("nan"))
    qkv_proj(convolved, w, q_cols=q_cols, q_rows=q_rows, out=plain, backend=backend)
    assert torch.equal(out.nan_to_num(), plain.nan_to_num())


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck(backend):
    x = torch.randn(12, 20).to(torch.bfloat16)
    w = torch.randn(18, 20).to(torch.bfloat16)
    out = torch.zeros(12, 18, dtype=torch.bfloat16)  # opcheck compares every element: none left unwritten
    torch.library.opcheck(torch.ops.dflash.qkv_proj.default, (x, w, out, 0, 12, None, None, backend))
    dynamic, base = _conv_inputs(2, 3, 20, 2, 4, torch.bfloat16)
    torch.library.opcheck(torch.ops.dflash.qkv_proj.default, (x, w, out, 8, 6, dynamic, base, backend))


def test_bad_inputs_raise_before_work():
    x = torch.randn(20, 8)
    w = torch.randn(12, 8)
    dynamic, base = _conv_inputs(2, 5, 8, 2, 4, torch.float32)
    out = torch.full((20, 12), float("nan"))
    with pytest.raises(ValueError, match=r"q_cols must be in \[0, N=12\]"):
        qkv_proj(x, w, q_cols=13, q_rows=10, out=out)
    with pytest.raises(ValueError, match=r"q_rows must be in \[0, M=20\]"):
        qkv_proj(x, w, q_cols=4, q_rows=-1, out=out)
    with pytest.raises(ValueError, match=r"weight must be \[N, K=8\]"):
        qkv_proj(x, torch.randn(12, 9), q_cols=4, q_rows=10, out=out)
    with pytest.raises(ValueError, match="x must have 2 dims"):
        qkv_proj(x.view(2, 10, 8), w, q_cols=4, q_rows=10)
    with pytest.raises(ValueError, match="conv_dynamic must be \\[n, B, K, H/G\\] with n \\* B = q_rows = 12"):
        qkv_proj(x, w, q_cols=4, q_rows=12, out=out, conv_dynamic=dynamic, conv_base=base)
    with pytest.raises(ValueError, match="pass conv_dynamic and conv_base together"):
        qkv_proj(x, w, q_cols=4, q_rows=10, out=out, conv_dynamic=dynamic)
    with pytest.raises(TypeError, match="conv_dynamic has dtype"):
        qkv_proj(x, w, q_cols=4, q_rows=10, out=out, conv_dynamic=dynamic.double(), conv_base=base)
    with pytest.raises(ValueError, match=r"out must be a contiguous tensor of shape \(20, 12\)"):
        qkv_proj(x, w, q_cols=4, q_rows=10, out=torch.empty(20, 11))
    shared = torch.randn(20, 12)
    with pytest.raises(ValueError, match="out overlaps x"):
        qkv_proj(shared[:, :8], w, q_cols=4, q_rows=10, out=shared)
    assert torch.isnan(out).all(), "a rejected call must not write out"


def test_cost_rule_reads_the_weight_once_per_row_tile():
    """Qwen3-8B's draft layer (K 4096, N 6144, 4096 Q columns), bf16: batch 8 (256 rows over 128 block rows) is one
    row tile, the weight read once; 512 rows are two K/V row tiles (Q columns: one, 256 block rows)."""
    k, n, q_cols, e = 4096, 6144, 4096, 2
    launches, nbytes, reads = qkv_proj_cost(256, 128, k, n, q_cols, e, conv_bytes=1000)
    assert (launches, reads) == (1, 1)
    assert nbytes == 256 * k * e + n * k * e + (128 * n + 128 * (n - q_cols)) * e + 1000
    launches, nbytes, reads = qkv_proj_cost(512, 256, k, n, q_cols, e)
    assert (launches, reads) == (1, 2)
    assert nbytes == 512 * k * e + (q_cols + 2 * (n - q_cols)) * k * e + (256 * n + 256 * (n - q_cols)) * e
    assert qkv_proj_cost(0, 0, k, n, q_cols, e) == (0, 0, 0)
