"""commit_round: the torch reference and the compiled op (backend="ext") against a per-request oracle."""
import pytest
import torch

from dflash_kernels import _ext
from dflash_kernels.commit import CommitRoundInputError, commit_round, commit_round_reference

from helpers.ext import EXT_CPU_OK, EXT_CPU_WHY, devices

FIELDS = ("out_tokens", "lengths", "positions", "anchor", "done")


def _backends():  # "cpu": the C++ op where the extension is built, else the reference
    return ["torch", "cpu", pytest.param("ext", marks=pytest.mark.skipif(
        not EXT_CPU_OK, reason=f"compiled extension unavailable: {EXT_CPU_WHY}"))]


def _oracle(draft, acc, bonus, state, maxl, stop):
    """Straight per-request Python transcription of the definition in dflash_kernels.commit."""
    st = {k: v.clone().cpu() for k, v in state.items()}
    draft, acc, bonus, maxl = draft.cpu(), acc.cpu(), bonus.cpu(), maxl.cpu()
    R = draft.shape[0]
    num_new = torch.zeros(R, dtype=torch.int64)
    for r in range(R):
        if bool(st["done"][r]):
            continue
        a, L = int(acc[r]), int(st["lengths"][r])
        e = draft[r, :a].tolist() + [int(bonus[r])]
        if stop is None:
            stops = set()
        else:
            row = stop[r] if stop.dim() == 2 else stop
            stops = {int(x) for x in row.cpu() if int(x) >= 0}
        s = next((j + 1 for j, t in enumerate(e) if t in stops), a + 1)
        n = min(s, max(int(maxl[r]) - L, 0))
        st["out_tokens"][r, L:L + n] = torch.tensor(e[:n], dtype=torch.int64)
        st["lengths"][r] = L + n
        st["positions"][r] += n
        if n > 0:
            st["anchor"][r] = e[n - 1]
        stopped = n == s and e[s - 1] in stops
        st["done"][r] = stopped or L + n >= int(maxl[r])
        num_new[r] = n
    return st, num_new


def _random_round(R, B, C, device, vocab=12, per_request_stop=None, p_done=0.2):
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    draft = torch.randint(0, vocab, (R, B - 1), generator=g)
    acc = torch.randint(0, B, (R,), generator=g)
    bonus = torch.randint(0, vocab, (R,), generator=g)
    lengths = torch.randint(0, C + 1, (R,), generator=g)
    maxl = torch.minimum(lengths + torch.randint(-2, B + 3, (R,), generator=g), torch.tensor(C))
    state = {
        "out_tokens": torch.randint(100, 200, (R, C), generator=g),
        "lengths": lengths,
        "positions": lengths + torch.randint(0, 50, (R,), generator=g),
        "anchor": torch.randint(0, vocab, (R,), generator=g),
        "done": torch.rand(R, generator=g) < p_done,
    }
    if per_request_stop is None:
        per_request_stop = bool(torch.randint(0, 2, (), generator=g))
    S = int(torch.randint(0, 4, (), generator=g))
    stop = torch.randint(-1, vocab, (R, S) if per_request_stop else (S,), generator=g)
    to = lambda t: t.to(device)  # noqa: E731
    return (to(draft), to(acc), to(bonus), {k: to(v) for k, v in state.items()}, to(maxl), to(stop))


def _run(backend, draft, acc, bonus, state, maxl, stop, **kw):
    st = {k: v.clone() for k, v in state.items()}
    n = commit_round(draft, acc, bonus, max_lengths=maxl, stop_tokens=stop, backend=backend, **st, **kw)
    return st, n


def _assert_same(st, n, exp_st, exp_n):
    for k in FIELDS:
        assert torch.equal(st[k].cpu(), exp_st[k]), k
    assert n.dtype == torch.int64
    assert torch.equal(n.cpu(), exp_n)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("R,B,C", [(1, 1, 1), (1, 1, 0), (7, 4, 9), (16, 8, 40), (33, 16, 20), (0, 4, 5)])
def test_random_rounds_match_oracle(device, backend, R, B, C):
    for _ in range(5):
        draft, acc, bonus, state, maxl, stop = _random_round(R, B, C, device)
        st, n = _run(backend, draft, acc, bonus, state, maxl, stop)
        _assert_same(st, n, *_oracle(draft, acc, bonus, state, maxl, stop))


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("backend", _backends())
def test_stop_token_at_every_position(device, backend):
    B, C, STOP = 8, 64, 7
    for acc_n in range(B):
        for p in range(B):  # stop token at candidate position p (p == acc_n: the bonus itself)
            draft = torch.arange(10, 10 + B - 1)[None].clone()
            bonus = torch.tensor([50])
            if p == acc_n:
                bonus[0] = STOP       # the bonus token itself
            elif p < B - 1:
                draft[0, p] = STOP    # an accepted draft (p < acc_n) or a rejected one (p > acc_n)
            state = {"out_tokens": torch.full((1, C), -9), "lengths": torch.tensor([3]),
                     "positions": torch.tensor([20]), "anchor": torch.tensor([1]),
                     "done": torch.tensor([False])}
            args = [t.to(device) for t in (draft, torch.tensor([acc_n]), bonus)]
            state = {k: v.to(device) for k, v in state.items()}
            maxl = torch.tensor([C], device=device)
            stop = torch.tensor([STOP, -1], device=device)
            st, n = _run(backend, *args, state, maxl, stop)
            _assert_same(st, n, *_oracle(*args, state, maxl, stop))
            hit = p <= acc_n  # a stop token beyond the accepted prefix (not emitted) does not count
            assert bool(st["done"][0]) == hit
            assert int(n[0]) == (p + 1 if hit else acc_n + 1)
            if hit:
                assert int(st["anchor"][0]) == STOP and int(st["out_tokens"][0, 3 + p]) == STOP


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("backend", _backends())
def test_length_limits(device, backend):
    B, C = 6, 12
    for L in range(C + 1):
        for maxl_v in range(0, C + 1):
            draft = torch.arange(1, B)[None].to(device)
            state = {"out_tokens": torch.zeros(1, C, dtype=torch.long, device=device),
                     "lengths": torch.tensor([L], device=device),
                     "positions": torch.tensor([L], device=device),
                     "anchor": torch.tensor([0], device=device),
                     "done": torch.tensor([False], device=device)}
            acc = torch.tensor([B - 1], device=device)
            bonus = torch.tensor([99], device=device)
            maxl = torch.tensor([maxl_v], device=device)
            st, n = _run(backend, draft, acc, bonus, state, maxl, None)
            _assert_same(st, n, *_oracle(draft, acc, bonus, state, maxl, None))
            assert int(n[0]) == max(0, min(B, maxl_v - L))
            assert int(st["lengths"][0]) <= max(L, maxl_v) and bool(st["done"][0]) == (L + int(n[0]) >= maxl_v)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("backend", _backends())
def test_done_requests_untouched_even_with_garbage(device, backend):
    R, B, C = 5, 4, 6
    draft, acc, bonus, state, maxl, stop = _random_round(R, B, C, device, p_done=0.0)
    state["done"][1::2] = True
    acc[1], state["lengths"][3], maxl[3] = 99, 1000, 1000  # invalid, but in done requests
    st, n = _run(backend, draft, acc, bonus, state, maxl, stop)
    for k in FIELDS:
        assert torch.equal(st[k][1::2], state[k][1::2]), k
    assert torch.equal(n[1::2].cpu(), torch.zeros(2, dtype=torch.int64))
    _assert_same(st, n, *_oracle(draft, acc, bonus, state, maxl, stop))


@pytest.mark.parametrize("device", devices())
def test_multi_round_decode_ext_equals_torch(device):
    if not EXT_CPU_OK:
        pytest.skip(f"compiled extension unavailable: {EXT_CPU_WHY}")
    R, B, C, V = 9, 8, 48, 20
    state0 = {"out_tokens": torch.zeros(R, C, dtype=torch.long), "lengths": torch.randint(0, 5, (R,)),
              "positions": torch.zeros(R, dtype=torch.long), "anchor": torch.randint(0, V, (R,)),
              "done": torch.zeros(R, dtype=torch.bool)}
    state0 = {k: v.to(device) for k, v in state0.items()}
    maxl = torch.randint(10, C + 1, (R,), device=device)
    stop = torch.tensor([0, 1], device=device)
    states = {b: {k: v.clone() for k, v in state0.items()} for b in ("torch", "ext")}
    for _ in range(12):
        logits = torch.randn(R, B, V, device=device)
        draft = logits.argmax(-1)[:, :-1].clone()
        draft[torch.rand(draft.shape, device=device) < 0.25] = 3
        acc, bonus = _ext.verify_greedy(logits, draft)
        ns = {b: commit_round(draft, acc, bonus, max_lengths=maxl, stop_tokens=stop, backend=b, **states[b])
              for b in ("torch", "ext")}
        assert torch.equal(ns["torch"], ns["ext"])
        for k in FIELDS:
            assert torch.equal(states["torch"][k], states["ext"][k]), k
    assert bool(states["ext"]["done"].any())


def _valid(R=3, B=4, C=8, device="cpu"):
    return dict(draft_tokens=torch.zeros(R, B - 1, dtype=torch.long, device=device),
                accepted=torch.zeros(R, dtype=torch.long, device=device),
                bonus=torch.zeros(R, dtype=torch.long, device=device),
                out_tokens=torch.zeros(R, C, dtype=torch.long, device=device),
                lengths=torch.zeros(R, dtype=torch.long, device=device),
                positions=torch.zeros(R, dtype=torch.long, device=device),
                anchor=torch.zeros(R, dtype=torch.long, device=device),
                done=torch.zeros(R, dtype=torch.bool, device=device),
                max_lengths=torch.full((R,), C, dtype=torch.long, device=device),
                stop_tokens=torch.full((2,), 42, dtype=torch.long, device=device))


BAD = [
    ("accepted", lambda t: t.int(), "accepted must have dtype"),
    ("done", lambda t: t.long(), "done must have dtype"),
    ("lengths", lambda t: t[:2], "lengths must have shape"),
    ("draft_tokens", lambda t: t[0], "draft_tokens must be 2-D"),
    ("out_tokens", lambda t: t[:2], "out_tokens must have shape"),
    ("out_tokens", lambda t: torch.zeros(t.shape[0], 2 * t.shape[1], dtype=t.dtype)[:, ::2], "out_tokens must be contiguous"),
    ("stop_tokens", lambda t: torch.zeros(2, 2, 2, dtype=t.dtype), "stop_tokens must be"),
    ("stop_tokens", lambda t: torch.zeros(5, 2, dtype=t.dtype), "stop_tokens must have shape"),
    ("positions", lambda t: t.to("meta"), "positions"),
]

BAD_VALUES = [
    ("accepted", 4, r"accepted\[1\] = 4"),
    ("accepted", -1, r"accepted\[1\] = -1"),
    ("lengths", 9, r"lengths\[1\] = 9"),
    ("lengths", -2, r"lengths\[1\] = -2"),
    ("max_lengths", 9, r"max_lengths\[1\] = 9"),
]


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("name,mutate,match", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_bad_arguments_raise_runtime_error(backend, name, mutate, match):
    kw = _valid()
    kw[name] = mutate(kw[name])
    with pytest.raises(RuntimeError, match=match):
        commit_round(kw.pop("draft_tokens"), kw.pop("accepted"), kw.pop("bonus"), backend=backend, **kw)


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("name,value,match", BAD_VALUES)
def test_bad_values_raise_and_write_nothing(backend, name, value, match):
    kw = _valid()
    kw[name][1] = value
    before = {k: v.clone() for k, v in kw.items()}
    with pytest.raises(RuntimeError, match=match) as info:
        commit_round(kw.pop("draft_tokens"), kw.pop("accepted"), kw.pop("bonus"), backend=backend, **kw)
    assert isinstance(info.value, CommitRoundInputError)
    for k in FIELDS:
        assert torch.equal(kw[k], before[k]), k


@pytest.mark.skipif(not EXT_CPU_OK, reason=f"compiled extension unavailable: {EXT_CPU_WHY}")
@pytest.mark.parametrize("name,value,match", BAD_VALUES)
def test_op_checks_values_itself(name, value, match):
    """The C++ op validates too (check=False skips only the Python-side check)."""
    kw = _valid()
    kw[name][1] = value
    before = {k: v.clone() for k, v in kw.items()}
    with pytest.raises(RuntimeError, match=match):
        commit_round(kw.pop("draft_tokens"), kw.pop("accepted"), kw.pop("bonus"), backend="ext",
                     check=False, **kw)
    for k in FIELDS:
        assert torch.equal(kw[k], before[k]), k


@pytest.mark.skipif(not EXT_CPU_OK, reason=f"compiled extension unavailable: {EXT_CPU_WHY}")
def test_op_rejects_aliased_buffers():
    kw = _valid()
    with pytest.raises(RuntimeError, match="(lengths|positions) overlaps (lengths|positions)"):
        torch.ops.dflash_ext.commit_round(kw["draft_tokens"], kw["accepted"], kw["bonus"], kw["stop_tokens"],
                                      kw["max_lengths"], kw["out_tokens"], kw["lengths"], kw["lengths"],
                                      kw["anchor"], kw["done"])


@pytest.mark.parametrize("device", devices())
def test_unchecked_invalid_request_is_finished_untouched(device):
    """check=False (the no-sync GPU path): an invalid live request ends as done, nothing written."""
    backends = ["torch"] + (["ext"] if device == "cuda" else [])  # the CPU op always raises
    for backend in backends:
        kw = _valid(device=device)
        kw["accepted"][1] = 7
        kw["lengths"][2] = 100
        before = {k: v.clone() for k, v in kw.items()}
        n = commit_round(kw.pop("draft_tokens"), kw.pop("accepted"), kw.pop("bonus"), backend=backend,
                         check=False, **kw)
        assert n.tolist() == [1, 0, 0]
        assert kw["done"].tolist() == [False, True, True]
        for k in ("out_tokens", "lengths", "positions", "anchor"):
            assert torch.equal(kw[k][1:], before[k][1:]), k


def test_reference_is_the_torch_backend():
    draft, acc, bonus, state, maxl, stop = _random_round(6, 5, 10, "cpu")
    a = {k: v.clone() for k, v in state.items()}
    n1 = commit_round_reference(draft, acc, bonus, max_lengths=maxl, stop_tokens=stop, **a)
    b, n2 = _run("torch", draft, acc, bonus, state, maxl, stop)
    assert torch.equal(n1, n2) and all(torch.equal(a[k], b[k]) for k in FIELDS)


def test_triton_backend_is_rejected():
    kw = _valid()
    with pytest.raises(ValueError, match="not implemented"):
        commit_round(kw.pop("draft_tokens"), kw.pop("accepted"), kw.pop("bonus"), backend="triton", **kw)
