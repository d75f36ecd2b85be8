"""``dflash_kernels.cpu.forward``: the lean target's "cpu" forward as one native call equals the op path bit for
bit (logits, tapped features, both caches) on every projection route (AMX where the CPU has it, the fp32 kernel of each
instruction set, torch's linear), and steps aside wherever the op path must run."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dflash_kernels.cpu import forward as native_forward, linear as cpu_linear
from dflash.lean_target import LeanTarget
from dflash_kernels import build_tree, tree_ancestor_mask
from dflash_kernels.cpu import native as cpu_native

from helpers.tiny_models import make_target

pytestmark = pytest.mark.skipif(cpu_native.library() is None,
                                reason=cpu_native.unavailable_reason() or "native kernels off")

HIDDEN, VOCAB, CAP = 64, 96, 80  # head dim 16: the native attention's unit


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def target(request):
    torch.manual_seed(0)
    model = make_target(request.param, vocab=VOCAB, layers=3, hidden=HIDDEN)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            p.copy_(p.bfloat16().float())  # every weight a bf16 value: the AMX path's condition (where there is AMX)
    return model


@pytest.fixture
def native(monkeypatch):
    """Counts the forwards the native loop ran (it returns None where it steps aside)."""
    ran = []
    real = native_forward.NativeForward.forward

    def counted(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        ran.append(out is not None)
        return out
    monkeypatch.setattr(native_forward.NativeForward, "forward", counted)
    return ran


class _Watching(TorchDispatchMode):
    """A dispatch mode that only passes the calls on (as the graph emulator and the accountant watch them)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _pair(target, n=1, capacity=CAP):
    return [LeanTarget(target, [0, 2], batch=n, capacity=capacity, backend="cpu") for _ in range(2)]


def _forward(lt, on, *args, **kwargs):
    before = native_forward.set_enabled(on)
    try:
        with torch.inference_mode():
            return lt.forward(*args, **kwargs)
    finally:
        native_forward.set_enabled(before)


def _assert_same(a, b, la, lb):
    assert torch.equal(a[0], b[0]), (a[0] - b[0]).abs().max()
    assert torch.equal(a[1], b[1])
    assert torch.equal(la.k_cache, lb.k_cache) and torch.equal(la.v_cache, lb.v_cache)


@pytest.mark.parametrize("rows", [1, 8, 24, 64, 117, 512])
def test_chain_rows_bit_equal(target, native, rows, seed):
    g = torch.Generator().manual_seed(seed)
    a, b = _pair(target, capacity=max(CAP, 9 + rows))
    prompt = torch.randint(0, VOCAB, (1, 9), generator=g)
    ids = torch.randint(0, VOCAB, (1, rows), generator=g)
    outs = []
    for lt, on in ((a, True), (b, False)):
        _forward(lt, on, prompt, torch.tensor([0]), 9)
        outs.append(_forward(lt, on, ids, torch.tensor([9]), 9 + rows))
    assert native == [True, True]  # the prompt and the block: both native (<= MAX_ROWS rows)
    _assert_same(*outs, a, b)


def test_tree_ragged_batch_and_last_logits_bit_equal(target, native, seed):
    """Two requests at different lengths in cache rows 1 and 0, a draft tree of 12 nodes each; then a last-row-only
    forward (a prefill chunk's tail)."""
    g = torch.Generator().manual_seed(seed)
    a, b = _pair(target, n=2)
    logits = torch.randn(2, 7, 40, generator=g) * 2
    tokens, parents, depths = build_tree(logits, torch.tensor([3, 4]), 11, backend="torch")
    tree = (depths, tree_ancestor_mask(parents, backend="torch"))
    start, rows = torch.tensor([17, 5]), torch.tensor([1, 0])
    tail = torch.randint(0, VOCAB, (2, 6), generator=g)
    outs = []
    for lt, on in ((a, True), (b, False)):
        for r, s in ((0, 17), (1, 5)):  # distinct contexts
            _forward(lt, on, torch.randint(0, VOCAB, (1, s), generator=torch.Generator().manual_seed(seed + s)),
                     torch.tensor([0]), s, rows=torch.tensor([r]))
        outs.append(_forward(lt, on, tokens, start, 30, rows=rows, tree=tree))
        outs.append(_forward(lt, on, tail, start + 12, 35, rows=rows, last_logits_only=True))
    assert native == [True] * 4  # two prompts, the tree, the tail; turned off, it is not even tried
    _assert_same(outs[0], outs[2], a, b)
    assert outs[1][0].shape == (2, 1, VOCAB)
    assert torch.equal(outs[1][0], outs[3][0]) and torch.equal(outs[1][1], outs[3][1])


def test_argmax_head_is_the_logits_argmax(target, native, seed):
    """forward(argmax=True) (cpu_linear.linear_argmax's screen on both paths): the argmax of the same forward's logits,
    for a chain, a ragged tree batch and a last-row-only forward; the features as with logits."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, 7, 40, generator=g) * 2
    tokens, parents, depths = build_tree(logits, torch.tensor([3, 4]), 19, backend="torch")
    tree = (depths, tree_ancestor_mask(parents, backend="torch"))
    start, rows = torch.tensor([11, 5]), torch.tensor([1, 0])
    chain = torch.randint(0, VOCAB, (2, 8), generator=g)
    for on in (True, False):
        lt = LeanTarget(target, [0, 2], batch=2, capacity=CAP, backend="cpu")
        for r, s in ((0, 11), (1, 5)):
            _forward(lt, on, torch.randint(0, VOCAB, (1, s), generator=torch.Generator().manual_seed(seed + s)),
                     torch.tensor([0]), s, rows=torch.tensor([r]))
        for args, kwargs in (((chain, start, 19), {"rows": rows}), ((tokens, start, 31), {"rows": rows, "tree": tree}),
                             ((chain, start, 19), {"rows": rows, "last_logits_only": True})):
            full = _forward(lt, on, *args, **kwargs)
            ids = _forward(lt, on, *args, argmax=True, **kwargs)  # the same rows rewritten with the same values
            assert ids[0].dtype == torch.int64 and torch.equal(ids[0], full[0].argmax(-1))
            assert torch.equal(ids[1], full[1])
    assert native == [True] * 8  # turned off, it is not even tried


@pytest.mark.parametrize("isa", ["avx512", "avx2"])
def test_each_fp32_kernel_route_bit_equal(target, native, monkeypatch, isa):
    """With the AMX path off, the projections take the fp32 kernel of the instruction set cpu_linear loaded
    (DFLASH_CPU_LINEAR_ISA): on the bf16-packed copies of these bf16-exact weights at 1-32 rows (the one-token step
    to trees of 31), on the fp32 weights at 2-16 rows with set_bf16(False), torch's linear elsewhere. The native
    forward follows, bit for bit, and the packed route gives the fp32 route's bits."""
    if isa not in cpu_native.isas():
        pytest.skip(f"this CPU lacks {isa}")
    kernel, got = cpu_linear._build(isa)
    for name, value in (("_kernel", kernel), ("_isa", got), ("_tried", True)):
        monkeypatch.setattr(cpu_linear, name, value)
    monkeypatch.setattr(cpu_linear, "_amx_on", False)
    routes = []
    plan = native_forward._Projection.plan

    def recorded(self, rows, out):
        plan(self, rows, out)
        routes.append(out[0][-1])
    monkeypatch.setattr(native_forward._Projection, "plan", recorded)
    g = torch.Generator().manual_seed(5)
    row_counts = (1, 5, 16, 17, 32)
    for rows in row_counts:
        ids = torch.randint(0, VOCAB, (1, rows), generator=g)
        outs = []
        for bf16 in (True, False):
            before = cpu_linear.set_bf16(bf16)
            try:
                a, b = _pair(target)
                outs.append((_forward(a, True, ids, torch.tensor([0]), rows), a))
                _assert_same(outs[-1][0], _forward(b, False, ids, torch.tensor([0]), rows), a, b)
            finally:
                cpu_linear.set_bf16(before)
        if cpu_linear.MIN_ROWS <= rows <= cpu_linear.MAX_ROWS:  # elsewhere the fp32 route is torch's: other sums
            _assert_same(outs[0][0], outs[1][0], outs[0][1], outs[1][1])
    packed = native_forward.ROUTES[isa + "_bf16"]
    per_forward = 4 * 3  # four projections a layer, three layers
    by_rows = {rows: (routes[2 * i * per_forward:(2 * i + 1) * per_forward],
                      routes[(2 * i + 1) * per_forward:(2 * i + 2) * per_forward]) for i, rows in enumerate(row_counts)}
    for rows, (bf16_on, _) in by_rows.items():
        assert bf16_on == [packed] * per_forward, rows
    assert set(by_rows[1][1]) == {native_forward.ROUTES["torch"], native_forward.ROUTES[isa]}
    assert set(by_rows[32][1]) == {native_forward.ROUTES["torch"]}
    assert native == [True] * 2 * len(row_counts)


def test_steps_aside(target, native):
    """Where the op path must run: a dispatch mode watching the calls and more than MAX_ROWS rows; a block past the
    cache is refused before either runs. A weight that is not bf16-exact (no AMX tiles) takes the fp32 kernel on
    both paths: the same bits."""
    lt = _pair(target)[0]
    ids = torch.randint(0, VOCAB, (1, 8))
    with torch.inference_mode():
        lt.forward(ids, torch.tensor([0]), 8)
        assert native == [True]
        with _Watching():
            lt.forward(ids, torch.tensor([8]), 16)
        assert native == [True, False]
        big = _pair(target, capacity=native_forward.MAX_ROWS + 1)[0]
        big.forward(torch.randint(0, VOCAB, (1, native_forward.MAX_ROWS + 1)), torch.tensor([0]),
                    native_forward.MAX_ROWS + 1)
        assert len(native) == 2  # not even tried
        with pytest.raises(ValueError, match=r"reaches cache row 84, past the 80 rows of the cache"):
            lt.forward(ids, torch.tensor([CAP - 4]), CAP + 4)  # rows past the cache: refused before any work
        assert len(native) == 2
    w = target.model.layers[1].mlp.down_proj.weight
    saved = w.detach().clone()
    try:
        with torch.no_grad():
            w[0, 0] += 1e-3  # no longer a bf16 value: its tiles are None
        a, b = _pair(target)
        got = _forward(a, True, ids, torch.tensor([0]), 8)
        want = _forward(b, False, ids, torch.tensor([0]), 8)
        assert native[-1] is True
        _assert_same(got, want, a, b)
    finally:
        with torch.no_grad():
            w.copy_(saved)


def test_kept_plan_follows_in_place_updates_and_settings(target, native, monkeypatch):
    """The native forward keeps its projections' routes while cpu_linear.route_key holds: a weight updated in place
    (off the bf16 grid, then back) and a switched setting are planned anew, so each forward of the same lean target
    equals the op path's on a fresh one."""
    replanned = []
    plan = native_forward._Projection.plan

    def recorded(self, rows, out):
        plan(self, rows, out)
        replanned.append(rows)
    monkeypatch.setattr(native_forward._Projection, "plan", recorded)
    lt, ref = _pair(target)  # stepped side by side: the native forward and the op path
    w = target.model.layers[2].self_attn.o_proj.weight
    saved = w.detach().clone()
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, VOCAB, (1, 9), generator=g)
    steps = [torch.randint(0, VOCAB, (1, 1), generator=g) for _ in range(4)]

    def step(i):
        args = (steps[i], torch.tensor([9 + i]), 10 + i)
        _assert_same(_forward(lt, True, *args), _forward(ref, False, *args), lt, ref)
    try:
        for x, on in ((lt, True), (ref, False)):
            _forward(x, on, prompt, torch.tensor([0]), 9)
        step(0)
        planned = len(replanned)
        step(1)
        assert len(replanned) == planned  # nothing changed: the kept plan
        with torch.no_grad():
            w[0, 0] += 1e-3  # no longer a bf16 value: no packed copy, no tiles
        step(2)
        assert len(replanned) == planned + 12  # four projections a layer, three layers
        before = cpu_linear.set_bf16(not cpu_linear._bf16_on)
        try:
            step(3)
        finally:
            cpu_linear.set_bf16(before)
        assert len(replanned) == planned + 24
    finally:
        with torch.no_grad():
            w.copy_(saved)
    assert all(native)
