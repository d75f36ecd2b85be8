"""The PyTorch references of inject_context_kv, draft_attention and verify_attention under CUDA-graph capture rules
(no host read, static shapes; ``dflash.graphs`` checks the op bodies on the "torch" backend), and the attention
references' static form (every capacity row, the ones past a length masked) against the definition."""
import pytest
import torch

from dflash.graphs import record
from dflash_kernels import draft_attention, inject_context_kv, verify_attention
from dflash_kernels.tree import tree_ancestor_mask_reference
from helpers.caches import random_block_table, to_paged
from helpers.splits import da
from helpers.tol import assert_within_rule


def _inv_freq(d):
    return 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))


def _bits(t):
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _caches(layout, n, cap, kvh, d, dtype):
    """(k_cache, v_cache, addressing kwargs) holding random rows in one of the three layouts."""
    kc, vc = (torch.randn(n + 2, cap, kvh, d).to(dtype) for _ in range(2))
    if layout == "batch_idx":
        return kc, vc, {"cache_batch_idx": torch.randperm(n + 2)[:n]}
    if layout == "contiguous":
        return kc[:n], vc[:n], {}
    page_size = 3
    table, pages = random_block_table(n, cap, page_size)
    cap_paged = table.shape[1] * page_size
    full_k, full_v = (torch.randn(n, cap_paged, kvh, d).to(dtype) for _ in range(2))
    return (to_paged(full_k, table, pages, page_size).nan_to_num(), to_paged(full_v, table, pages, page_size)
            .nan_to_num(), {"block_table": table})


def _attention_case(dtype, layout, tree):
    n, b, nh, kvh, d, cap = 3, 5, 6, 2, 6, 13
    q, k, v = (torch.randn(n, b, h, d).to(dtype) for h in (nh, kvh, kvh))
    kc, vc, addr = _caches(layout, n, cap, kvh, d, dtype)
    capacity = kc.shape[1] * (addr["block_table"].shape[1] if "block_table" in addr else 1)
    lens = torch.tensor([0, capacity - b, 4])  # empty, filled to the end, partial
    qw, kw = ((1 + 0.3 * torch.randn(d)).to(dtype) for _ in range(2))
    extra = {}
    if tree:
        parents = torch.tensor([[-1, 0, 0, 1, 2], [-1, 0, 1, 1, 0], [-1, 0, 1, 2, 3]])
        depths = torch.tensor([[0, 1, 1, 2, 2], [0, 1, 2, 2, 1], [0, 1, 2, 3, 4]])
        extra = {"tree_depths": depths, "tree_mask": tree_ancestor_mask_reference(parents)}
    return (q, k, v, kc, vc, lens, qw, kw), addr, extra


def _run(fn, args, addr, extra, dtype, **kw):
    q, k, v, kc, vc, lens, qw, kw_ = (a.to(dtype) if a.is_floating_point() else a for a in args)
    kc, vc = kc.clone(), vc.clone()
    out = fn(q, k, v, kc, vc, lens, qw, kw_, inv_freq=_inv_freq(q.shape[-1]), **addr, **extra, **kw)
    return out, kc, vc


ATTENTION = {
    "verify_chain": (da.verify_attention_reference, False, {}),
    "verify_tree": (da.verify_attention_reference, True, {}),
    "draft_window": (da.draft_attention_reference, False, {"sliding_window": 3, "block_lens": torch.tensor([5, 2, 1])}),
    "draft_full": (da.draft_attention_reference, False, {}),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["contiguous", "batch_idx", "paged"])
@pytest.mark.parametrize("which", list(ATTENTION))
def test_static_attention_reference_is_the_definition(monkeypatch, which, layout, dtype):
    """The static form (what runs on a device or under capture) against the fp64 definition (2x rule, the
    definition in ``dtype`` as baseline); the cache rows it writes are the definition's, bit for bit."""
    fn, tree, kw = ATTENTION[which]
    args, addr, extra = _attention_case(dtype, layout, tree)
    ref64, kc64, _ = _run(fn, args, addr, extra, torch.float64, **kw)
    lowp, kc_l, vc_l = _run(fn, args, addr, extra, dtype, **kw)
    monkeypatch.setattr(da, "_lengths_on_host", lambda cache_lens: False)
    out, kc, vc = _run(fn, args, addr, extra, dtype, **kw)
    valid = (kw["block_lens"] if "block_lens" in kw else torch.full((3,), 5))
    rows = torch.arange(5)[None, :] < valid[:, None]  # rows past block_lens are unspecified
    assert_within_rule(out[rows], ref64[rows], lowp[rows], which)
    assert torch.equal(_bits(kc), _bits(kc_l)) and torch.equal(_bits(vc), _bits(vc_l))


def _inject_args(dtype):
    k, v = (torch.randn(9, 2, 6).to(dtype) for _ in range(2))
    kc, vc = (torch.full((3, 8, 2, 6), float("nan"), dtype=dtype) for _ in range(2))
    return (k, v, (1 + 0.3 * torch.randn(6)).to(dtype), torch.tensor([0, 4, 4, 8]), torch.tensor([2, 5, 6]), kc, vc)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inject_context_kv_reference_captures_and_writes_the_eager_bits(dtype):
    """Rows past the capacity (request 2), an empty request and a row past cu[N] included; the capture rules
    refuse any host read or data-dependent shape inside the reference."""
    eager = _inject_args(dtype)
    captured = tuple(t.clone() for t in eager)
    inv_freq = _inv_freq(6)
    inject_context_kv(*eager, inv_freq=inv_freq, backend="torch")
    graph = record(lambda: inject_context_kv(*captured, inv_freq=inv_freq, backend="torch"), torch_op_bodies=True)
    assert [str(call[0]) for call in graph.calls] == ["dflash.inject_context_kv.default"]
    for got, want in zip(captured[5:], eager[5:]):
        assert torch.equal(_bits(got), _bits(want))


@pytest.mark.parametrize("op", ["draft_attention", "verify_attention"])
def test_attention_references_capture(op):
    """The torch backend's attention under the capture rules: the static form, within the rule of the eager
    (host-length) one, its cache writes bit for bit."""
    args, addr, _ = _attention_case(torch.float32, "paged", False)
    fn, reference = {"draft_attention": (draft_attention, da.draft_attention_reference),
                     "verify_attention": (verify_attention, da.verify_attention_reference)}[op]
    eager = _run(lambda *a, **kw: fn(*a, **kw, backend="torch"), args, addr, {}, torch.float32)
    ref64 = _run(reference, args, addr, {}, torch.float64)
    captured = []
    record(lambda: captured.extend(_run(lambda *a, **kw: fn(*a, **kw, backend="torch"), args, addr, {},
                                        torch.float32)), torch_op_bodies=True)
    assert_within_rule(captured[0], ref64[0], eager[0], op)
    assert torch.equal(_bits(captured[1]), _bits(eager[1])) and torch.equal(_bits(captured[2]), _bits(eager[2]))
