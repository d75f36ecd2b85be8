"""The compiled ops (torch.ops.dflash_ext.*, Meta kernels) and the public ops with backend="ext"
(torch.ops.dflash.*, which dispatch to them) under torch.compile(fullgraph=True) and torch.library.opcheck."""
import pytest
import torch

from dflash_kernels import _ext
from dflash_kernels.commit import commit_round
from dflash_kernels.verify import verify_greedy

from helpers.ext import devices, needs_ext

pytestmark = needs_ext

FIELDS = ("out_tokens", "lengths", "positions", "anchor", "done")


def _inputs(device, R=5, B=4, V=300, C=16):
    logits = torch.randn(R, B, V, device=device)
    draft = logits.argmax(-1)[:, :-1].clone()
    draft[torch.rand(draft.shape, device=device) < 0.3] = 0
    state = {"out_tokens": torch.zeros(R, C, dtype=torch.long, device=device),
             "lengths": torch.randint(0, 6, (R,), device=device),
             "positions": torch.randint(0, 6, (R,), device=device),
             "anchor": torch.zeros(R, dtype=torch.long, device=device),
             "done": torch.rand(R, device=device) < 0.2}
    maxl = torch.randint(6, C + 1, (R,), device=device)
    stop = torch.tensor([1, 2, -1], device=device)
    return logits, draft, stop, maxl, state


def step_ops(logits, draft, stop, maxl, out_tokens, lengths, positions, anchor, done):
    acc, bonus = torch.ops.dflash_ext.verify_greedy(logits, draft)
    n = torch.ops.dflash_ext.commit_round(draft, acc, bonus, stop, maxl, out_tokens, lengths, positions, anchor, done)
    return acc, bonus, n


def step_public(logits, draft, stop, maxl, out_tokens, lengths, positions, anchor, done):
    acc, bonus = verify_greedy(logits, draft, backend="ext")
    n = commit_round(draft, acc, bonus, out_tokens=out_tokens, lengths=lengths, positions=positions,
                     anchor=anchor, done=done, max_lengths=maxl, stop_tokens=stop, backend="ext")
    return acc, bonus, n


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("fn", [step_ops, step_public], ids=["ops", "public"])
@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_fullgraph_compile_matches_eager(device, fn, compiler):
    torch._dynamo.reset()
    logits, draft, stop, maxl, state = _inputs(device)
    eager_state = {k: v.clone() for k, v in state.items()}
    compiled_state = {k: v.clone() for k, v in state.items()}
    expected = fn(logits, draft, stop, maxl, **eager_state)
    got = torch.compile(fn, fullgraph=True, backend=compiler)(logits, draft, stop, maxl, **compiled_state)
    for e, g in zip(expected, got):
        assert torch.equal(e, g)
    for k in FIELDS:  # the in-place updates survive functionalization
        assert torch.equal(eager_state[k], compiled_state[k]), k


@pytest.mark.parametrize("device", devices())
def test_opcheck(device):
    logits, draft, stop, maxl, state = _inputs(device)
    torch.library.opcheck(torch.ops.dflash_ext.verify_greedy.default, (logits, draft))
    torch.library.opcheck(torch.ops.dflash_ext.verify_greedy.default,
                          (logits[:, :1].contiguous(), draft[:, :0].contiguous()))  # B == 1
    torch.library.opcheck(torch.ops.dflash_ext.commit_round.default,
                          (draft, *step_ops(logits, draft, stop, maxl, **{k: v.clone() for k, v in state.items()})[:2],
                           stop, maxl, *[state[k] for k in FIELDS]))


def test_meta_shapes():
    logits = torch.empty(3, 4, 10, device="meta", dtype=torch.bfloat16)
    acc, bonus = torch.ops.dflash_ext.verify_greedy(logits, torch.empty(3, 3, device="meta", dtype=torch.long))
    assert acc.shape == bonus.shape == (3,) and acc.dtype == torch.int64 and acc.device.type == "meta"
    with pytest.raises(RuntimeError, match="draft_tokens must have shape"):
        torch.ops.dflash_ext.verify_greedy(logits, torch.empty(3, 2, device="meta", dtype=torch.long))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_cuda_graph_capture_replay():
    ok, why = _ext.status("cuda")
    if not ok:
        pytest.skip(f"CUDA ops unavailable: {why}")
    logits, draft, stop, maxl, state = _inputs("cuda", R=8, B=16, V=151936, C=256)
    ref_state = {k: v.clone() for k, v in state.items()}
    static = {k: v.clone() for k, v in state.items()}
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step_ops(logits, draft, stop, maxl, **{k: v.clone() for k, v in state.items()})  # warm-up
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = step_ops(logits, draft, stop, maxl, **static)
    for _ in range(3):  # three rounds: the graph and eager must agree round after round
        g.replay()
        exp = step_ops(logits, draft, stop, maxl, **ref_state)
        torch.cuda.synchronize()
        for e, o in zip(exp, out):
            assert torch.equal(e, o)
        for k in FIELDS:
            assert torch.equal(ref_state[k], static[k]), k
