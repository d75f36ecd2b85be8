"""torch.ops.dflash_ext.verify_greedy (the compiled op behind backend="ext") against independent torch definitions."""
import pytest
import torch

from dflash_kernels import _ext

from helpers.ext import devices, needs_ext

pytestmark = needs_ext


def _expected(logits, draft):
    """Per-request walk with torch.argmax (first index among ties, NaN is the maximum)."""
    n, b, _ = logits.shape
    am = logits.float().argmax(-1).cpu() if logits.numel() else torch.zeros(n, b, dtype=torch.long)
    draft = draft.cpu()
    acc, bonus = [], []
    for r in range(n):
        a = 0
        while a < b - 1 and int(draft[r, a]) == int(am[r, a]):
            a += 1
        acc.append(a)
        bonus.append(int(am[r, a]))
    return torch.tensor(acc, dtype=torch.int64), torch.tensor(bonus, dtype=torch.int64)


def _drafts(logits, p_break=0.3):
    """Drafts that follow the argmax chain and break it at random places (ragged accepted counts)."""
    n, b, v = logits.shape
    draft = logits.float().argmax(-1)[:, :-1].clone()
    brk = torch.rand(draft.shape, device=draft.device) < p_break
    draft = torch.where(brk, (draft + 1 + torch.randint_like(draft, max(v - 1, 1))) % v, draft)
    return draft.contiguous()


SHAPES = [(1, 1, 1), (5, 1, 7), (3, 2, 2), (4, 16, 1000), (3, 8, 32003), (2, 4, 151936), (0, 4, 10)]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_random(device, dtype, shape):
    logits = torch.randn(shape, device=device).to(dtype)
    draft = _drafts(logits)
    acc, bonus = _ext.verify_greedy(logits, draft)
    e_acc, e_bonus = _expected(logits, draft)
    assert acc.dtype == bonus.dtype == torch.int64 and acc.device == logits.device
    assert torch.equal(acc.cpu(), e_acc) and torch.equal(bonus.cpu(), e_bonus)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("v", [3, 64, 4097, 50000])
def test_ties(device, dtype, v):
    """Small-integer logits: the maximum is tied almost everywhere; first index must win."""
    n, b = 6, 5
    logits = torch.randint(-3, 3, (n, b, v), device=device).to(dtype)
    if v > 100:  # ties at far-apart columns (across vocab splits) too
        top = logits.float().amax(-1, keepdim=True) + 1
        for c in (v - 1, v // 2, v // 3):
            logits[..., c] = top[..., 0].to(dtype)
    draft = _drafts(logits, p_break=0.2)
    acc, bonus = _ext.verify_greedy(logits, draft)
    e_acc, e_bonus = _expected(logits, draft)
    assert torch.equal(acc.cpu(), e_acc) and torch.equal(bonus.cpu(), e_bonus)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nan_and_inf(device, dtype):
    n, b, v = 4, 4, 5000
    logits = torch.randn(n, b, v, device=device).to(dtype)
    logits[0, 0, 4000] = float("nan")
    logits[0, 0, 17] = float("nan")        # first NaN wins
    logits[1, :, :] = float("-inf")        # all -inf: index 0
    logits[2, 1, v - 1] = float("inf")
    draft = _drafts(logits, p_break=0.0)
    acc, bonus = _ext.verify_greedy(logits, draft)
    e_acc, e_bonus = _expected(logits, draft)
    assert torch.equal(acc.cpu(), e_acc) and torch.equal(bonus.cpu(), e_bonus)
    # B = 1: the bonus is the op's own argmax of row 0, where the first NaN (column 17) must win.
    _, bonus0 = _ext.verify_greedy(logits[:, :1].contiguous(), draft[:, :0].contiguous())
    assert int(bonus0[0]) == 17 and int(bonus0[1]) == 0


@pytest.mark.parametrize("device", devices())
def test_int32_drafts_and_strided_logits_via_wrapper(device):
    logits = torch.randn(3, 6, 300, device=device)[:, :, ::2]  # non-contiguous: the wrapper copies
    draft = _drafts(logits).to(torch.int32)
    acc, bonus = _ext.verify_greedy(logits, draft)
    e_acc, e_bonus = _expected(logits, draft)
    assert torch.equal(acc.cpu(), e_acc) and torch.equal(bonus.cpu(), e_bonus)


def test_public_verify_backend_ext_matches_torch():
    try:
        from dflash_kernels.verify import verify_greedy
    except ImportError as exc:  # pragma: no cover - the Triton engineer's module
        pytest.skip(f"dflash_kernels.verify not importable: {exc}")
    logits = torch.randn(5, 8, 3001).to(torch.bfloat16)
    draft = _drafts(logits)
    a1, b1 = verify_greedy(logits, draft, backend="ext")
    a2, b2 = verify_greedy(logits, draft, backend="torch")
    assert torch.equal(a1, a2) and torch.equal(b1, b2)


@pytest.mark.parametrize("make, match", [
    (lambda: (torch.randn(2, 3, 10).to(torch.float64), torch.zeros(2, 2, dtype=torch.long)), "logits must be float32"),
    (lambda: (torch.randint(0, 5, (2, 3, 10)), torch.zeros(2, 2, dtype=torch.long)), "logits must be float32"),
    (lambda: (torch.randn(3, 10), torch.zeros(3, 0, dtype=torch.long)), "logits must be 3-D"),
    (lambda: (torch.randn(2, 3, 10), torch.zeros(2, 3, dtype=torch.long)), "draft_tokens must have shape"),
    (lambda: (torch.randn(2, 3, 10), torch.zeros(2, 2, dtype=torch.int32)), "draft_tokens must have dtype"),
    (lambda: (torch.randn(2, 3, 10), torch.zeros(2, dtype=torch.long)), "draft_tokens must be 2-D"),
    (lambda: (torch.randn(2, 3, 20)[:, :, ::2], torch.zeros(2, 2, dtype=torch.long)), "logits must be contiguous"),
    (lambda: (torch.randn(2, 3, 10), torch.zeros(2, 4, dtype=torch.long)[:, ::2]), "draft_tokens must be contiguous"),
    (lambda: (torch.randn(2, 3, 0), torch.zeros(2, 2, dtype=torch.long)), "non-empty vocabulary"),
    (lambda: (torch.randn(2, 0, 10), torch.zeros(2, 0, dtype=torch.long)), "B >= 1"),
    (lambda: (torch.randn(2, 3, 10), torch.zeros(2, 2, dtype=torch.long, device="meta")), "must be on"),
])
def test_bad_input_raises_naming_the_argument(make, match):
    logits, draft = make()
    with pytest.raises(RuntimeError, match=match):
        torch.ops.dflash_ext.verify_greedy(logits, draft)
