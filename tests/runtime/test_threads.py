"""``dflash.generate`` from several threads on one target/draft pair: every output equals the
single-threaded one (the pair's cached engine serialises the calls), and the cache does not keep
dropped models alive."""
from __future__ import annotations

import copy
import functools
import gc
import threading
import weakref

import pytest
import torch

import dflash.engine as engine_module
from dflash import generate
from helpers.tiny_models import make_draft, make_target

THREADS, CALLS = 3, 4


def in_threads(calls: list[list]) -> list[list]:
    """Run ``calls[t]`` (zero-argument functions) one after another in thread t, all threads at once; their
    results, or the first exception of any thread."""
    got = [[None] * len(c) for c in calls]
    errors: list[BaseException] = []
    start = threading.Barrier(len(calls))

    def work(t):
        try:
            start.wait()
            for c, call in enumerate(calls[t]):
                got[t][c] = call()
        except BaseException as exc:  # re-raised below, with the thread's traceback
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(len(calls))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    return got


def assert_single_threaded_outputs(calls: list[list]) -> None:
    """Each call's sequences, run in threads, equal the same call's run alone."""
    expected = [[call().sequences for call in c] for c in calls]
    got = in_threads(calls)
    for t, c in enumerate(calls):
        for i in range(len(c)):
            assert torch.equal(got[t][i].sequences, expected[t][i]), (t, i)


@pytest.mark.parametrize("options", [
    {"backend": "fast", "kernel_backend": "cpu"},
    {"backend": "fast", "kernel_backend": "torch"},
    {"backend": "reference"},
    {"backend": "fast", "kernel_backend": "cpu", "tree_budget": 5},
], ids=["fast-cpu", "fast-torch", "reference", "fast-cpu-tree"])
def test_threads_sharing_a_pair_get_the_single_threaded_outputs(options, seed):
    target = make_target("qwen3")
    draft = make_draft(target, layers=2, block_size=4)
    g = torch.Generator().manual_seed(seed)
    # every call its own prompt and length, so a call that reads another's state gets other tokens
    jobs = [[(torch.randint(0, 48, (int(torch.randint(3, 11, (), generator=g)),), generator=g), 6 + (t + c) % 7)
             for c in range(CALLS)] for t in range(THREADS)]
    assert_single_threaded_outputs([[functools.partial(generate, target, draft, p, m, **options) for p, m in calls]
                                    for calls in jobs])


def test_threads_on_two_pairs_get_the_single_threaded_outputs():
    """Calls on different targets run in parallel, each building its engine (the cache keeps one): still exact."""
    pairs = []
    for arch in ("qwen3", "llama"):
        target = make_target(arch)
        pairs.append((target, make_draft(target, layers=1, block_size=3)))
    prompts = [torch.randint(0, 48, (4 + c,)) for c in range(CALLS)]
    assert_single_threaded_outputs([[functools.partial(generate, *pair, p, 8, backend="fast") for p in prompts]
                                    for pair in pairs])


def test_dropped_models_are_freed():
    target = make_target("qwen3")
    draft = make_draft(target, layers=1, block_size=4)
    generate(target, draft, torch.randint(0, 48, (5,)), 6, backend="fast")
    assert engine_module.current_engine().draft is draft  # the cache holds this pair's engine
    copy.deepcopy(target)  # the model's lock and engine stay behind: a copy gets an empty slot
    dead_target, dead_draft = weakref.ref(target), weakref.ref(draft)
    del target, draft
    gc.collect()
    assert dead_target() is None and dead_draft() is None
    assert engine_module.current_engine() is None


def test_call_from_on_tokens_on_the_same_target_raises():
    """A call from inside another on the same target and thread would wait for its own lock forever."""
    target = make_target("qwen3")
    draft = make_draft(target, layers=1, block_size=4)
    prompt = torch.randint(0, 48, (5,))

    def nested(_request, _ids):
        generate(target, draft, prompt, 2, backend="reference")

    for backend in ("fast", "reference"):
        with pytest.raises(RuntimeError, match="on_tokens"):
            generate(target, draft, prompt, 4, backend=backend, on_tokens=nested)
        # the lock was released: the pair still runs
        assert generate(target, draft, prompt, 4, backend=backend).sequences.shape == (1, 9)
