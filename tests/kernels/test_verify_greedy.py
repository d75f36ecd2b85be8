import pytest
import torch

from dflash_kernels import _ext
from dflash_kernels.verify import verify_greedy, verify_greedy_tokens
from helpers.device import DEVICE

BACKENDS = (["torch", "triton"] + (["ext"] if _ext.status(torch.device(DEVICE))[0] else [])
            + (["cpu"] if DEVICE == "cpu" else []))


def _expected(logits, draft):
    """Independent definition: a per-request Python walk with torch.argmax."""
    n, b, _ = logits.shape
    acc, bonus = [], []
    for r in range(n):
        a = 0
        while a < b - 1 and int(draft[r, a]) == int(torch.argmax(logits[r, a])):
            a += 1
        acc.append(a)
        bonus.append(int(torch.argmax(logits[r, a])))
    return torch.tensor(acc, dtype=torch.int64), torch.tensor(bonus, dtype=torch.int64)


def _make(n, b, v, dtype, tie_cols=()):
    logits = torch.randn(n, b, v).to(dtype)
    for r in range(n):
        for j in range(b):
            if tie_cols and torch.rand(()) < 0.7:
                # Exact ties at the maximum, including across vocab-split boundaries.
                top = logits[r, j].float().max() + 1
                for c in tie_cols:
                    if c < v:
                        logits[r, j, c] = top.to(dtype)
    target = logits.argmax(-1)
    draft = target[:, :-1].clone()
    # Random accepted-prefix lengths: break the chain at a random position (or not at all).
    for r in range(n):
        cut = int(torch.randint(0, b + 1, ()))
        if cut < b - 1:
            draft[r, cut] = (draft[r, cut] + 1 + int(torch.randint(0, v - 1, ()))) % v if v > 1 else 0
    return logits, draft


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,b,v", [(1, 1, 7), (3, 2, 3001), (5, 16, 2500), (2, 7, 4099)])
def test_matches_argmax_walk(backend, dtype, n, b, v):
    logits, draft = _make(n, b, v, dtype, tie_cols=(v - 1, 2049, 5, 2047))
    acc, bonus = verify_greedy(logits, draft, backend=backend)
    exp_acc, exp_bonus = _expected(logits, draft)
    assert acc.dtype == torch.int64 and bonus.dtype == torch.int64
    assert torch.equal(acc, exp_acc)
    assert torch.equal(bonus, exp_bonus)


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_accepted_and_first_rejected(backend):
    logits = torch.randn(2, 5, 300)
    target = logits.argmax(-1)
    draft = target[:, :-1].clone()
    draft[1, 0] = (draft[1, 0] + 1) % 300
    acc, bonus = verify_greedy(logits, draft, backend=backend)
    assert acc.tolist() == [4, 0]
    assert bonus.tolist() == [int(target[0, 4]), int(target[1, 0])]


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_and_all_inf_rows_follow_torch(backend):
    logits = torch.randn(3, 3, 2100)
    logits[0, 0, 2090] = float("nan")
    logits[0, 0, 2095] = float("nan")
    logits[1, 0, :] = float("-inf")
    logits[2, 1, 7] = float("inf")
    logits[2, 1, 2080] = float("inf")
    draft = logits.argmax(-1)[:, :-1].clone()
    acc, bonus = verify_greedy(logits, draft, backend=backend)
    exp_acc, exp_bonus = _expected(logits, draft)
    assert torch.equal(acc, exp_acc) and torch.equal(bonus, exp_bonus)


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_and_int32_drafts(backend):
    big = torch.randn(3, 6, 500)
    logits = big[:, 1:5]                      # [3, 4, 500], non-contiguous batch stride
    draft = logits.argmax(-1)[:, :-1].to(torch.int32)
    draft[0, 2] += 1
    acc, bonus = verify_greedy(logits, draft, backend=backend)
    exp_acc, exp_bonus = _expected(logits, draft)
    assert torch.equal(acc, exp_acc) and torch.equal(bonus, exp_bonus)


def test_ext_backend_rule():
    logits, draft = _make(2, 3, 50, torch.float32)
    if _ext.status(logits.device)[0]:
        acc, bonus = verify_greedy(logits, draft, backend="ext")
        exp_acc, exp_bonus = _expected(logits, draft)
        assert torch.equal(acc, exp_acc) and torch.equal(bonus, exp_bonus)
    else:
        with pytest.raises(RuntimeError, match="ext"):
            verify_greedy(logits, draft, backend="ext")


def test_bad_inputs():
    logits = torch.randn(2, 4, 10)
    with pytest.raises(ValueError, match="draft_tokens"):
        verify_greedy(logits, torch.zeros(2, 4, dtype=torch.int64))
    with pytest.raises(TypeError, match="draft_tokens"):
        verify_greedy(logits, torch.zeros(2, 3))
    with pytest.raises(ValueError, match="logits"):
        verify_greedy(logits[0], torch.zeros(2, 3, dtype=torch.int64))
    with pytest.raises(TypeError, match="logits"):
        verify_greedy(logits.double(), torch.zeros(2, 3, dtype=torch.int64))


TOKEN_BACKENDS = ["torch", "triton"] + (["cpu"] if DEVICE == "cpu" else [])


@pytest.mark.parametrize("backend", TOKEN_BACKENDS)
@pytest.mark.parametrize("n,b,v", [(1, 1, 7), (3, 2, 3001), (5, 16, 2500), (0, 4, 9)])
def test_tokens_variant_is_the_logits_rule(backend, n, b, v):
    """verify_greedy_tokens on argmax(logits) = verify_greedy on the logits (ties and NaN rows included), int32
    tokens too; a rule that reads the bonus one row late (a plausible off-by-one) is shown to differ."""
    logits, draft = _make(n, b, v, torch.float32, tie_cols=(v - 1, 5))
    if n:
        logits[0, 0, v // 2] = float("nan")
    target = logits.argmax(-1)
    exp_acc, exp_bonus = _expected(logits, draft)
    for t in (target, target.to(torch.int32)):
        acc, bonus = verify_greedy_tokens(t, draft, backend=backend)
        assert acc.dtype == bonus.dtype == torch.int64
        assert torch.equal(acc, exp_acc) and torch.equal(bonus, exp_bonus)
    if n and b > 1:
        late = target.gather(1, (exp_acc + 1).clamp(max=b - 1)[:, None]).squeeze(1)
        assert not torch.equal(late, exp_bonus) or bool((exp_acc == b - 1).all())


def test_tokens_variant_bad_inputs():
    target = torch.zeros(2, 4, dtype=torch.int64)
    with pytest.raises(ValueError, match="draft_tokens"):
        verify_greedy_tokens(target, torch.zeros(2, 4, dtype=torch.int64))
    with pytest.raises(TypeError, match="target_tokens"):
        verify_greedy_tokens(target.float(), torch.zeros(2, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="target_tokens"):
        verify_greedy_tokens(target[0], torch.zeros(2, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="B >= 1"):
        verify_greedy_tokens(target[:, :0], torch.zeros(2, 0, dtype=torch.int64))
