"""Draft trees: build_tree, tree_ancestor_mask, tree_accept_greedy / tree_accept_sample, tree_compact and the tree
arguments of verify_attention. References against independent brute-force definitions; kernels equal to the
references (integers exactly); sampling by chi-square with a wrong rule shown to fail."""
import itertools

import numpy as np
import pytest
import torch

import dflash_kernels as dk
from dflash_kernels.cpu import native as cpu_native
from helpers.tol import chi2
from dflash_kernels.draft_attention import verify_attention_reference
from dflash_kernels.verify import filter_logits_reference
from dflash_kernels.tree import (
    build_tree_reference, draft_log_normalizer, tree_accept_greedy_reference, tree_ancestor_mask_reference,
    tree_compact_reference,
)

BACKENDS = ["torch", "triton"]
CPU_ONLY = pytest.mark.skipif(torch.get_default_device().type != "cpu", reason="CPU tensors only")


def _brute_tree(logits, anchor, budget, vocab_ids=None):
    """Every prefix scored (fp32 sums root to leaf), sorted by the documented total order."""
    r, p, v = logits.shape
    lp = (logits.float() - draft_log_normalizer(logits)[..., None]).cpu().numpy()
    z = logits.float().cpu().numpy()
    out = []
    for req in range(r):
        cands = []
        for d in range(1, p + 1):
            for pre in itertools.product(range(v), repeat=d):
                s = np.float32(0.0)
                for i, x in enumerate(pre):
                    s = np.float32(s + lp[req, i, x])
                cands.append((pre, s))
        chosen = [()]
        while len(chosen) < budget + 1:
            # Among prefixes whose parent is chosen: the best by the total order (this is the definition's order).
            index = {pre: i for i, pre in enumerate(chosen)}
            ready = [(pre, s) for pre, s in cands if pre[:-1] in index and pre not in index]
            best = min(ready, key=lambda c: (-float(c[1]), len(c[0]), index[c[0][:-1]],
                                             -float(z[req, len(c[0]) - 1, c[0][-1]]), c[0][-1]))
            chosen.append(best[0])
        index = {pre: i for i, pre in enumerate(chosen)}
        tok = [int(anchor[req])] + [int(vocab_ids[c[-1]]) if vocab_ids is not None else c[-1] for c in chosen[1:]]
        par = [-1] + [index[c[:-1]] for c in chosen[1:]]
        dep = [len(c) for c in chosen]
        out.append((tok, par, dep))
    return tuple(torch.tensor([o[i] for o in out]) for i in range(3))


@pytest.mark.parametrize("ties", [False, True])
def test_build_tree_reference_is_the_best_prefixes(ties):
    r, p, v, budget = 3, 3, 4, 17
    logits = torch.randn(r, p, v, dtype=torch.float64).float() * 2
    if ties:
        logits = torch.randint(-2, 2, (r, p, v)).float()   # many exactly equal scores: the tie rule decides
        logits[1] = 0.0                                    # uniform rows: equal scores, many parents
        logits[2, 1] = float("-inf")                       # a one-hot row (log p = 0, -inf): a child ties its
        logits[2, 1, 2] = 1.0                              # parent's score and its parent's siblings'
    anchor = torch.tensor([5, 6, 7])
    vocab_ids = torch.tensor([10, 3, 42, 7])
    got = build_tree_reference(logits.cpu(), anchor.cpu(), budget, vocab_ids=vocab_ids.cpu())
    want = _brute_tree(logits.cpu(), anchor.cpu(), budget, vocab_ids.cpu())
    for g, w in zip(got, want):
        assert torch.equal(g.cpu(), w)


def _random_tree(r, t, max_depth):
    """Random valid node arrays: parents precede children, depth <= max_depth."""
    parents = torch.full((r, t), -1, dtype=torch.int64)
    depths = torch.zeros((r, t), dtype=torch.int64)
    for req in range(r):
        for i in range(1, t):
            while True:
                par = int(torch.randint(0, i, ()))
                if depths[req, par] < max_depth:
                    break
            parents[req, i], depths[req, i] = par, depths[req, par] + 1
    return parents, depths


def test_ancestor_mask_reference():
    parents, _ = _random_tree(2, 70, 6)                    # 70 nodes: two words per row
    mask = tree_ancestor_mask_reference(parents)
    assert mask.shape == (2, 70, 2) and mask.dtype == torch.int64
    for req in range(2):
        for i in range(70):
            anc, j = set(), i
            while j >= 0:
                anc.add(j)
                j = int(parents[req, j])
            bits = {w * 64 + b for w in range(2) for b in range(64) if (int(mask[req, i, w]) >> b) & 1}
            assert bits == anc


def _attn_inputs(n, b, nh, kvh, d, lens, cap, dtype):
    q = torch.randn(n, b, nh, d, dtype=dtype)
    k = torch.randn(n, b, kvh, d, dtype=dtype)
    v = torch.randn(n, b, kvh, d, dtype=dtype)
    kc = torch.randn(n, cap, kvh, d, dtype=dtype)
    vc = torch.randn(n, cap, kvh, d, dtype=dtype)
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    qw, kw = torch.rand(d) + 0.5, torch.rand(d) + 0.5
    return q, k, v, kc, vc, torch.tensor(lens), qw.to(dtype), kw.to(dtype), inv


def test_tree_attention_reference_is_each_nodes_chain():
    """Node i's output equals a chain verify over its root-to-node path (same positions, same keys)."""
    n, t, nh, kvh, d, cap = 2, 9, 4, 2, 8, 24
    q, k, v, kc, vc, lens, qw, kw, inv = _attn_inputs(n, t, nh, kvh, d, [5, 0], cap, torch.float64)
    parents, depths = _random_tree(n, t, 4)
    kc_t, vc_t = kc.clone(), vc.clone()
    out = verify_attention_reference(q, k, v, kc_t, vc_t, lens, qw, kw, inv_freq=inv, tree_depths=depths,
                                     tree_mask=tree_ancestor_mask_reference(parents))
    for r in range(n):
        c = int(lens[r])
        for i in range(t):
            path, j = [], i
            while j >= 0:
                path.insert(0, j)
                j = int(parents[r, j])
            sel = torch.tensor(path)
            kc_c, vc_c = kc[r:r + 1].clone(), vc[r:r + 1].clone()
            o = verify_attention_reference(q[r:r + 1, sel], k[r:r + 1, sel], v[r:r + 1, sel], kc_c, vc_c, lens[r:r + 1],
                                           qw, kw, inv_freq=inv)
            torch.testing.assert_close(out[r, i], o[0, -1], rtol=1e-12, atol=1e-12)
            # The cache row of node i holds its K rotated at its depth (the chain wrote it at row c + depth).
            torch.testing.assert_close(kc_t[r, c + i], kc_c[0, c + len(path) - 1], rtol=0, atol=0)
            assert torch.equal(vc_t[r, c + i], v[r, i])


def test_greedy_walk_reference():
    # Tree: 0 -> 1 (tok 3) -> 3 (tok 4); 0 -> 2 (tok 5); 1 -> 4 (tok 6).
    tokens = torch.tensor([[9, 3, 5, 4, 6]])
    parents = torch.tensor([[-1, 0, 0, 1, 1]])
    logits = torch.zeros(1, 5, 8)
    logits[0, 0, 3] = logits[0, 1, 6] = logits[0, 4, 2] = 1.0
    path, acc, bonus = tree_accept_greedy_reference(logits, tokens, parents, block_size=4)
    assert path.tolist() == [[0, 1, 4, -1]] and acc.tolist() == [2] and bonus.tolist() == [2]
    path, acc, bonus = tree_accept_greedy_reference(logits, tokens, parents, block_size=2)
    assert path.tolist() == [[0, 1]] and acc.tolist() == [1] and bonus.tolist() == [6]


def test_compact_reference():
    cache = torch.randn(2, 3, 10, 1, 2)
    path = torch.tensor([[0, 2, 5, -1], [0, -1, -1, -1]])
    accepted, start = torch.tensor([2, 0]), torch.tensor([1, 4])
    want = cache.clone()
    want[:, 2, 1 + 1] = cache[:, 2, 1 + 2]
    want[:, 2, 1 + 2] = cache[:, 2, 1 + 5]
    k, v = cache.clone(), cache.clone()
    tree_compact_reference(k, v, path, accepted, start, cache_batch_idx=torch.tensor([2, 0]))
    assert torch.equal(k, want) and torch.equal(v, want)


def test_validation_errors():
    lg = torch.randn(2, 3, 4)
    with pytest.raises(ValueError, match="budget"):
        dk.build_tree(lg, torch.tensor([1, 2]), 0)
    with pytest.raises(ValueError, match="distinct prefixes"):
        dk.build_tree(torch.randn(2, 1, 4), torch.tensor([1, 2]), 5)
    with pytest.raises(ValueError, match="anchor"):
        dk.build_tree(lg, torch.tensor([1]), 3)
    with pytest.raises(TypeError, match="anchor"):
        dk.build_tree(lg, torch.tensor([1, 2], dtype=torch.int32), 3)
    with pytest.raises(ValueError, match="vocab_ids"):
        dk.build_tree(lg, torch.tensor([1, 2]), 3, vocab_ids=torch.arange(3))
    tok, par = torch.zeros(2, 5, dtype=torch.long), torch.zeros(2, 5, dtype=torch.long)
    with pytest.raises(ValueError, match="tree_parents"):
        dk.tree_accept_greedy(torch.randn(2, 5, 7), tok, par[:, :4], block_size=3)
    with pytest.raises(ValueError, match="block_size"):
        dk.tree_accept_greedy(torch.randn(2, 5, 7), tok, par, block_size=0)
    with pytest.raises(ValueError, match="temperature"):
        dk.tree_accept_sample(torch.randn(2, 5, 7), tok, par, block_size=3, temperature=0.0, seed=0, offset=0)
    cache = torch.randn(2, 2, 8, 1, 4)
    with pytest.raises(ValueError, match="accepted"):
        dk.tree_compact(cache, cache.clone(), torch.zeros(2, 3, dtype=torch.long), torch.zeros(3, dtype=torch.long),
                        torch.zeros(2, dtype=torch.long))
    q, k, v, kc, vc, lens, qw, kw, inv = _attn_inputs(2, 3, 2, 1, 4, [1, 2], 8, torch.float32)
    with pytest.raises(ValueError, match="tree_depths and tree_mask"):
        dk.verify_attention(q, k, v, kc, vc, lens, inv_freq=inv, tree_depths=torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="tree_mask must be"):
        dk.verify_attention(q, k, v, kc, vc, lens, inv_freq=inv, tree_depths=torch.zeros(2, 3, dtype=torch.long),
                            tree_mask=torch.zeros(2, 3, 2, dtype=torch.long))


TREE_ATTN_CASES = [  # n, T nodes, nH, kvH, D, context lengths, capacity, paged
    (2, 9, 4, 2, 16, [130, 0], 160, False),     # MIN_CHUNK 64: 3 active splits and 1
    (3, 17, 6, 2, 16, [5, 70, 140], 160, True),  # paged, ragged
    (2, 9, 4, 2, 16, [200, 155], 160, False),    # lengths past the capacity: the context read up to it
    (3, 9, 4, 2, 16, [170, 158, 3], 160, True),  # the same, paged; 0, 2 and 9 rows written
]


@pytest.mark.parametrize("backend", ["triton", pytest.param("cpu", marks=CPU_ONLY)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", TREE_ATTN_CASES, ids=["contiguous", "paged", "past_capacity", "past_capacity_paged"])
def test_verify_attention_tree_kernel(monkeypatch, backend, dtype, case):
    """The Triton kernel (several context splits active) and the "cpu" backend (fp32 on a contiguous cache: its
    native kernel) with a tree against the fp64 reference (2x rule): outputs, K rows written at cache_lens + node
    index (V bit for bit), nothing else written."""
    from helpers.caches import random_block_table, to_paged
    from helpers.splits import da
    from helpers.tol import assert_within_rule

    monkeypatch.setattr(da, "MIN_CHUNK", 64)
    n, t, nh, kvh, d, lens, cap, paged = case
    q, k, v, kc, vc, cl, qw, kw, inv = _attn_inputs(n, t, nh, kvh, d, lens, cap, dtype)
    parents, depths = _random_tree(n, t, 5)
    mask = tree_ancestor_mask_reference(parents)
    tree = dict(tree_depths=depths, tree_mask=mask, inv_freq=inv, attention_scaling=1.1, scale=0.8 * d ** -0.5)
    refs = []
    for conv in (torch.Tensor.double, torch.Tensor.clone):
        kc_r, vc_r = conv(kc), conv(vc)
        out = verify_attention_reference(conv(q), conv(k), conv(v), kc_r, vc_r, cl, conv(qw), conv(kw), **tree)
        refs.append((out, kc_r, vc_r))
    kc_in, vc_in, where = kc.clone(), vc.clone(), {}
    if paged:
        table, pages = random_block_table(n, cap, 16)
        kc_in, vc_in, where = to_paged(kc, table, pages, 16), to_paged(vc, table, pages, 16), dict(block_table=table)
    out = dk.verify_attention(q, k, v, kc_in, vc_in, cl, qw, kw, num_splits=4, backend=backend, **where, **tree)
    assert_within_rule(out, refs[0][0], refs[1][0], "tree verify_attention output")
    if paged:
        rows = lambda r, s: (table[r, s // 16], s % 16)  # noqa: E731
    else:
        rows = lambda r, s: (r, s)  # noqa: E731
    for r, c in enumerate(lens):
        got_k = torch.stack([kc_in[rows(r, s)] for s in range(cap)])
        got_v = torch.stack([vc_in[rows(r, s)] for s in range(cap)])
        blk = slice(c, min(c + t, cap))
        assert torch.equal(got_v[blk], v[r, :blk.stop - c])
        assert_within_rule(got_k[blk], refs[0][1][r, blk], refs[1][1][r, blk], "tree K rows")
        keep = torch.ones(cap, dtype=torch.bool)
        keep[blk] = False
        assert torch.equal(got_k[keep], kc[r][keep]) and torch.equal(got_v[keep], vc[r][keep])


@pytest.mark.skipif(torch.get_default_device().type != "cpu" or torch.cuda.is_available(), reason="CPU tensors only")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_verify_attention_tree_cpu_torch_formulas_are_the_reference_bit_for_bit(monkeypatch, dtype):
    """backend="cpu" without its native kernel, with a tree (positions from the depths, the block mask from the
    ancestor bits; two trees in a row, the second written into the first's tensors, so the memoised RoPE tables
    and masks must follow the values): output and caches identical to the reference's."""
    monkeypatch.setenv(cpu_native.ENV, "0")
    n, t, nh, kvh, d, lens, cap = 3, 9, 4, 2, 16, [0, 5, 70], 96
    q, k, v, kc, vc, cl, qw, kw, inv = _attn_inputs(n, t, nh, kvh, d, lens, cap, dtype)
    depths = mask = None
    for _ in range(2):
        parents, new_depths = _random_tree(n, t, 5)
        new_mask = tree_ancestor_mask_reference(parents)
        if mask is None:
            depths, mask = new_depths, new_mask
        else:
            assert not torch.equal(mask, new_mask)
            depths.copy_(new_depths), mask.copy_(new_mask)
        tree = dict(tree_depths=depths, tree_mask=mask, inv_freq=inv, attention_scaling=1.1, scale=0.8 * d ** -0.5)
        got, want = [], []
        for backend, res in (("cpu", got), ("torch", want)):
            kc_b, vc_b = kc.clone(), vc.clone()
            res += [dk.verify_attention(q, k, v, kc_b, vc_b, cl, qw, kw, backend=backend, **tree), kc_b, vc_b]
        for a, b in zip(got, want):  # bit for bit (NaN-safe: compare the raw bits)
            assert torch.equal(a.view(torch.int16 if a.element_size() == 2 else torch.int32),
                               b.view(torch.int16 if b.element_size() == 2 else torch.int32))


# ------------------------------------------------------------------------------------------------------------
# kernels equal to the references
# ------------------------------------------------------------------------------------------------------------

BUILD_CASES = [  # R, B-1, V', budget, dtype, vocab ids, ties
    (3, 4, 150, 20, torch.float32, False, False),     # 3 vocab splits of 64 under the interpreter
    (2, 6, 5, 40, torch.bfloat16, True, False),       # budget > V': every rank used
    (2, 3, 70, 24, torch.float32, False, True),       # exact score ties: every key of the tie rule decides
    (1, 1, 9, 9, torch.float32, True, False),         # one level: the whole draft vocabulary
]


def _tied_logits(r, p, v):
    """Integer logits with 2-3 tied maxima per row (ties between siblings and between cousins: the parent
    rule) and a one-hot depth-2 row (-inf elsewhere: a child ties its parent's tied siblings: the depth rule)."""
    logits = torch.randint(-3, 2, (r, p, v)).float()
    for req in range(r):
        for row in range(p):
            logits[req, row, torch.randperm(v)[:2 + (req + row) % 2]] = 6.0
    logits[:, 1] = float("-inf")
    logits[:, 1, 5] = 5.0
    return logits


@pytest.mark.parametrize("case", BUILD_CASES, ids=[f"case{i}" for i in range(len(BUILD_CASES))])
def test_build_tree_kernel_equals_reference(case):
    r, p, v, budget, dtype, use_ids, ties = case
    logits = (_tied_logits(r, p, v) if ties else torch.randn(r, p, v) * 3).to(dtype)
    logits = torch.cat([torch.randn(r, 1, v).to(dtype), logits], 1)[:, 1:]   # strided rows: a view of the block
    anchor = torch.randint(0, 1000, (r,))
    vocab_ids = torch.randperm(1000)[:v] if use_ids else None
    want = dk.build_tree(logits, anchor, budget, vocab_ids=vocab_ids, backend="torch")
    for backend in ("triton", "cpu") if logits.device.type == "cpu" else ("triton",):
        got = dk.build_tree(logits, anchor, budget, vocab_ids=vocab_ids, backend=backend)
        for name, g, w in zip(("tokens", "parents", "depths"), got, want):
            assert g.dtype == torch.int64 and torch.equal(g, w), (backend, name)


@CPU_ONLY
@pytest.mark.parametrize("budget", [1, 7, 27, 63])
def test_build_tree_cpu_equals_reference(budget):
    """The "cpu" backend (C, cpu_native) at the demo draft's shapes (B - 1 = 7 positions, 4,096 draft ids) and with
    ties, bit for bit; a +inf logit (log p NaN) leaves the decision to the reference."""
    from dflash_kernels.cpu import native as cpu_native
    r, p, v = 3, 7, 4096
    logits = torch.randn(r, p, v) * 3
    logits[1] = torch.randint(-2, 3, (p, v)).float()     # many exactly tied scores: the tie rule decides
    anchor = torch.randint(0, 49152, (r,))
    vocab_ids = torch.randperm(49152)[:v]
    assert cpu_native.build_tree(logits, draft_log_normalizer(logits), anchor, budget, vocab_ids) is not None
    for bad in (None, float("inf")):
        if bad is not None:
            logits[2, 3, 100] = bad
        want = build_tree_reference(logits, anchor, budget, vocab_ids=vocab_ids)
        got = dk.build_tree(logits, anchor, budget, vocab_ids=vocab_ids, backend="cpu")
        for name, g, w in zip(("tokens", "parents", "depths"), got, want):
            assert torch.equal(g, w), (bad, name)


def test_ancestor_mask_kernel_equals_reference():
    parents, _ = _random_tree(3, 70, 8)
    want = dk.tree_ancestor_mask(parents, backend="torch")
    for backend in ("triton", "cpu") if parents.device.type == "cpu" else ("triton",):
        assert torch.equal(dk.tree_ancestor_mask(parents, backend=backend), want), backend
    strided = torch.cat([parents, parents], 1)[:, :70]   # a view with a row stride of 140
    assert torch.equal(dk.tree_ancestor_mask(strided, backend="cpu" if strided.device.type == "cpu" else "torch"), want)


@CPU_ONLY
def test_ancestor_mask_cpu_rejects_a_parent_that_is_not_earlier():
    parents, _ = _random_tree(2, 9, 4)
    for node, bad in ((4, 4), (4, 7), (0, 2), (3, -1)):
        broken = parents.clone()
        broken[1, node] = bad
        with pytest.raises(ValueError, match=rf"tree_parents\[1, {node}\] = {bad} is not a valid parent"):
            dk.tree_ancestor_mask(broken, backend="cpu")


def _walk_case(r, t, v, max_depth, dtype):
    """Random trees with tokens drawn from few ids (siblings may share one) and logits whose argmax often is a
    child; request 2's argmax at every node is its first child's token, so it walks to a leaf."""
    parents, _ = _random_tree(r, t, max_depth)
    parents[2, 2] = 1                                    # at least depth 2
    tokens = torch.randint(0, 4, (r, t))
    logits = torch.randn(r, t, v)
    logits[..., :4] += 3.0
    for n in range(t):
        kids = (parents[2] == n).nonzero().flatten()
        if kids.numel():
            logits[2, n, tokens[2, kids[0]]] = 100.0
    return logits.to(dtype), tokens, parents


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_walk_kernel_equals_reference(dtype):
    """V = 2500: two vocab splits under the interpreter, merged per visited node."""
    logits, tokens, parents = _walk_case(16, 13, 2500, 5, dtype)
    logits[0, :, 7] = float("nan")                       # NaN counts as the maximum, as torch.argmax
    logits[1, :, 2100] = 50.0                            # the argmax in the second split
    for bsz in (3, 6):
        want = dk.tree_accept_greedy(logits, tokens, parents, block_size=bsz, backend="torch")
        for backend in ("triton", "cpu") if logits.device.type == "cpu" else ("triton",):
            got = dk.tree_accept_greedy(logits, tokens, parents, block_size=bsz, backend=backend)
            for g, w in zip(got, want):
                assert torch.equal(g, w), backend
    assert int(want[1][2]) >= 2 and int(want[2][1]) == 2100


@pytest.mark.parametrize("backend", BACKENDS + (["cpu"] if torch.get_default_device().type == "cpu" else []))
def test_greedy_walk_on_tokens_is_the_walk_on_logits(backend):
    """tree_accept_greedy_tokens on argmax(logits) = tree_accept_greedy on the logits (NaN rows, int32 tokens), and
    not the walk on another node's argmax (each node's own row decides)."""
    logits, tokens, parents = _walk_case(16, 13, 700, 5, torch.float32)
    logits[0, :, 7] = float("nan")
    target = logits.argmax(-1)
    for bsz in (1, 3, 6):
        want = dk.tree_accept_greedy(logits, tokens, parents, block_size=bsz, backend="torch")
        for t in (target, target.to(torch.int32)):
            got = dk.tree_accept_greedy_tokens(t, tokens, parents, block_size=bsz, backend=backend)
            for g, w in zip(got, want):
                assert torch.equal(g, w), (backend, bsz)
    shifted = dk.tree_accept_greedy_tokens(target.roll(1, dims=1), tokens, parents, block_size=6, backend=backend)
    assert not all(torch.equal(g, w) for g, w in zip(shifted, want))
    with pytest.raises(ValueError, match="tree_tokens"):
        dk.tree_accept_greedy_tokens(target[:, :5], tokens, parents, block_size=3, backend=backend)
    with pytest.raises(TypeError, match="target_tokens"):
        dk.tree_accept_greedy_tokens(logits[..., 0], tokens, parents, block_size=3, backend=backend)
    with pytest.raises(ValueError, match="block_size"):
        dk.tree_accept_greedy_tokens(target, tokens, parents, block_size=0, backend=backend)


def test_cold_sampled_walk_kernel_is_the_greedy_walk():
    """At temperature 1e-6 the Gumbel-max winner is the argmax (unless two logits are within ~1e-5): the sampled
    walk (two vocab splits per node row) equals the greedy one."""
    logits, tokens, parents = _walk_case(16, 13, 2500, 5, torch.float32)
    logits[1, :, 2100] = 50.0
    greedy = dk.tree_accept_greedy(logits, tokens, parents, block_size=6, backend="triton")
    cold = dk.tree_accept_sample(logits, tokens, parents, block_size=6, temperature=1e-6, seed=9, offset=1,
                                 backend="triton")
    for g, c in zip(greedy, cold):
        assert torch.equal(g, c)


def test_compact_kernel_equals_reference():
    layers, cap, kvh, d = 3, 20, 2, 6
    path = torch.tensor([[0, 3, 4, 9, -1], [0, -1, -1, -1, -1], [0, 1, 5, -1, -1]])
    accepted, start = torch.tensor([3, 0, 2]), torch.tensor([2, 7, 16])   # request 2: source row 21 is dropped
    for cbi in (None, torch.tensor([3, 0, 1])):
        k = torch.randn(layers, 4, cap, kvh, d)
        v = torch.randn(layers, 4, cap, kvh, d)
        k_ref, v_ref = k.clone(), v.clone()
        dk.tree_compact(k_ref, v_ref, path, accepted, start, cache_batch_idx=cbi, backend="torch")
        assert not torch.equal(k, k_ref), "the case moves rows"
        for backend in ("triton", "cpu") if k.device.type == "cpu" else ("triton",):
            kb, vb = k.clone(), v.clone()
            dk.tree_compact(kb, vb, path, accepted, start, cache_batch_idx=cbi, backend=backend)
            assert torch.equal(kb, k_ref) and torch.equal(vb, v_ref), backend


@pytest.mark.skipif(torch.get_default_device().type != "cpu", reason="CPU tensors only")
def test_compact_cpu_leaves_other_paths_to_the_reference():
    """A path no walk returns (a node revisited, a depth's node below its depth) is the reference's to move (it reads
    every source first); the native moves in depth order hold only for a walk's rising path."""
    layers, cap, kvh, d = 2, 12, 1, 4
    path = torch.tensor([[0, 3, 3, -1], [0, 2, 1, -1]])
    accepted, start = torch.tensor([2, 2]), torch.tensor([1, 0])
    k, v = torch.randn(layers, 2, cap, kvh, d), torch.randn(layers, 2, cap, kvh, d)
    k_ref, v_ref = k.clone(), v.clone()
    dk.tree_compact(k_ref, v_ref, path, accepted, start, backend="torch")
    dk.tree_compact(k, v, path, accepted, start, backend="cpu")
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
    no_layers = torch.zeros(0, 2, cap, kvh, d)  # a walk's path on a cache without layers: nothing to move
    dk.tree_compact(no_layers, no_layers.clone(), torch.tensor([[0, 3, 5, -1]] * 2), accepted, start, backend="cpu")


def _walk_distribution(p, tokens, parents, bsz, first_child_only=False):
    """P[end node, bonus] of the walk with x ~ p[node] at each node. ``first_child_only``: a deliberately wrong
    rule, the chain rule on the tree (only each node's first child can be accepted; other children's tokens
    end the walk as the bonus)."""
    t, v = p.shape
    out = torch.zeros(t, v, dtype=torch.float64)
    reach, depth = {0: 1.0}, {0: 0}
    for n in range(t):
        if n not in reach:
            continue
        kids = {int(tokens[c]): c for c in range(t) if int(parents[c]) == n}
        if first_child_only and kids:
            first = min(kids.values())
            kids = {int(tokens[first]): first}
        for x in range(v):
            if x in kids and depth[n] + 1 < bsz:
                reach[kids[x]], depth[kids[x]] = reach[n] * float(p[n, x]), depth[n] + 1
            else:
                out[n, x] += reach[n] * float(p[n, x])
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_sampled_walk_is_the_targets_distribution(backend):
    """Many copies of one tree in one call: the (end node, bonus) counts against the exact distribution of the
    rule (temperature and top-k applied), and the same counts reject the chain rule applied to the tree."""
    v, bsz, temp, copies = 6, 3, 0.8, 4000
    tokens = torch.tensor([9, 2, 4, 1, 2, 5])
    parents = torch.tensor([-1, 0, 0, 1, 1, 2])             # root: children 2, 4; node 1: 1, 2; node 2: 5
    logits = torch.randn(6, v) * 0.7
    # The second children (token 4 under the root, token 2 under node 1) made likely, whatever the random draw:
    # the wrong rule differs from the right one only where those are drawn.
    logits[0, 4] += 1.5
    logits[1, 2] += 1.5
    p = torch.softmax(filter_logits_reference(logits, temp, top_k=5).double(), -1)
    path, acc, bonus = dk.tree_accept_sample(logits.expand(copies, 6, v).contiguous(),
                                             tokens.expand(copies, 6).contiguous(),
                                             parents.expand(copies, 6).contiguous(), block_size=bsz,
                                             temperature=temp, top_k=5, seed=4321, offset=2**33 + 5, backend=backend)
    end = path.gather(1, acc[:, None]).squeeze(1)
    assert (path[:, 0] == 0).all() and ((acc >= 0) & (acc <= bsz - 1)).all()
    counts = torch.bincount(end * v + bonus, minlength=6 * v).view(6, v)
    stat, crit = chi2(counts, _walk_distribution(p, tokens, parents, bsz), copies)
    assert stat < crit, f"chi2 {stat:.1f} >= {crit:.1f}\n{counts}"
    wrong, wrong_crit = chi2(counts, _walk_distribution(p, tokens, parents, bsz, first_child_only=True), copies)
    assert wrong > wrong_crit, "the test cannot tell the chain rule on the tree apart"


def test_sampled_walk_kernel_is_reproducible_and_uses_the_offset():
    logits, tokens, parents = _walk_case(8, 9, 50, 4, torch.float32)
    kw = dict(block_size=5, temperature=1.3, top_p=0.9, seed=3, backend="triton")
    a = dk.tree_accept_sample(logits, tokens, parents, offset=torch.tensor([10]), **kw)
    b = dk.tree_accept_sample(logits, tokens, parents, offset=10, **kw)
    c = dk.tree_accept_sample(logits, tokens, parents, offset=11, **kw)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, y) for x, y in zip(a, c))


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch(backend):
    """R = 0 requests: empty results, nothing written, no launch."""
    tokens, parents, depths = dk.build_tree(torch.randn(0, 3, 7), torch.zeros(0, dtype=torch.int64), 5,
                                            backend=backend)
    assert tokens.shape == parents.shape == depths.shape == (0, 6)
    assert dk.tree_ancestor_mask(parents, backend=backend).shape == (0, 6, 1)
    logits = torch.randn(0, 6, 11)
    for path, acc, bonus in (dk.tree_accept_greedy(logits, tokens, parents, block_size=4, backend=backend),
                             dk.tree_accept_greedy_tokens(logits.argmax(-1), tokens, parents, block_size=4,
                                                          backend=backend),
                             dk.tree_accept_sample(logits, tokens, parents, block_size=4, temperature=0.5, top_k=3,
                                                   seed=0, offset=0, backend=backend)):
        assert path.shape == (0, 4) and acc.shape == bonus.shape == (0,)
    cache = torch.full((2, 1, 9, 1, 4), float("nan"))
    dk.tree_compact(cache, cache.clone(), path, acc, torch.zeros(0, dtype=torch.int64), backend=backend)
    assert torch.isnan(cache).all()


ALL_BACKENDS = ["torch", "triton", "cpu"]


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_registered_ops_check_their_arguments(backend):
    """Calling ``torch.ops.dflash.*`` directly gets the public function's checks, before any raw pointer is used:
    budget 0, a short or int32 vocab_ids, block_size 0, int32 node arrays, int32 accepted / start (each once
    crashed the process or returned heap contents as token ids)."""
    ops = torch.ops.dflash
    logits, anchor = torch.randn(2, 3, 10), torch.tensor([1, 2])
    with pytest.raises(ValueError, match="budget must be an int >= 1"):
        ops.build_tree(logits, anchor, 0, None, backend)
    with pytest.raises(ValueError, match=r"vocab_ids must be \[V'=10\]"):
        ops.build_tree(logits, anchor, 4, torch.arange(3), backend)
    with pytest.raises(TypeError, match="vocab_ids has dtype torch.int32"):
        ops.build_tree(logits, anchor, 4, torch.arange(10, dtype=torch.int32), backend)
    tokens, parents, _ = dk.build_tree(logits, anchor, 4, backend="torch")
    target = torch.randint(0, 10, tokens.shape)
    with pytest.raises(ValueError, match="block_size must be an int >= 1"):
        ops.tree_accept_greedy_tokens(target, tokens, parents, 0, backend)
    with pytest.raises(ValueError, match="block_size must be an int >= 1"):
        ops.tree_accept_greedy(torch.randn(2, 5, 10), tokens, parents, 0, backend)
    with pytest.raises(TypeError, match="tree_parents has dtype torch.int32"):
        ops.tree_ancestor_mask(parents.int(), backend)
    path, accepted, _ = dk.tree_accept_greedy_tokens(target, tokens, parents, block_size=4, backend="torch")
    k = torch.randn(1, 2, 8, 1, 4)
    for name in ("accepted", "start"):
        args = dict(accepted=accepted, start=torch.tensor([0, 2]))
        args[name] = args[name].int()
        with pytest.raises(TypeError, match=f"{name} has dtype torch.int32"):
            ops.tree_compact(k, k.clone(), path, args["accepted"], args["start"], None, backend)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_ancestor_mask_rejects_bad_parents_on_every_backend(backend):
    """A parent that is not an earlier node (a cycle, a node past the tree, a second root) is a ValueError on every
    backend, from the function and the registered op (the reference looped forever on a cycle; the kernel followed
    it past the parents' buffer)."""
    parents, _ = _random_tree(2, 9, 4)
    for node, bad in ((4, 4), (4, 70), (0, 2), (3, -1)):
        broken = parents.clone()
        broken[1, node] = bad
        for call in (lambda: dk.tree_ancestor_mask(broken, backend=backend),
                     lambda: torch.ops.dflash.tree_ancestor_mask(broken, backend)):
            with pytest.raises(ValueError, match=rf"tree_parents\[1, {node}\] = {bad} is not a valid parent"):
                call()


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("name, value", [("start", [0, -1]), ("cache_batch_idx", [-1, 0]),
                                         ("cache_batch_idx", [0, 3]), ("accepted", [4, 0]), ("accepted", [-1, 0]),
                                         ("path", [[0, -2, 5, -1], [0, 1, -1, -1]])])
def test_compact_rejects_indices_outside_the_cache(backend, name, value):
    """Negative starts or batch rows (host indexing would move another row, the kernels would write before the
    cache), rows past the cache, accepted depths past the path and negative moved nodes are a ValueError naming
    the argument, with the caches untouched."""
    args = dict(path=torch.tensor([[0, 2, 5, -1], [0, 1, -1, -1]]), accepted=torch.tensor([2, 1]),
                start=torch.tensor([1, 0]), cache_batch_idx=torch.tensor([2, 0]))
    args[name] = torch.tensor(value)
    k, v = torch.randn(2, 3, 12, 1, 4), torch.randn(2, 3, 12, 1, 4)
    kn, vn = k.clone(), v.clone()
    with pytest.raises(ValueError, match=f"tree_compact: {name}"):
        dk.tree_compact(kn, vn, args["path"], args["accepted"], args["start"],
                        cache_batch_idx=args["cache_batch_idx"], backend=backend)
    assert torch.equal(kn, k) and torch.equal(vn, v)
