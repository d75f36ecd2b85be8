"""CPU microbenchmarks (pytest-benchmark) of the reference vs fast paths at small shapes.

Not part of the test suite (`pytest -q tests` does not collect bench/). Run:
    .venv/bin/python -m pytest bench/microbench -q --benchmark-columns=median,iqr,rounds --benchmark-sort=name
Compare groups: each group holds the reference path and the fast path of one step on the same inputs.
"""
from __future__ import annotations

import pytest
import torch

import dflash_kernels as dk
from dflash_kernels._dispatch import backend_status

EXT = backend_status("ext", torch.device("cpu"))[0]
ext_only = pytest.mark.skipif(not EXT, reason="dflash_kernels._C (ext) is not built")


@pytest.fixture(scope="module")
def pair():
    import draft_latency

    torch.manual_seed(0)
    target, draft = draft_latency.build_pair(draft_latency.MODELS["tiny"] | dict(hidden=128, inter=384, vocab=2048),
                                             torch.device("cpu"), torch.float32, 8)
    return target, draft


@pytest.mark.parametrize("context", [256, 1024])
@pytest.mark.parametrize("path", ["reference", "fast"])
def test_draft_step(benchmark, pair, path, context):
    import draft_latency

    target, draft = pair
    benchmark.group = f"draft step B=8 ctx={context}"
    with torch.inference_mode():
        if path == "reference":
            ref = draft_latency.Reference(target, draft, 1, context, torch.device("cpu"), torch.float32)
            ref.prepare(8)
            fn = ref.step
        else:
            eng = draft_latency.make_engine(target, draft, 1, context + 8, 8, graphs=False)
            draft_latency.set_state(eng, context, 8, target.config.vocab_size)
            eng.kv_bound = context + 8
            fn = eng.draft_step
        benchmark(torch.inference_mode()(fn))


@pytest.mark.parametrize("backend", ["torch", pytest.param("ext", marks=ext_only)])
def test_verify_greedy(benchmark, backend):
    benchmark.group = "verify_greedy N=4 B=16 V=32000 fp32"
    logits = torch.randn(4, 16, 32000)
    drafts = logits.argmax(-1)[:, :-1].clone()
    drafts[:, 7:] += 1
    benchmark(dk.verify_greedy, logits, drafts, backend=backend)


@pytest.mark.parametrize("backend", ["torch", pytest.param("ext", marks=ext_only)])
def test_commit_round(benchmark, backend):
    benchmark.group = "commit_round R=16 B=16"
    r, b, cap = 16, 16, 2048
    drafts = torch.randint(0, 1000, (r, b - 1))
    acc, bonus = torch.randint(0, b, (r,)), torch.randint(0, 1000, (r,))
    base = dict(out_tokens=torch.randint(0, 1000, (r, cap)), lengths=torch.randint(1, 1000, (r,)),
                anchor=torch.randint(0, 1000, (r,)), done=torch.zeros(r, dtype=torch.bool),
                max_lengths=torch.full((r,), cap))
    base["positions"] = base["lengths"] - 1

    def setup():
        st = {k: v.clone() for k, v in base.items()}
        return (drafts, acc, bonus), dict(stop_tokens=torch.tensor([5]), backend=backend, check=False, **st)

    benchmark.pedantic(dk.commit_round, setup=setup, rounds=200, warmup_rounds=5)


@pytest.mark.parametrize("path", ["reference", "fast"])
def test_generate(benchmark, pair, path):
    from dflash import generate

    target, draft = pair
    benchmark.group = "generate 32 tokens B=8 (random draft, tau ~ 1)"
    ids = torch.randint(0, 2000, (64,))
    benchmark.pedantic(generate, args=(target, draft, ids, 32), kwargs=dict(block_size=8, backend=path),
                       rounds=5, warmup_rounds=1)


@pytest.mark.parametrize("budget", [16, 64])
@pytest.mark.parametrize("op", ["build_tree", "tree_ancestor_mask", "tree_accept_greedy", "tree_accept_sample",
                                "tree_compact"])
def test_tree_ops_torch(benchmark, op, budget):
    """A draft tree's ops on the CPU path (backend torch) at SmolLM2-like shapes: a 2,361-id draft vocabulary,
    B = 16, target vocabulary 49,152, 30 layers x 3 KV heads x D 64; the walk accepts one node."""
    benchmark.group = f"tree ops (torch) budget {budget}"
    torch.manual_seed(0)
    b, vocab, ids = 16, 49152, torch.randperm(49152)[:2361]
    draft_logits, anchor = torch.randn(1, b - 1, 2361) * 3, torch.zeros(1, dtype=torch.long)
    tokens, parents, _ = dk.build_tree(draft_logits, anchor, budget, vocab_ids=ids, backend="torch")
    logits = torch.randn(1, budget + 1, vocab)
    logits[0, 0, tokens[0, 1]] = 30.0
    path, accepted, _ = dk.tree_accept_greedy(logits, tokens, parents, block_size=b, backend="torch")
    k_cache, v_cache = torch.randn(30, 1, 512, 3, 64), torch.randn(30, 1, 512, 3, 64)
    calls = {
        "build_tree": lambda: dk.build_tree(draft_logits, anchor, budget, vocab_ids=ids, backend="torch"),
        "tree_ancestor_mask": lambda: dk.tree_ancestor_mask(parents, backend="torch"),
        "tree_accept_greedy": lambda: dk.tree_accept_greedy(logits, tokens, parents, block_size=b, backend="torch"),
        "tree_accept_sample": lambda: dk.tree_accept_sample(logits, tokens, parents, block_size=b, temperature=0.7,
                                                            seed=1, offset=2, backend="torch"),
        "tree_compact": lambda: dk.tree_compact(k_cache, v_cache, path, accepted, torch.tensor([100]), backend="torch"),
    }
    benchmark(calls[op])
