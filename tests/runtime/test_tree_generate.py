"""Tree mode (``tree_budget=N``, DDTree) is lossless and the engine equals the reference loop.

Greedy: the output equals the target's own greedy decoding for block sizes 2..64 and budgets 1..64, in
ragged batches with stop tokens and length limits; the engine ("fast") equals the reference round for
round (tokens and acceptance lengths), eagerly and with emulated CUDA graphs; the same with a prompt-lookup path
grafted into each tree (``lookup_depth``). Sampling: chi-square against the target's exact distribution, with a
wrong acceptance rule shown to fail. Bad budgets and lookup depths: clear errors.

A 6-token vocabulary makes a random draft's trees cover the target's choices often (τ well above the
chain's); an oracle draft (the known continuation boosted in the block logits, corrupted at random) makes
the accepted paths deep, so every path length and the compaction of deep paths are exercised.
"""
from __future__ import annotations

from collections import Counter

import os

import pytest
import torch

import dflash.engine as engine_module
import dflash.reference as reference_module
from dflash import DFlashDraftModel, generate
from dflash.engine import DFlashEngine
from dflash.sampling import sampling_probs
from test_draft_vocab import subset_draft
from test_fast_vs_reference import VOCAB, make_pair
from test_sampling import chi2_rejects, exact_target_distribution
from helpers.tiny_models import make_draft, make_target

# (block size, budget): budgets 1..64 (each at most the distinct sequences a 6-token draft has), blocks 2..64.
CASES = [(2, 1), (2, 6), (3, 17), (4, 64), (5, 8), (8, 64), (16, 32), (64, 40)]


def target_greedy(target, prompt, max_new, stops=None):
    ids = prompt[None]
    kwargs = {"eos_token_id": stops} if stops else {}
    out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False, **kwargs)
    return out[0]


def requests(block: int):
    """Ragged prompts and limits whose last rounds end at different offsets from max_length."""
    prompts = [torch.randint(0, VOCAB, (n,)) for n in (3, 10, 17)]
    limits = [block + 1, 2 * block + 3, 3 * block - 1] if block <= 16 else [block - 5, block + 1, block + 9]
    return prompts, limits


@pytest.mark.parametrize("block,budget", CASES)
def test_greedy_equals_target_and_reference(block, budget):
    target, draft = make_pair(block)
    prompts, limits = requests(block)
    free = target_greedy(target, prompts[1], limits[1])
    stops = [[], [int(free[-2])], []]  # request 1 stops at (or before) its second-to-last token
    fast = generate(target, draft, prompts, limits, stop_token_ids=stops, backend="fast", tree_budget=budget)
    rounds = generated = 0
    for r, (p, m, s) in enumerate(zip(prompts, limits, stops)):
        expected = target_greedy(target, p, m, s or None)
        ref = generate(target, draft, p, m, stop_token_ids=s, backend="reference", tree_budget=budget)
        assert torch.equal(ref.sequences[0], expected), (block, budget, r)
        assert torch.equal(fast.sequences[r], expected), (block, budget, r)
        assert fast.acceptance_lengths[r] == ref.acceptance_lengths, (block, budget, r)
        assert all(1 <= a <= block for a in ref.acceptance_lengths)
        rounds += len(ref.acceptance_lengths)
        generated += sum(ref.acceptance_lengths)
    if budget > 1:  # (a one-node tree is the chain's single proposal)
        assert generated > rounds, "no tree node was ever accepted: the comparison would not test the tree paths"


class OracleTreeEngine(DFlashEngine):
    """Real draft step, then each request's known continuation boosted in its block logits (corrupted at
    random), so the trees hold deep correct paths at varying depths."""

    oracle: list[torch.Tensor] = []
    prompt_lens: list[int] = []

    def draft_step(self):
        super().draft_step()
        boost = torch.zeros_like(self.draft_logits)
        for r, cont in enumerate(self.oracle):
            base = int(self.positions[r]) + 1 - self.prompt_lens[r]
            for j in range(boost.shape[1]):
                if 0 <= base + j < len(cont) and torch.rand(()) > 0.2:
                    boost[r, j, cont[base + j]] = 30.0
        self.draft_logits.add_(boost)


@pytest.mark.parametrize("arch,block,budget", [("qwen3", 8, 12), ("llama", 16, 64)])
def test_deep_paths_in_a_ragged_batch_equal_target(monkeypatch, arch, block, budget):
    target = make_target(arch)
    draft = make_draft(target, layers=2, block_size=block)
    vocab = target.config.vocab_size
    prompts = [torch.randint(0, vocab, (n,)) for n in (1, 17, 6, 40)]
    limits = [1, 9, 40, 30]
    free = [target_greedy(target, p, m)[len(p):] for p, m in zip(prompts, limits)]
    stops = [[vocab - 1], [int(free[1][3])], [], []]
    expected = [target_greedy(target, p, m, s or None) for p, m, s in zip(prompts, limits, stops)]
    OracleTreeEngine.oracle = free
    OracleTreeEngine.prompt_lens = [len(p) for p in prompts]
    monkeypatch.setattr(engine_module, "DFlashEngine", OracleTreeEngine)
    result = generate(target, draft, prompts, limits, stop_token_ids=stops, backend="fast", tree_budget=budget)
    for r in range(4):
        assert torch.equal(result.sequences[r], expected[r]), r
        assert sum(result.acceptance_lengths[r]) == len(expected[r]) - len(prompts[r]) - 1
    assert max(max(a, default=1) for a in result.acceptance_lengths) > block // 2


def test_triton_interpreter_path():
    """The engine's tree step on the Triton kernels (build_tree, ancestor mask, tree attention, walk, compaction)
    equals the reference loop."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs the Triton kernels under the CPU interpreter")
    target, draft = make_pair(4)
    prompts, limits = [torch.randint(0, VOCAB, (n,)) for n in (3, 8)], [5, 4]
    for lookup in (None, 3):
        fast = generate(target, draft, prompts, limits, backend="fast", kernel_backend="triton", tree_budget=9,
                        lookup_depth=lookup)
        for r, (p, m) in enumerate(zip(prompts, limits)):
            ref = generate(target, draft, p, m, backend="reference", tree_budget=9, lookup_depth=lookup)
            assert torch.equal(fast.sequences[r], ref.sequences[0]), (lookup, r)
            assert fast.acceptance_lengths[r] == ref.acceptance_lengths, (lookup, r)


@pytest.mark.parametrize("backend", ["reference", "fast"])
def test_draft_vocabulary_subset_maps_tree_tokens(backend):
    """A subset that is the whole vocabulary in another order builds the same trees as the full draft (its
    logit j is target token draft_token_ids[j]): the same tokens and acceptance lengths."""
    target = make_target("qwen3")
    perm = torch.randperm(target.config.vocab_size).tolist()
    draft, full = subset_draft(target, perm, block_size=4)
    prompt = torch.randint(0, target.config.vocab_size, (1, 9))
    a = generate(target, full, prompt, 20, backend=backend, tree_budget=12)
    b = generate(target, draft, prompt, 20, backend=backend, tree_budget=12)
    assert torch.equal(a.sequences, b.sequences)
    assert a.acceptance_lengths == b.acceptance_lengths
    assert sum(a.acceptance_lengths) > len(a.acceptance_lengths), "no tree node accepted: nothing compared"


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_emulated_graphs_equal_eager(temperature):
    """The tree steps capture (static shapes, no host reads) and replay with the same tokens; one engine
    serves greedy and sampling calls in turn."""
    target, draft = make_pair(4)
    prompts, limits = requests(4)
    common = dict(backend="fast", tree_budget=10, temperature=temperature, seed=3)
    eager = generate(target, draft, prompts, limits, use_cuda_graphs=False, **common)
    for _ in range(2):  # the second call replays the steps captured by the first
        graphs = generate(target, draft, prompts, limits, use_cuda_graphs="emulate", **common)
        for r in range(len(prompts)):
            assert torch.equal(graphs.sequences[r], eager.sequences[r]), r
            assert graphs.acceptance_lengths[r] == eager.acceptance_lengths[r], r


def sample_continuations(target, draft, ids, steps, n, temperature, top_p, top_k, backend="reference",
                         lookup_depth=None):
    counts = Counter()
    for i in range(n):
        out = generate(target, draft, ids, steps, temperature=temperature, top_p=top_p, top_k=top_k, seed=i,
                       backend=backend, tree_budget=6, lookup_depth=lookup_depth)
        counts[tuple(out.sequences[0, ids.shape[1]:].tolist())] += 1
    return counts


@pytest.fixture
def sampling_pair():
    target = make_target("qwen3", vocab=4, layers=2, hidden=16)
    with torch.no_grad():
        target.lm_head.weight.mul_(8.0)  # far from uniform, yet every token stays likely
    draft = make_draft(target, layers=1, block_size=4, mask_token_id=3)
    return target, draft, torch.tensor([[1, 2, 0]])


@pytest.mark.parametrize("backend,temperature,top_p,top_k", [("reference", 1.0, 1.0, 0), ("fast", 0.8, 0.9, 3)])
def test_tree_sampling_is_lossless(sampling_pair, backend, temperature, top_p, top_k):
    target, draft, ids = sampling_pair
    steps, n = 3, 400  # the second and third tokens come from one verified tree
    expected = exact_target_distribution(target, ids, steps, temperature, top_p, top_k)
    counts = sample_continuations(target, draft, ids, steps, n, temperature, top_p, top_k, backend)
    rejects, stat, crit = chi2_rejects(counts, expected, n)
    assert not rejects, (stat, crit)


@pytest.mark.parametrize("backend", ["reference", "fast"])
def test_tree_sampling_with_a_lookup_path_is_lossless(sampling_pair, backend):
    """The grafted prompt-lookup path is a deterministic proposal like the draft's nodes: the tokens still follow
    the target's distribution (a prompt that repeats, so the path is there in most rounds)."""
    target, draft, _ = sampling_pair
    ids = torch.tensor([[1, 2, 0, 1, 2, 0, 1, 2]])
    steps, n = 3, 400
    expected = exact_target_distribution(target, ids, steps, 1.0, 1.0, 0)
    counts = sample_continuations(target, draft, ids, steps, n, 1.0, 1.0, 0, backend, lookup_depth=3)
    rejects, stat, crit = chi2_rejects(counts, expected, n)
    assert not rejects, (stat, crit)


def accept_best_child_without_drawing(logits, tree_tokens, tree_parents, *, block_size, temperature, top_k, top_p,
                                      seed, offset, backend):
    """Deliberately wrong: descend to the first (most likely) child while one exists, without drawing;
    draw only the bonus."""
    generator = torch.Generator().manual_seed(seed * 1000 + offset)
    parents = tree_parents[0].tolist()
    path = torch.full((1, block_size), -1, dtype=torch.long)
    node, depth = 0, 0
    path[0, 0] = 0
    while depth + 1 < block_size and node in parents:
        node, depth = parents.index(node), depth + 1
        path[0, depth] = node
    probs = sampling_probs(logits[0, node], temperature, top_p, top_k)
    return path, torch.tensor([depth]), torch.multinomial(probs, 1, generator=generator)


def test_wrong_tree_rule_fails(sampling_pair, monkeypatch):
    target, draft, ids = sampling_pair
    steps, n = 3, 300
    expected = exact_target_distribution(target, ids, steps, 1.0, 1.0, 0)
    monkeypatch.setattr(reference_module, "tree_accept_sample", accept_best_child_without_drawing)
    counts = sample_continuations(target, draft, ids, steps, n, 1.0, 1.0, 0)
    rejects, stat, crit = chi2_rejects(counts, expected, n)
    assert rejects, f"accepting a child without drawing passed the losslessness test ({stat} <= {crit})"


@pytest.mark.parametrize("kwargs,match", [
    ({"tree_budget": 0}, r"tree_budget must be None .* \[1, 64\]"),
    ({"tree_budget": 65}, r"tree_budget must be None .* \[1, 64\]"),
    ({"tree_budget": 2.5}, "tree_budget must be"),
    ({"tree_budget": True}, "tree_budget must be"),
    ({"tree_budget": 4, "block_size": 1}, "tree_budget needs block_size >= 2"),
    ({"tree_budget": 7, "block_size": 2}, "exceeds the 6 distinct token sequences"),
    ({"lookup_depth": 2}, "needs tree_budget"),
    ({"lookup_depth": 4, "tree_budget": 5}, r"lookup_depth=4 exceeds the tree's depth B - 1 = 3"),
    ({"lookup_depth": -1, "tree_budget": 5}, "lookup_depth must be None or an integer >= 0"),
    ({"lookup_depth": True, "tree_budget": 5}, "lookup_depth must be"),
    ({"lookup_depth": 1.0, "tree_budget": 5}, "lookup_depth must be"),
])
@pytest.mark.parametrize("backend", ["reference", "fast"])
def test_bad_tree_options(kwargs, match, backend):
    target, draft = make_pair(4)
    with pytest.raises(ValueError, match=match):
        generate(target, draft, torch.tensor([1, 2, 3]), 4, backend=backend, **kwargs)


def grafts_counted(monkeypatch, module):
    """Wrap ``module``'s tree_graft_lookup: the returned list counts the calls that changed a tree."""
    changed = []
    graft = module.tree_graft_lookup

    def counting(*args, **kwargs):
        out = graft(*args, **kwargs)
        changed.append(not all(torch.equal(a, b) for a, b in zip(args[:3], out)))
        return out

    monkeypatch.setattr(module, "tree_graft_lookup", counting)
    return changed


@pytest.mark.parametrize("block,budget,depth", [(2, 1, 1), (4, 3, 3), (5, 8, 2), (8, 12, 7), (16, 32, 5)])
def test_lookup_path_greedy_equals_target_and_reference(monkeypatch, block, budget, depth):
    """Trees with the prompt-lookup path grafted in: the target's greedy output, and the engine equals the
    reference round for round; the graft changed trees in both runtimes (repetitive prompts)."""
    target, draft = make_pair(block)
    fast_grafts = grafts_counted(monkeypatch, engine_module)
    ref_grafts = grafts_counted(monkeypatch, reference_module)
    prompts = [torch.arange(n) % k for n, k in ((9, 3), (14, 5), (20, 4))]
    limits = [block + 1, 2 * block + 3, 3 * block + 2]
    fast = generate(target, draft, prompts, limits, backend="fast", tree_budget=budget, lookup_depth=depth)
    for r, (p, m) in enumerate(zip(prompts, limits)):
        expected = target_greedy(target, p, m)
        ref = generate(target, draft, p, m, backend="reference", tree_budget=budget, lookup_depth=depth)
        assert torch.equal(ref.sequences[0], expected), (block, budget, r)
        assert torch.equal(fast.sequences[r], expected), (block, budget, r)
        assert fast.acceptance_lengths[r] == ref.acceptance_lengths, (block, budget, r)
    assert any(fast_grafts) and any(ref_grafts), "no tree was changed: the graft was not exercised"


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_lookup_path_under_emulated_graphs_equals_eager(temperature):
    target, draft = make_pair(4)
    prompts, limits = [torch.arange(n) % 3 for n in (7, 12)], [9, 11]
    common = dict(backend="fast", tree_budget=6, lookup_depth=3, temperature=temperature, seed=5)
    eager = generate(target, draft, prompts, limits, use_cuda_graphs=False, **common)
    for _ in range(2):
        graphs = generate(target, draft, prompts, limits, use_cuda_graphs="emulate", **common)
        for r in range(len(prompts)):
            assert torch.equal(graphs.sequences[r], eager.sequences[r]), r
            assert graphs.acceptance_lengths[r] == eager.acceptance_lengths[r], r


class NonFiniteDraft(DFlashDraftModel):
    """A real draft whose block logits hold NaN, +inf and -inf: everywhere (``everywhere``) or at random
    entries of random rows, also whole rows of one kind."""

    everywhere = False

    def compute_logits(self, hidden, output_head, linear=torch.nn.functional.linear):
        logits = super().compute_logits(hidden, output_head, linear)
        if self.everywhere:
            return torch.full_like(logits, float("nan"))
        g = torch.Generator().manual_seed(int(hidden.float().sum().abs() * 1000) % 2**31)
        bad = torch.tensor([float("nan"), float("inf"), -float("inf")], dtype=logits.dtype)
        kind = torch.randint(0, 3, logits.shape, generator=g)
        spots = torch.rand(logits.shape, generator=g) < 0.3
        whole = torch.rand(logits.shape[:-1], generator=g) < 0.3  # whole rows of one non-finite value
        spots |= whole[..., None]
        kind = torch.where(whole[..., None], kind[..., :1], kind)
        return torch.where(spots, bad[kind], logits)


@pytest.mark.parametrize("everywhere", [True, False], ids=["all-nan", "mixed"])
@pytest.mark.parametrize("options", [{"backend": "fast", "kernel_backend": "cpu"},
                                     {"backend": "fast", "kernel_backend": "torch"}, {"backend": "reference"}],
                         ids=["fast-cpu", "fast-torch", "reference"])
def test_non_finite_draft_logits_give_the_chain_output(everywhere, options, monkeypatch):
    """The draft only proposes: NaN / inf logits still give the target's greedy output, in trees as in the chain."""
    target = make_target("qwen3")
    draft = make_draft(target, layers=1, block_size=5)
    draft.__class__ = NonFiniteDraft
    monkeypatch.setattr(NonFiniteDraft, "everywhere", everywhere)
    prompt = torch.randint(0, 48, (6,))
    want = target_greedy(target, prompt, 12)
    assert torch.equal(generate(target, draft, prompt, 12, **options).sequences[0], want)
    for budget in (1, 7, 20):
        assert torch.equal(generate(target, draft, prompt, 12, tree_budget=budget, **options).sequences[0], want)
