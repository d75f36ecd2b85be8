import pytest
import torch

from dflash_kernels.candidate_select import candidate_select, candidate_select_reference, top_k_candidates
from helpers.device import DEVICE
from helpers.tol import chi2

BACKENDS = ["torch", "triton", pytest.param("cpu", marks=pytest.mark.skipif(DEVICE != "cpu", reason="CPU tensors only"))]
# (N, P, V, r, k): k = V, k = 1, odd rank, a vocabulary over several tiles, empty batches
SHAPES = [(3, 5, 300, 12, 6), (2, 1, 7, 3, 7), (4, 3, 50, 5, 1), (1, 4, 5000, 33, 16), (0, 4, 20, 4, 3),
          (2, 0, 20, 4, 3)]


def _inputs(n, p, v, r, dtype, strided=False):
    """Selector inputs; bf16 logits rounded to a coarse grid so that equal logits (ties) occur."""
    pad = 5 if strided else 0
    logits = (torch.randn(n, p, v + pad, device=DEVICE) * 3)[..., :v]
    if dtype == torch.bfloat16:
        logits = (logits * 2).round() / 2
    proj = torch.randn(n, p, r, device=DEVICE).to(dtype)
    pred, succ = torch.randn(v, r, device=DEVICE).to(dtype), torch.randn(v, r, device=DEVICE).to(dtype)
    return logits.to(dtype), proj, pred, succ, torch.randint(0, v, (n,), device=DEVICE)


def test_candidates_are_the_top_k_in_order():
    """Descending logit, equal logits by lower id, also at the k-th place (a stable full sort's first k)."""
    logits = torch.randint(-3, 4, (6, 40), device=DEVICE).float()  # many ties
    for k in (1, 5, 17, 40):
        expected = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :k]
        assert torch.equal(top_k_candidates(logits, k), expected)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_greedy_equals_the_reference(backend, dtype, shape):
    n, p, v, r, k = shape
    logits, proj, pred, succ, anchor = _inputs(n, p, v, r, dtype, strided=True)
    path, candidates, q = candidate_select(logits, proj, pred, succ, anchor.int(), top_k=k, backend=backend)
    ref = candidate_select_reference(logits, proj, pred, succ, anchor, k)
    assert path.dtype == candidates.dtype == torch.int64 and q.dtype == torch.float32
    assert path.shape == (n, p) and candidates.shape == q.shape == (n, p, k)
    assert torch.equal(path, ref[0]) and torch.equal(candidates, ref[1]) and torch.equal(q, ref[2])
    if n * p:
        assert torch.equal(q.sum(-1), torch.ones(n, p, device=DEVICE)), "greedy q is one-hot at the pick"
        assert torch.equal(candidates.gather(-1, q.argmax(-1, keepdim=True))[..., 0], path)


@pytest.mark.parametrize("backend", ["triton"])
def test_ties_and_late_winners_across_vocabulary_tiles(backend):
    """Integer logits over three vocabulary tiles (ties everywhere, the k-th value shared by hundreds of ids) and
    rows whose best values sit in the last tile only: the kernel's tile skipping keeps the reference's order."""
    n, p, v, r, k = 2, 3, 9000, 5, 16
    logits = torch.randint(-3, 3, (n, p, v), device=DEVICE).float()
    logits[0, 1, 8500:8510] = 5.0  # late winners
    logits[1, 2, -1] = 4.0
    _, proj, pred, succ, anchor = _inputs(n, p, v, r, torch.float32)
    got = candidate_select(logits, proj, pred, succ, anchor, top_k=k, backend=backend)
    ref = candidate_select_reference(logits, proj, pred, succ, anchor, k)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


def test_reference_walks_like_the_module():
    """The op's reference follows dflash.dflash2.CandidateSelector's greedy walk (the official code) on fp32."""
    from types import SimpleNamespace

    from dflash.config import DFlash2Settings
    from dflash.dflash2 import CandidateSelector

    n, p, v, r, k, h = 3, 7, 64, 8, 5, 16
    config = SimpleNamespace(vocab_size=v, hidden_size=h, dflash2=DFlash2Settings(
        conv_kernel_size=3, conv_group_size=4, selector_rank=r, selector_top_k=k))
    selector = CandidateSelector(config)
    for param in selector.parameters():
        torch.nn.init.normal_(param)
    hidden, logits, anchor = torch.randn(n, p, h), torch.randn(n, p, v), torch.randint(0, v, (n,))
    with torch.no_grad():
        path, candidates, _ = selector.select(hidden, logits, anchor)
        ours = candidate_select_reference(logits, selector.hidden_projection(hidden), selector.predecessor_codebook,
                                          selector.successor_codebook, anchor, k)
    assert torch.equal(ours[0], path)
    assert torch.equal(ours[1].sort(-1).values, candidates.sort(-1).values)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_sampling_follows_the_selector_distribution(backend):
    """Position 0 of many requests with the same inputs: the picks follow softmax(score / T) by chi-square, and
    the rule without the codebook term (a wrong selector) is rejected; requests with T = 0 take the argmax."""
    v, r, k, temp = 24, 4, 6, 0.8
    reps, calls = (2000, 4) if backend == "torch" else (160, 2)  # the interpreter runs a program in ~0.1 s
    logits, proj, pred, succ, anchor = _inputs(1, 1, v, r, torch.float32)
    logits, proj, anchor = logits.expand(reps, 1, v), proj.expand(reps, 1, r), anchor.expand(reps)
    temps = torch.full((reps,), temp, device=DEVICE)
    temps[:5] = 0.0
    counts = torch.zeros(k, dtype=torch.float64, device=DEVICE)
    for call in range(calls):
        path, candidates, q = candidate_select(logits, proj, pred, succ, anchor, top_k=k, temperature=temps,
                                               seed=torch.tensor([11], device=DEVICE), offset=call,
                                               backend=backend)
        picks = (candidates[:, 0] == path[:, :1]).float().argmax(-1)
        greedy = candidate_select_reference(logits[:5], proj[:5], pred, succ, anchor[:5], k)
        assert torch.equal(path[:5], greedy[0]) and torch.equal(q[:5], greedy[2])
        counts += torch.bincount(picks[5:], minlength=k).double()
    n = calls * (reps - 5)
    probs = q[5, 0].double()
    stat, crit = chi2(counts, probs, n)
    assert stat < crit, (stat, crit)
    wrong = torch.softmax(logits[0, 0].double().gather(-1, candidates[0, 0]) / temp, -1)
    stat, crit = chi2(counts, wrong, n)
    assert stat > crit, "the test cannot tell the selector's distribution from the logits' alone"
    unary = logits[5, 0].gather(-1, candidates[5, 0])
    scores = unary + (succ[candidates[5, 0]] * (pred[anchor[5]] * proj[5, 0])).sum(-1)
    torch.testing.assert_close(q[5, 0], torch.softmax(scores / temp, -1), rtol=1e-5, atol=1e-6)


def test_sampling_reads_seed_and_offset_tensors():
    logits, proj, pred, succ, anchor = _inputs(40, 3, 30, 4, torch.float32)
    seed, offset = torch.tensor([5], device=DEVICE), torch.tensor([0], device=DEVICE)
    temps = torch.tensor([1.0], device=DEVICE)
    run = [candidate_select(logits, proj, pred, succ, anchor, top_k=8, temperature=temps, seed=seed, offset=offset,
                            backend="triton")[0] for _ in range(2)]
    assert torch.equal(run[0], run[1]), "same seed and offset, same picks"
    offset += 1
    assert not torch.equal(candidate_select(logits, proj, pred, succ, anchor, top_k=8, temperature=temps, seed=seed,
                                            offset=offset, backend="triton")[0], run[0])


def test_bad_arguments_raise_before_work():
    logits, proj, pred, succ, anchor = _inputs(2, 3, 20, 4, torch.float32)
    with pytest.raises(ValueError, match=r"top_k must be an int in \[1, min\(V, 64\)\] = \[1, 20\]"):
        candidate_select(logits, proj, pred, succ, anchor, top_k=21)
    with pytest.raises(ValueError, match="anchor values must be"):
        candidate_select(logits, proj, pred, succ, anchor + 20, top_k=3)
    with pytest.raises(ValueError, match=r"successor must have shape \(20, 4\)"):
        candidate_select(logits, proj, pred, succ[:, :3], anchor, top_k=3)
    with pytest.raises(ValueError, match=r"temperature must be \[1\] or \[N=2\]"):
        candidate_select(logits, proj, pred, succ, anchor, top_k=3, temperature=torch.ones(3, device=DEVICE))
    with pytest.raises(TypeError, match="anchor has dtype"):
        candidate_select(logits, proj, pred, succ, anchor.float(), top_k=3)


@pytest.mark.parametrize("sampled", [False, True])
def test_torch_backend_under_cuda_capture_runs_the_kernel(monkeypatch, sampled):
    """The reference's candidates take a host-sized step and its draws a generator seeded from host ints, which a
    CUDA graph cannot hold: under a capture the torch backend gives the Triton kernel's results (a capture is
    simulated here: no GPU needed)."""
    from dflash_kernels import verify

    logits, proj, pred, succ, anchor = _inputs(6, 3, 40, 4, torch.float32)
    kw = dict(top_k=5, temperature=torch.tensor([0.9], device=DEVICE) if sampled else None,
              seed=torch.tensor([4], device=DEVICE), offset=torch.tensor([2], device=DEVICE))
    kernel = candidate_select(logits, proj, pred, succ, anchor, backend="triton", **kw)
    monkeypatch.setattr(verify, "cuda_capturing", lambda device: True)
    captured = candidate_select(logits, proj, pred, succ, anchor, backend="torch", **kw)
    assert all(torch.equal(a, b) for a, b in zip(captured, kernel))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sampled", [False, True])
def test_results_into_given_buffers(backend, sampled):
    """``out=``: every element of the three prefilled buffers written (no -1 / NaN left), the same values as new
    tensors, the given tensors returned (a runtime's persistent buffers, no copy)."""
    n, p, v, r, k = 3, 5, 300, 12, 6
    logits, proj, pred, succ, anchor = _inputs(n, p, v, r, torch.float32)
    kw = dict(top_k=k, temperature=torch.tensor([0.8], device=DEVICE) if sampled else None, seed=3, offset=9,
              backend=backend)
    out = (torch.full((n, p), -1, dtype=torch.int64, device=DEVICE),
           torch.full((n, p, k), -1, dtype=torch.int64, device=DEVICE),
           torch.full((n, p, k), float("nan"), device=DEVICE))
    got = candidate_select(logits, proj, pred, succ, anchor, out=out, **kw)
    assert all(g is o for g, o in zip(got, out))
    assert all(torch.equal(a, b) for a, b in zip(got, candidate_select(logits, proj, pred, succ, anchor, **kw)))
    assert (out[0] >= 0).all() and (out[1] >= 0).all() and not out[2].isnan().any()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sampled", [False, True])
def test_token_major_logits_and_projections(backend, sampled):
    """Logits and projections in position-major layout ([P, N, ...] buffers read through transpose(0, 1), as a
    DFlash2 draft step's LM head over the final norm's token-major rows gives them): the results of their
    contiguous copies."""
    n, p, v, r, k = 3, 5, 300, 12, 6
    logits, proj, pred, succ, anchor = _inputs(n, p, v, r, torch.bfloat16)
    kw = dict(top_k=k, temperature=torch.tensor([0.8], device=DEVICE) if sampled else None, seed=3, offset=9,
              backend=backend)
    major = [t.transpose(0, 1).contiguous().transpose(0, 1) for t in (logits, proj)]
    assert not major[0].is_contiguous() and torch.equal(major[0], logits)
    got = candidate_select(*major, pred, succ, anchor, **kw)
    assert all(torch.equal(a, b) for a, b in zip(got, candidate_select(logits, proj, pred, succ, anchor, **kw)))


def test_bad_out_raises_before_work():
    logits, proj, pred, succ, anchor = _inputs(2, 3, 20, 4, torch.float32)
    path = torch.full((2, 3), -1, dtype=torch.int64, device=DEVICE)
    cand = torch.full((2, 3, 4), -1, dtype=torch.int64, device=DEVICE)
    q = torch.full((2, 3, 4), float("nan"), device=DEVICE)
    with pytest.raises(TypeError, match="out must be None or a tuple"):
        candidate_select(logits, proj, pred, succ, anchor, top_k=4, out=(path, cand))
    with pytest.raises(TypeError, match="candidate_select: q has dtype"):
        candidate_select(logits, proj, pred, succ, anchor, top_k=4, out=(path, cand, q.double()))
    with pytest.raises(ValueError, match=r"candidates \(out\) must be a contiguous \[2, 3, 4\] tensor"):
        candidate_select(logits, proj, pred, succ, anchor, top_k=4, out=(path, cand[:, :, :3], q))
    with pytest.raises(ValueError, match=r"path \(out\) overlaps candidates"):
        candidate_select(logits, proj, pred, succ, anchor, top_k=4, out=(cand.view(-1)[:6].view(2, 3), cand, q))
    with pytest.raises(ValueError, match=r"path \(out\) overlaps anchor"):
        anchor_buf = torch.zeros(6, dtype=torch.int64, device=DEVICE)
        candidate_select(logits, proj, pred, succ, anchor_buf[:2], top_k=4, out=(anchor_buf.view(2, 3), cand, q))
    assert (path == -1).all() and (cand == -1).all() and q.isnan().all(), "a rejected call wrote a buffer"
