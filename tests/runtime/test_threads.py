"""``dflash.generate`` from several threads on one target/draft pair: every output equals the
single-threaded one (the pair's cached engine serialises the calls), and the cache does not keep
dropped models alive."""
from __future__ import annotations

import copy
import gc
import threading
import weakref

import pytest
import torch

import dflash.engine as engine_module
from dflash import generate
from tiny_models import make_draft, make_target

THREADS, CALLS = 3, 4


@pytest.mark.parametrize("options", [
    {"backend": "fast", "kernel_backend": "cpu"},
    {"backend": "fast", "kernel_backend": "torch"},
    {"backend": "reference"},
    {"backend": "fast", "kernel_backend": "cpu", "tree_budget": 5},
], ids=["fast-cpu", "fast-torch", "reference", "fast-cpu-tree"])
def test_threads_sharing_a_pair_get_the_single_threaded_outputs(options):
    target = make_target("qwen3")
    draft = make_draft(target, layers=2, block_size=4)
    g = torch.Generator().manual_seed(0)
    # every call its own prompt and length, so a call that reads another's state gets other tokens
    jobs = [[(torch.randint(0, 48, (int(torch.randint(3, 11, (), generator=g)),), generator=g), 6 + (t + c) % 7)
             for c in range(CALLS)] for t in range(THREADS)]
    expected = [[generate(target, draft, p, m, **options).sequences for p, m in calls] for calls in jobs]
    got: list[list] = [[None] * CALLS for _ in range(THREADS)]
    errors: list[BaseException] = []
    start = threading.Barrier(THREADS)

    def work(t):
        try:
            start.wait()
            for c, (p, m) in enumerate(jobs[t]):
                got[t][c] = generate(target, draft, p, m, **options).sequences
        except BaseException as exc:  # reported below, with the thread's traceback
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    for t in range(THREADS):
        for c in range(CALLS):
            assert torch.equal(got[t][c], expected[t][c]), (t, c)


def test_dropped_models_are_freed():
    target = make_target("qwen3")
    draft = make_draft(target, layers=1, block_size=4)
    generate(target, draft, torch.randint(0, 48, (5,)), 6, backend="fast")
    assert engine_module._ENGINE["engine"].draft is draft  # the cache holds this pair's engine
    copy.deepcopy(target)  # the model's lock and engine stay behind: a copy gets an empty slot
    dead_target, dead_draft = weakref.ref(target), weakref.ref(draft)
    del target, draft
    gc.collect()
    assert dead_target() is None and dead_draft() is None
    assert "engine" not in engine_module._ENGINE


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
