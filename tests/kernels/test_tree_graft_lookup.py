"""tree_graft_lookup: the prompt-lookup continuation against a brute-force definition, the grafted trees' invariants
(a valid tree holding the continuation as a root path, the given prefix kept, as few nodes given up as fit), the
Triton and CPU kernels equal to the reference (integers exactly), and clear errors."""
import pytest
import torch

import dflash_kernels as dk
from dflash_kernels.tree import build_tree_reference, lookup_continuation, tree_graft_lookup_reference

CPU = torch.get_default_device().type == "cpu"
KERNELS = ["triton"] + (["cpu"] if CPU else [])


def _brute_continuation(seq, max_n, min_n, limit):
    """The longest recurring suffix, then its latest recurrence: the max over (n, s) of the matches."""
    end = len(seq)
    found = [(n, s) for n in range(min_n, max_n + 1) for s in range(end - n)
             if seq[s:s + n] == seq[end - n:]]
    if not found:
        return []
    n, s = max(found)
    return seq[s + n:s + n + limit]


def test_lookup_continuation_is_the_longest_then_latest_recurrence():
    seq = [5, 1, 2, 3, 9, 1, 2, 3, 7, 4, 2, 3]
    assert lookup_continuation(seq, 4, 1, 3) == [7, 4, 2]      # "2 3" recurs latest at 6 (the 3-gram "4 2 3" not)
    assert lookup_continuation(seq, 1, 1, 8) == [7, 4, 2, 3]   # "3" at index 7: what follows, up to the end
    assert lookup_continuation([1, 2, 3], 4, 1, 5) == []       # nothing recurs
    assert lookup_continuation([4, 4], 2, 1, 5) == [4]         # the occurrence may overlap the suffix
    g = torch.Generator().manual_seed(7)
    for _ in range(300):
        seq = torch.randint(0, 3, (int(torch.randint(0, 30, (), generator=g)),), generator=g).tolist()
        max_n = int(torch.randint(1, 6, (), generator=g))
        min_n = int(torch.randint(1, max_n + 1, (), generator=g))
        limit = int(torch.randint(0, 8, (), generator=g))
        assert lookup_continuation(seq, max_n, min_n, limit) == _brute_continuation(seq, max_n, min_n, limit)


def _case(r, b, v, budget, cap, alphabet, depth):
    logits = torch.randn(r, b - 1, v)
    anchor = torch.randint(0, alphabet, (r,))
    trees = build_tree_reference(logits, anchor, budget, vocab_ids=torch.randperm(max(alphabet, v))[:v])
    tokens = torch.randint(0, alphabet, (r, cap))
    lengths = torch.randint(0, cap + 1, (r,))
    rows = lengths > 0
    tokens[rows, lengths[rows] - 1] = anchor[rows]            # the root is the row's last committed token
    return trees, tokens, lengths


def _path_end(tok, par, cont, nodes):
    """How far ``cont`` runs down from the root among the first ``nodes`` nodes."""
    node, d = 0, 0
    while d < len(cont):
        kids = [i for i in range(1, nodes) if par[i] == node and tok[i] == cont[d]]
        if not kids:
            break
        node, d = kids[0], d + 1
    return d


@pytest.mark.parametrize("depth", [0, 1, 3, 7])
def test_grafted_trees_hold_the_continuation_and_give_up_least(depth):
    for _ in range(25):
        (tok, par, dep), tokens, lengths = _case(3, 8, 3, int(torch.randint(1, 20, ())), 40, 4, depth)
        out = tree_graft_lookup_reference(tok, par, dep, tokens, lengths, depth=depth, max_ngram=4, min_ngram=1)
        t = tok.shape[1]
        for r in range(3):
            o_tok, o_par, o_dep = (x[r].tolist() for x in out)
            cont = lookup_continuation(tokens[r, :int(lengths[r])].tolist(), 4, 1, min(depth, t - 1))
            assert o_par[0] == -1 and o_dep[0] == 0 and o_tok[0] == int(tok[r, 0])
            for i in range(1, t):                              # a tree: parents first, depths, distinct siblings
                assert 0 <= o_par[i] < i and o_dep[i] == o_dep[o_par[i]] + 1
            assert len({(o_par[i], o_tok[i]) for i in range(1, t)}) == t - 1
            assert _path_end(o_tok, o_par, cont, t) == len(cont)   # the whole continuation is a root path
            kept = next((i for i in range(t) if (o_tok[i], o_par[i], o_dep[i]) != (int(tok[r, i]), int(par[r, i]),
                                                                                   int(dep[r, i]))), t)
            m = t - kept
            assert m == 0 or len(cont) - _path_end(tok[r].tolist(), par[r].tolist(), cont, t - m + 1) > m - 1
            if not cont:
                assert m == 0


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("shape", [(1, 2, 2, 1, 1), (3, 8, 3, 7, 90), (2, 5, 6, 30, 257), (4, 8, 2, 64, 33)],
                         ids=["one-node", "demo-like", "wide", "64-nodes"])
def test_kernels_equal_reference(backend, shape):
    r, b, v, budget, cap = shape
    for trial in range(4):
        depth = [b - 1, 1, 0, b - 1][trial]
        max_n, min_n = [(4, 1), (8, 3), (1, 1), (2, 2)][trial]
        (tok, par, dep), tokens, lengths = _case(r, b, v, budget, cap, 3 + trial, depth)
        if trial == 1:  # strided rows of committed tokens and trees (last dims contiguous)
            tokens = torch.cat([tokens, tokens], 1)[:, :cap]
            tok = torch.cat([tok, tok], 1)[:, :tok.shape[1]]
        want = tree_graft_lookup_reference(tok, par, dep, tokens, lengths, depth=depth, max_ngram=max_n,
                                           min_ngram=min_n)
        got = dk.tree_graft_lookup(tok, par, dep, tokens, lengths, depth=depth, max_ngram=max_n, min_ngram=min_n,
                                   backend=backend)
        for w, g in zip(want, got):
            assert g.dtype == torch.int64 and torch.equal(w, g), (trial, w, g)


@pytest.mark.parametrize("backend", ["torch"] + KERNELS)
def test_empty_batch_and_no_change_without_a_recurrence(backend):
    empty = torch.zeros((0, 3), dtype=torch.int64)
    out = dk.tree_graft_lookup(empty, empty, empty, torch.zeros((0, 5), dtype=torch.int64),
                               torch.zeros(0, dtype=torch.int64), depth=2, backend=backend)
    assert all(o.shape == (0, 3) for o in out)
    tok, par, dep = torch.tensor([[9, 1, 2]]), torch.tensor([[-1, 0, 1]]), torch.tensor([[0, 1, 2]])
    out = dk.tree_graft_lookup(tok, par, dep, torch.tensor([[1, 2, 3, 9]]), torch.tensor([4]), depth=2,
                               backend=backend)
    assert all(torch.equal(a, b) for a, b in zip(out, (tok, par, dep)))


@pytest.mark.parametrize("backend", ["torch"] + KERNELS)
@pytest.mark.parametrize("change, match", [
    (dict(tokens=torch.zeros((2, 6), dtype=torch.int32)), "tokens has dtype torch.int32"),
    (dict(lengths=torch.tensor([3])), r"tokens must be \[R=2, C\] .* and lengths \[R=2\]"),
    (dict(tree_depths=torch.zeros((2, 3), dtype=torch.int64)), r"tree_depths must be \[R, T\] = \[2, 4\]"),
    (dict(depth=-1), "depth must be an int >= 0"),
    (dict(depth=True), "depth must be an int"),
    (dict(min_ngram=0), "min_ngram must be an int >= 1"),
    (dict(max_ngram=1, min_ngram=2), r"max_ngram must be an int >= 2, got 1 \(max_ngram >= min_ngram\)"),
    (dict(max_ngram=9), "max_ngram must be <= 8"),
    (dict(lengths=torch.tensor([3, 7])), r"lengths must lie in \[0, C=6\]"),
    (dict(lengths=torch.tensor([-1, 2])), r"lengths must lie in \[0, C=6\]"),
])
def test_bad_input_is_refused(backend, change, match):
    if "lengths must lie" in match and not CPU:
        pytest.skip("device kernels clamp the lengths instead of reading them on the host")
    args = dict(tree_tokens=torch.tensor([[5, 1, 2, 3], [5, 1, 2, 3]]), tree_parents=torch.tensor([[-1, 0, 0, 1]] * 2),
                tree_depths=torch.tensor([[0, 1, 1, 2]] * 2), tokens=torch.randint(0, 3, (2, 6)),
                lengths=torch.tensor([6, 2]), depth=2, max_ngram=4, min_ngram=1)
    args.update(change)
    with pytest.raises(TypeError if "dtype" in match else ValueError, match=match):
        dk.tree_graft_lookup(**args, backend=backend)
