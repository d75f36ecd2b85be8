import pytest
import torch

from helpers.tol import chi2
from dflash_kernels import verify
from dflash_kernels.verify import filter_logits_reference, verify_sample

BACKENDS = ["torch", "triton"]
N_SAMPLES = 4000


def _exact(p: torch.Tensor, draft: torch.Tensor, remove_draft: bool = True) -> torch.Tensor:
    """P[a, t] = probability of accepting exactly a drafts and emitting token t (one request).

    ``remove_draft=False`` is a deliberately wrong residual rule (sample from p_j itself)."""
    b, v = p.shape
    out = torch.zeros(b, v, dtype=torch.float64)
    reach = 1.0
    for a in range(b - 1):
        d = int(draft[a])
        res = p[a].clone()
        if remove_draft:
            res[d] = 0
        res = res / res.sum()
        out[a] = reach * (1 - p[a, d]) * res
        reach = reach * p[a, d]
    out[b - 1] = reach * p[b - 1]
    return out


def _sample_counts(logits_one, draft_one, backend, **kw):
    b, v = logits_one.shape
    logits = logits_one.expand(N_SAMPLES, b, v).contiguous()
    draft = draft_one.expand(N_SAMPLES, b - 1).contiguous()
    acc, tok = verify_sample(logits, draft, backend=backend, **kw)
    assert acc.dtype == torch.int64 and tok.dtype == torch.int64
    assert ((acc >= 0) & (acc <= b - 1)).all() and ((tok >= 0) & (tok < v)).all()
    return torch.bincount(acc * v + tok, minlength=b * v).view(b, v)


def _probs(b, v):
    """Random row distributions with p_j(d_j) in [0.45, 0.75] and every token >= ~2% mass."""
    p = torch.rand(b, v, dtype=torch.float64) + 0.3
    p = p / p.sum(-1, keepdim=True)
    draft = torch.randint(0, v, (b - 1,))
    for j in range(b - 1):
        target = 0.45 + 0.3 * float(torch.rand(()))
        rest = p[j].clone()
        rest[draft[j]] = 0
        p[j] = rest / rest.sum() * (1 - target)
        p[j, draft[j]] = target
    return p, draft


@pytest.mark.parametrize("backend", BACKENDS)
def test_distribution_matches_rule(backend):
    b, v, temp = 3, 6, 0.8
    p, draft = _probs(b, v)
    logits = (temp * p.log()).float()
    counts = _sample_counts(logits, draft, backend, temperature=temp, seed=1234, offset=int(torch.randint(0, 2**40, ())))
    exact = _exact(p, draft)
    stat, crit = chi2(counts, exact, N_SAMPLES)
    assert stat < crit, f"chi2 {stat:.1f} >= {crit:.1f} vs the exact distribution\n{counts}\n{exact * N_SAMPLES}"
    # The same samples must reject a wrong residual rule (keeping the rejected draft token in the residual).
    wrong_stat, wrong_crit = chi2(counts, _exact(p, draft, remove_draft=False), N_SAMPLES)
    assert wrong_stat > wrong_crit, "the test cannot tell the wrong residual rule apart"


@pytest.mark.parametrize("backend", BACKENDS)
def test_top_k_top_p_distribution(backend):
    # Token probabilities (permuted order): top-k=4 keeps {.4,.25,.15,.1}; renormalised, HF top-p=0.7 keeps
    # the two largest (ascending cumulative .111, .278 <= 0.3 are removed).
    base = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04], dtype=torch.float64)
    perm = torch.randperm(6)
    p_rows = torch.stack([base[perm], base[torch.randperm(6)]])
    logits = p_rows.log().float()
    where = torch.argsort(perm)  # where[k] = position of base[k] in row 0
    kept0 = {int(where[0]), int(where[1])}
    z = filter_logits_reference(logits, 1.0, top_k=4, top_p=0.7)
    assert {int(i) for i in torch.nonzero(z[0] > float("-inf")).flatten()} == kept0
    filtered = torch.softmax(z.double(), -1)
    draft = torch.tensor([int(where[0])])
    counts = _sample_counts(logits, draft, backend, temperature=1.0, top_k=4, top_p=0.7, seed=7, offset=3)
    stat, crit = chi2(counts, _exact(filtered, draft), N_SAMPLES)
    assert stat < crit, f"chi2 {stat:.1f} >= {crit:.1f}\n{counts}"
    # The same samples must reject a wrong filter (top-k only, top-p ignored).
    top_k_only = torch.softmax(filter_logits_reference(logits, 1.0, top_k=4).double(), -1)
    wrong_stat, wrong_crit = chi2(counts, _exact(top_k_only, draft), N_SAMPLES)
    assert wrong_stat > wrong_crit, "the test cannot tell a filter without top-p apart"


def test_filter_keeps_ties_and_at_least_one():
    z = filter_logits_reference(torch.tensor([[1.0, 3.0, 3.0, 2.0]]), 1.0, top_k=1)
    assert torch.isfinite(z).tolist() == [[False, True, True, False]]
    z = filter_logits_reference(torch.tensor([[0.0, 10.0, 1.0]]), 1.0, top_p=0.01)
    assert torch.isfinite(z).tolist() == [[False, True, False]]


@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.97])
def test_top_p_matches_transformers_warper(top_p, seed):
    """The reference's top-p (the nucleus ranked by topk, a row whose nucleus reaches past TOP_P_CANDIDATES sorted
    whole) keeps what transformers' TopPLogitsWarper keeps, but for tokens at the boundary itself: the two sum the
    probabilities in other orders, so a token whose cumulative probability lies within rounding of 1 - top_p may
    go either way (HF's ascending cumsum over the whole vocabulary is itself rounded)."""
    from transformers import TopPLogitsWarper

    g = torch.Generator().manual_seed(seed)
    v = 3000
    scales = torch.tensor([0.3, 1.0, 2.0, 4.0, 8.0, 16.0])[:, None]  # nuclei from thousands of tokens to one
    z = torch.randn(len(scales), v, generator=g) * scales
    kept = torch.isfinite(filter_logits_reference(z, 1.0, top_p=top_p))
    want = torch.isfinite(TopPLogitsWarper(top_p)(None, z.clone()))
    sizes = kept.sum(-1)
    assert (sizes > verify.TOP_P_CANDIDATES).any() and (sizes < verify.TOP_P_CANDIDATES).any()  # both paths
    ranked, order = torch.sort(z, dim=-1)
    cum = torch.zeros_like(z).scatter_(-1, order, ranked.softmax(-1).cumsum(-1))  # HF's ascending cumsum
    differ = kept != want
    assert differ.sum() <= 4 and ((cum[differ] - (1 - top_p)).abs() < 1e-5).all(), cum[differ] - (1 - top_p)
    assert kept[torch.arange(len(z)), z.argmax(-1)].all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_same_seed_offset_same_tokens(backend, dtype):
    n, b, v = 9, 7, 2500
    logits = (torch.randn(n, b, v) * 3).to(dtype)
    draft = logits.float().argmax(-1)[:, :-1].clone()
    draft[::2, 1] = torch.randint(0, v, (draft[::2].shape[0],))
    a1 = verify_sample(logits, draft, temperature=0.9, seed=5, offset=11, backend=backend)
    a2 = verify_sample(logits, draft, temperature=0.9, seed=torch.tensor([5]), offset=torch.tensor(11), backend=backend)
    assert torch.equal(a1[0], a2[0]) and torch.equal(a1[1], a2[1])
    small = logits[:, :, :64].contiguous()
    outs = {tuple(verify_sample(small, draft % 64, temperature=5.0, seed=5, offset=o, backend=backend)[1].tolist())
            for o in range(4)}
    assert len(outs) > 1, "different offsets gave identical tokens"


@pytest.mark.parametrize("backend", BACKENDS)
def test_block_size_one_is_plain_sampling(backend):
    v = 5
    p = torch.tensor([[0.1, 0.2, 0.3, 0.15, 0.25]], dtype=torch.float64)
    counts = _sample_counts(p.log().float(), torch.zeros(0, dtype=torch.int64), backend, temperature=1.0, seed=3,
                            offset=0)
    stat, crit = chi2(counts, p, N_SAMPLES)
    assert stat < crit and counts.shape == (1, v)


def test_bad_inputs():
    logits = torch.randn(2, 3, 10)
    draft = torch.zeros(2, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="temperature"):
        verify_sample(logits, draft, temperature=0.0, seed=0, offset=0)
    with pytest.raises(ValueError, match="top_p"):
        verify_sample(logits, draft, temperature=1.0, top_p=0.0, seed=0, offset=0)
    with pytest.raises(ValueError, match="top_k"):
        verify_sample(logits, draft, temperature=1.0, top_k=-1, seed=0, offset=0)
    with pytest.raises(ValueError, match="offset"):
        verify_sample(logits, draft, temperature=1.0, seed=0, offset=torch.tensor([1, 2]))
    with pytest.raises(TypeError, match="seed"):
        verify_sample(logits, draft, temperature=1.0, seed=1.5, offset=0)
    with pytest.raises(ValueError, match="draft_tokens"):
        verify_sample(logits, draft[:, :1], temperature=1.0, seed=0, offset=0)


def _triton_threshold(logits, temperature, top_k, top_p):
    """(keys, thr): the Triton filter keeps token x of row (n, j) iff keys[n, j, x] >= thr[n, j]. Parameters are
    scalars, or [N] tensors (per request: both filters run, as in verify_sample)."""
    from dflash_kernels.verify import _filter_threshold, order_key_reference

    n, b, v = logits.shape
    per_request = isinstance(top_k, torch.Tensor)
    temp = torch.as_tensor(temperature, dtype=torch.float32).reshape(-1)
    thr = _filter_threshold(logits, temp, torch.as_tensor(top_k, dtype=torch.int32).reshape(-1),
                            torch.as_tensor(top_p, dtype=torch.float32).reshape(-1),
                            per_request or 0 < top_k < v, per_request or top_p < 1.0)
    return order_key_reference(logits.float() * (1.0 / temp).view(-1, 1, 1)), thr.view(n, b, 1)


def _triton_kept(logits, temperature, top_k, top_p):
    keys, thr = _triton_threshold(logits, temperature, top_k, top_p)
    return keys >= thr


@pytest.mark.parametrize("case", range(8))
def test_in_kernel_filter_matches_hf_rule(case):
    n, b = 2, 3
    v = [7, 300, 2500, 4099][case % 4]
    logits = torch.randn(n, b, v) * 3
    top_k = [0, 1, 5, v + 2, 50, 0, 3, 200][case]
    top_p = [0.3, 1.0, 0.9, 0.5, 0.95, 0.05, 1.0, 0.7][case]
    if top_k == 0 and top_p == 1.0:
        top_p = 0.6
    kept = _triton_kept(logits, 0.7, top_k, top_p)
    ref = torch.isfinite(filter_logits_reference(logits, 0.7, top_k, top_p))
    assert torch.equal(kept, ref)


def test_in_kernel_filter_ties_keep_the_whole_boundary_group():
    """With exact ties at the top-p boundary HF's (unstable) sort may split the tied group; the kernel keeps
    all of it: kept = {z >= smallest z that HF keeps}. top-k ties are kept by both."""
    logits = (torch.randn(3, 4, 600) * 2).round()
    for top_k, top_p in ((0, 0.5), (40, 1.0), (40, 0.8), (3, 0.9)):
        kept = _triton_kept(logits, 1.0, top_k, top_p)
        z = filter_logits_reference(logits, 1.0, top_k, top_p)
        floor = torch.where(torch.isfinite(z), z, torch.full_like(z, float("inf"))).amin(-1, keepdim=True)
        assert torch.equal(kept, logits >= floor)
        assert (kept >= torch.isfinite(z)).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_request_parameters(backend):
    """Requests with different temperature / top-k / top-p in one batch: each follows its own rule."""
    b, v = 3, 6
    p, draft = _probs(b, v)
    temps = torch.tensor([0.5, 1.0, 2.0])
    ks = torch.tensor([0, 3, 2])
    ps = torch.tensor([1.0, 0.9, 0.6])
    per = N_SAMPLES // 2
    logits = p.log().float()[None].expand(3 * per, b, v).contiguous()
    drafts = draft[None].expand(3 * per, b - 1).contiguous()
    rows = torch.arange(3).repeat_interleave(per)
    acc, tok = verify_sample(logits, drafts, temperature=temps[rows], top_k=ks[rows], top_p=ps[rows], seed=9,
                             offset=4, backend=backend)
    for i in range(3):
        sel = rows == i
        counts = torch.bincount(acc[sel] * v + tok[sel], minlength=b * v).view(b, v)
        z = filter_logits_reference(p.log().float()[None], float(temps[i]), int(ks[i]), float(ps[i]))[0]
        stat, crit = chi2(counts, _exact(torch.softmax(z.double(), -1), draft), per)
        assert stat < crit, f"request group {i}: chi2 {stat:.1f} >= {crit:.1f}\n{counts}"


def test_per_request_parameter_errors():
    logits = torch.randn(2, 3, 10)
    draft = torch.zeros(2, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="temperature"):
        verify_sample(logits, draft, temperature=torch.ones(3), seed=0, offset=0)
    with pytest.raises(TypeError, match="top_k"):
        verify_sample(logits, draft, temperature=1.0, top_k=torch.ones(2), seed=0, offset=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_distribution_across_vocab_splits(backend):
    """V > one vocab split (2048 under the interpreter): the LSE and Gumbel winners are merged across splits."""
    b, v, n = 2, 2100, 1000
    logits = torch.full((b, v), -6.0)
    main = torch.tensor([5, 1030, 1500, 2099])
    logits[0, main] = torch.tensor([2.0, 0.5, 1.5, 1.0])
    logits[1, main] = torch.tensor([0.3, 1.8, 0.1, 1.2])
    draft = torch.tensor([1500])
    p = torch.softmax(logits.double(), -1)
    exact = _exact(p, draft)                                            # [b, v]
    acc, tok = verify_sample(logits[None].expand(n, b, v).contiguous(), draft[None].expand(n, 1).contiguous(),
                             temperature=1.0, seed=21, offset=int(torch.randint(0, 2**40, ())), backend=backend)
    # Cells: (accepted, main token) plus one "any other token" cell per accepted count.
    is_main = (tok[:, None] == main[None, :])
    cell = torch.where(is_main.any(1), acc * 5 + is_main.float().argmax(1), acc * 5 + 4)
    counts = torch.bincount(cell, minlength=b * 5).double()
    other = torch.ones(v, dtype=torch.bool)
    other[main] = False
    probs = torch.cat([torch.cat([exact[a, main], exact[a, other].sum()[None]]) for a in range(b)])
    stat, crit = chi2(counts, probs, n)
    assert stat < crit, f"chi2 {stat:.1f} >= {crit:.1f}\n{counts}\n{probs * n}"


def _tie_closed_reference(logits, temperature, top_k, top_p):
    """Finite tokens the HF rule keeps, closed under ties: {z >= the smallest z HF keeps}. This is the
    kernel's contract; it differs from HF only where HF's unstable sort splits a tied top-p boundary group."""
    z0 = logits.float() / torch.as_tensor(temperature, dtype=torch.float32).view(-1, 1, 1)
    z = filter_logits_reference(logits, temperature, top_k, top_p)
    floor = torch.where(torch.isfinite(z), z, torch.full_like(z, float("inf"))).amin(-1, keepdim=True)
    return (z0 >= floor) & torch.isfinite(z0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("v", [1, 2, 257, 1000, 5003])
def test_threshold_exact_per_request(v, dtype):
    """The radix-select threshold against the reference, one request per (top_k, top_p) pair: off, k = 1,
    k = V, k > V, top_p 1 / tiny / 0.5 / 0.999. Rows: continuous, heavy ties (few distinct values, so the
    k-th value and the top-p boundary sit in tied groups), ties plus -inf tokens, one all-equal and one all
    -inf row. The kept finite tokens must be exactly the tie-closed reference's."""
    b = 2
    params = [(0, 1.0), (1, 1.0), (v, 0.5), (v + 3, 0.999), (max(1, v // 3), 1e-6), (max(1, v // 7), 0.5),
              (0, 0.5), (2, 0.999), (5, 0.9)]
    n = len(params)
    top_k = torch.tensor([k for k, _ in params])
    top_p = torch.tensor([p for _, p in params])
    temperature = torch.linspace(0.5, 1.5, n)
    logits = torch.randn(n, b, v) * 3
    ties = (torch.randn(n, b, v) * 1.5).round()
    kind = (torch.arange(n)[:, None] + torch.arange(b)[None, :]) % 3          # 0 continuous, 1 ties, 2 ties + -inf
    logits = torch.where((kind > 0)[..., None], ties, logits)
    logits[..., ::4] = torch.where((kind == 2)[..., None], float("-inf"), logits[..., ::4])
    logits[4, 0] = 1.25
    logits[6, 1] = float("-inf")
    logits = logits.to(dtype)

    keys, thr = _triton_threshold(logits, temperature, top_k, top_p)
    keys, finite = keys.long(), torch.isfinite(logits.float())
    ref = _tie_closed_reference(logits, temperature, top_k, top_p)
    kept = (keys >= thr) & finite
    bad = (kept != ref).any(-1).nonzero().tolist()
    assert not bad, f"(request, row) with a different kept set: {bad}, params {[params[i] for i, _ in bad]}"

    # Power: a threshold one tie group off either way (the next finite key above or below thr, i.e. any
    # off-by-one-bucket rule at the last digit that changes the kept set) fails this check in every row that
    # has such a group, and the cases do filter, with ties at the threshold.
    big = torch.iinfo(torch.int64).max
    up = torch.where(finite & (keys > thr), keys, big).amin(-1, keepdim=True)
    down = torch.where(finite & (keys < thr), keys, -big).amax(-1, keepdim=True)
    for wrong, exists in ((up, up < big), (down, down > -big)):
        caught = (((keys >= torch.where(exists, wrong, thr)) & finite) != ref).any(-1, keepdim=True)
        assert torch.equal(caught, exists)
    if v >= 257:
        filtered = (ref != finite).any(-1)
        tied_at_thr = ((keys == thr) & finite).sum(-1) > 1
        assert filtered.sum() >= n and (filtered & tied_at_thr).sum() >= 4, (filtered, tied_at_thr)


def test_threshold_launch_count(monkeypatch):
    """threshold_launches is the rule the launcher follows (one histogram launch per digit and filter + 1)."""
    import dflash_kernels.verify as vf

    grids = []
    kernel = vf._threshold_pass_kernel

    class Counting:
        def __getitem__(self, grid):
            grids.append(grid)
            return kernel[grid]

    monkeypatch.setattr(vf, "_threshold_pass_kernel", Counting())
    logits = torch.randn(1, 2, 40)
    for use_top_k, use_top_p in ((True, False), (False, True), (True, True)):
        grids.clear()
        vf._filter_threshold(logits, torch.ones(1), torch.tensor([3], dtype=torch.int32), torch.tensor([0.5]),
                             use_top_k, use_top_p)
        assert len(grids) == vf.threshold_launches(use_top_k, use_top_p)
        # Every histogram launch reads the logits (top-p's first one twice); bins and state come on top.
        assert vf.threshold_bytes(16, 151936, 2, use_top_k, use_top_p) > (len(grids) - 1 + use_top_p) * 16 * 151936 * 2
    assert vf.threshold_launches(False, False) == vf.threshold_bytes(16, 151936, 2, False, False) == 0


@pytest.mark.parametrize("per_request", [False, True])
def test_torch_backend_under_cuda_capture_runs_the_kernels(monkeypatch, per_request):
    """The reference seeds a torch.Generator from host ints, which a CUDA graph cannot hold: under a capture the
    torch backend gives the Triton kernels' tokens (here a capture is simulated: no GPU needed)."""
    logits, drafts = torch.randn(3, 4, 37), torch.randint(0, 37, (3, 3))
    params = dict(temperature=torch.tensor([0.7, 1.0, 1.3]), top_k=torch.tensor([0, 5, 9]),
                  top_p=torch.tensor([1.0, 0.9, 0.5])) if per_request else dict(temperature=0.8, top_k=6, top_p=0.9)
    seed, offset = torch.tensor([11]), torch.tensor([3])
    kernels = verify_sample(logits, drafts, **params, seed=seed, offset=offset, backend="triton")
    monkeypatch.setattr(verify, "cuda_capturing", lambda device: True)
    captured = verify_sample(logits, drafts, **params, seed=seed, offset=offset, backend="torch")
    assert all(torch.equal(a, b) for a, b in zip(captured, kernels))
    monkeypatch.undo()
    eager = [verify_sample(logits, drafts, **params, seed=torch.tensor([s]), offset=offset, backend="torch")
             for s in range(8)]
    kernel_runs = [verify_sample(logits, drafts, **params, seed=torch.tensor([s]), offset=offset, backend="triton")
                   for s in range(8)]
    assert any(not torch.equal(a[1], b[1]) for a, b in zip(eager, kernel_runs)), "eagerly the reference's stream"


# Sparse draft distributions (draft_probs over draft_indices, DFlash2's selector): row j of the draft proposes d_j
# from q_j over K candidate ids; acceptance min(1, p/q), residual max(p - q, 0).
SPARSE_CANDIDATES = torch.tensor([[0, 2, 5], [3, 1, 3], [4, 0, 1]])  # row 1 lists token 3 twice (q adds up)
SPARSE_Q = torch.tensor([[0.5, 0.3, 0.2], [0.4, 0.35, 0.25], [0.6, 0.3, 0.1]], dtype=torch.float64)


def _dense_q(v: int) -> torch.Tensor:
    q = torch.zeros(SPARSE_CANDIDATES.shape[0], v, dtype=torch.float64)
    return q.scatter_add_(1, SPARSE_CANDIDATES, SPARSE_Q)


def _exact_sparse(p: torch.Tensor, draft: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """P[a, t] of the rule with a dense draft distribution q [B-1, V] (one request)."""
    b, v = p.shape
    out = torch.zeros(b, v, dtype=torch.float64)
    reach = 1.0
    for a in range(b - 1):
        d = int(draft[a])
        take = min(1.0, float(p[a, d] / q[a, d]))
        residual = (p[a] - q[a]).clamp_min(0)
        out[a] = reach * (1 - take) * residual / residual.sum()
        reach = reach * take
    out[b - 1] = reach * p[b - 1]
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("top_k", [0, 5])
def test_sparse_draft_distribution_matches_rule(backend, top_k):
    """Every row proposes one of its candidates, q(d) above p(d) at row 0 and below it at row 1; with top_k=5 the
    filter removes a token that row 2's residual would otherwise draw. The same samples reject the one-hot rule."""
    b, v, temp = 4, 6, 0.8
    p = torch.rand(b, v, dtype=torch.float64) + 0.3
    p = p / p.sum(-1, keepdim=True)
    logits = (temp * p.log()).float()
    p = torch.softmax(filter_logits_reference(logits.double(), temp, top_k), -1)
    draft = torch.tensor([0, 3, 0])
    n = N_SAMPLES
    counts = torch.bincount(_sparse_call(logits, draft, n, backend, temperature=temp, top_k=top_k, seed=99,
                                         offset=int(torch.randint(0, 2**40, ()))), minlength=b * v).view(b, v)
    q = _dense_q(v)
    stat, crit = chi2(counts, _exact_sparse(p, draft, q), n)
    assert stat < crit, f"chi2 {stat:.1f} >= {crit:.1f}\n{counts}\n{_exact_sparse(p, draft, q) * n}"
    wrong_stat, wrong_crit = chi2(counts, _exact(p, draft), n)
    assert wrong_stat > wrong_crit, "the test cannot tell the sparse rule from the one-hot one"


def _sparse_call(logits_one, draft_one, n, backend, **kw):
    """``n`` copies of one request through verify_sample with the sparse draft distribution -> a * V + token."""
    b, v = logits_one.shape
    acc, tok = verify_sample(logits_one.expand(n, b, v).contiguous(), draft_one.expand(n, b - 1).contiguous(),
                             draft_probs=SPARSE_Q.float().expand(n, b - 1, 3).contiguous(),
                             draft_indices=SPARSE_CANDIDATES.expand(n, b - 1, 3).contiguous(), backend=backend, **kw)
    assert acc.dtype == tok.dtype == torch.int64 and ((acc >= 0) & (acc < b) & (tok >= 0) & (tok < v)).all()
    return acc * v + tok


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_hot_draft_distribution_equals_plain_proposals(backend, dtype):
    """K = 1 with q = 1 on d_j is the one-hot rule: the same tokens from the same seed and offset, bit for bit."""
    n, b, v = 37, 5, 1000
    logits = (torch.randn(n, b, v) * 2).to(dtype)
    draft = torch.randint(0, v, (n, b - 1))
    temps = torch.rand(n) + 0.5
    for kw in (dict(temperature=0.7), dict(temperature=temps, top_k=torch.full((n,), 40), top_p=torch.full((n,), 0.8))):
        plain = verify_sample(logits, draft, seed=5, offset=3, backend=backend, **kw)
        sparse = verify_sample(logits, draft, seed=5, offset=3, backend=backend, draft_probs=torch.ones(n, b - 1, 1),
                               draft_indices=draft[..., None], **kw)
        assert torch.equal(plain[0], sparse[0]) and torch.equal(plain[1], sparse[1])


def test_sparse_draft_distribution_bad_inputs():
    logits, draft = torch.randn(2, 3, 10), torch.zeros(2, 2, dtype=torch.int64)
    probs, ids = torch.full((2, 2, 4), 0.25), torch.arange(4).expand(2, 2, 4)
    kw = dict(temperature=1.0, seed=0, offset=0)
    with pytest.raises(ValueError, match="pass draft_probs and draft_indices together"):
        verify_sample(logits, draft, draft_probs=probs, **kw)
    with pytest.raises(ValueError, match=r"must both be \[N, B-1, K\] = \[2, 2, K\]"):
        verify_sample(logits, draft, draft_probs=probs[:, :1], draft_indices=ids[:, :1], **kw)
    with pytest.raises(ValueError, match=r"1 <= K <= 64"):
        verify_sample(logits, draft, draft_probs=torch.ones(2, 2, 65), draft_indices=torch.zeros(2, 2, 65).long(),
                      **kw)
    with pytest.raises(ValueError, match=r"draft_indices values must be \[0, 10\)"):
        verify_sample(logits, draft, draft_probs=probs, draft_indices=ids + 7, **kw)
    with pytest.raises(TypeError, match="draft_probs"):
        verify_sample(logits, draft, draft_probs=probs.half(), draft_indices=ids, **kw)


def test_gumbel_max_draws_over_the_possible_tokens():
    """The references' draw: with every entry possible it is Gumbel-max over the whole vector, noise and all; an
    entry at -inf is never drawn, and the draws follow the weights (chi-square); a NaN, or no possible entry, takes
    a uniform for every entry."""
    w = torch.randn(40, dtype=torch.float64)
    for s in range(20):
        g1, g2 = torch.Generator().manual_seed(s), torch.Generator().manual_seed(s)
        u = torch.rand(40, generator=g2, dtype=torch.float64).clamp_min(1e-300)
        assert verify.gumbel_max(w, g1) == int((w - torch.log(-torch.log(u))).argmax())
    sparse = torch.full((40,), float("-inf"), dtype=torch.float64)
    sparse[[3, 17, 31]] = torch.tensor([0.5, 1.0, 0.2]).log().double()
    g = torch.Generator().manual_seed(0)
    draws = torch.tensor([verify.gumbel_max(sparse, g) for _ in range(N_SAMPLES)])
    assert set(draws.tolist()) <= {3, 17, 31}
    counts = torch.bincount(draws, minlength=40)[[3, 17, 31]]
    stat, crit = chi2(counts, torch.tensor([0.5, 1.0, 0.2]) / 1.7, N_SAMPLES)
    assert stat < crit, (stat, crit, counts)
    wrong, wrong_crit = chi2(counts, torch.full((3,), 1 / 3), N_SAMPLES)
    assert wrong > wrong_crit  # the counts tell the weights from a uniform pick among the three
    bad = sparse.clone()
    bad[17] = float("nan")
    for row in (bad, torch.full((40,), float("-inf"), dtype=torch.float64)):
        g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
        u = torch.rand(40, generator=g2, dtype=torch.float64).clamp_min(1e-300)
        assert verify.gumbel_max(row, g1) == int((row - torch.log(-torch.log(u))).argmax())
