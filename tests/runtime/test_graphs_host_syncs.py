"""Host syncs: :class:`dflash.graphs.HostSyncCounter` counts every device-to-host read a capture refuses, and a
decoding round of the fast engine makes exactly ``HOST_READS_PER_ROUND`` of them in every mode, with the same
tokens as before (greedy == the target's greedy decoding; sampling and streaming as without the counter)."""
from __future__ import annotations

import pytest
import torch

from dflash import generate
from dflash.engine import HOST_READS_PER_ROUND, DFlashEngine
from dflash.graphs import HostSyncCounter
from helpers.tiny_models import make_draft, make_target


# ------------------------------------------------------------------------------------ the counter
@pytest.mark.parametrize("read", [
    lambda t: t.sum().item(), lambda t: bool(t[0] > 0), lambda t: int(t[1]), lambda t: float(t[2]),
    lambda t: t.tolist(), lambda t: t.cpu(), lambda t: t.numpy(), lambda t: t.to("cpu", copy=True),
    lambda t: t.to(device=torch.device("cpu")), lambda t: torch.equal(t, t), lambda t: t.nonzero(),
    lambda t: t[t > 0], lambda t: torch.unique(t),
], ids=["item", "bool", "int", "float", "tolist", "cpu", "numpy", "to_cpu", "to_device_kw", "equal", "nonzero",
        "mask_index", "unique"])
def test_counter_counts_each_host_read_once(read):
    t = torch.randn(7)
    with HostSyncCounter() as counter:
        read(t)
    assert counter.count == 1, counter.reads


def test_counter_ignores_device_work():
    t = torch.randn(5, 3)
    expected = t.abs().sum(1)
    out = torch.full((5,), float("nan"))
    with HostSyncCounter() as counter:
        torch.sum(torch.where(t > 0, t, -t), 1, out=out)
        t.to(torch.float64).mul_(2)
        t[torch.tensor([0, 3])] += 1  # integer indices: a static count
    assert counter.count == 0, counter.reads
    assert torch.equal(out, expected)


# ------------------------------------------------------------------------------------ the engine's rounds
@pytest.fixture(scope="module")
def pair():
    torch.manual_seed(3)
    target = make_target("qwen3")
    return target, make_draft(target, block_size=4)


def counted_generate(monkeypatch, pair, prompts, limits, **kw):
    """``generate`` (after a warm-up call that captures the steps) under a :class:`HostSyncCounter`
    -> (results, host reads of each round: from the round's start to the next one's, the last to the end)."""
    target, draft = pair
    run = lambda: generate(target, draft, prompts, limits, backend="fast", block_size=4, **kw)  # noqa: E731
    run()
    counter, starts = HostSyncCounter(), []
    plain_round = DFlashEngine.round

    def counted_round(engine):
        starts.append(counter.count)
        return plain_round(engine)

    monkeypatch.setattr(DFlashEngine, "round", counted_round)
    with counter:
        results = run()
    ends = starts[1:] + [counter.count]
    return results, [end - start for start, end in zip(starts, ends)]


def target_greedy(target, prompt, max_new, stops):
    ids = prompt[None]
    return target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                           eos_token_id=stops or None)[0]


PROMPTS = [torch.randint(1, 48, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 11, 7)]


def stops_met(target, limits):
    """Stop tokens that end requests 0 and 2 early (tokens their greedy continuations produce), none for 1."""
    free = [target_greedy(target, p, m, None)[len(p):].tolist() for p, m in zip(PROMPTS, limits)]
    return [[free[0][4]], [], [47, free[2][6]]]


@pytest.mark.parametrize("graphs", [False, "emulate"])
@pytest.mark.parametrize("batch,tree_budget,with_stops", [(1, None, False), (3, None, True), (1, 5, False),
                                                          (3, 5, True)])
def test_greedy_rounds_read_the_host_once(monkeypatch, pair, graphs, batch, tree_budget, with_stops):
    limits = [13, 9, 17]
    stops = stops_met(pair[0], limits) if with_stops else [[]] * 3
    prompts, limits, stops = PROMPTS[:batch], limits[:batch], stops[:batch]
    results, per_round = counted_generate(monkeypatch, pair, prompts, limits, stop_token_ids=stops,
                                          use_cuda_graphs=graphs, tree_budget=tree_budget)
    assert len(per_round) > 2 and per_round == [HOST_READS_PER_ROUND] * len(per_round) == [1] * len(per_round)
    for r, prompt in enumerate(prompts):
        expected = target_greedy(pair[0], prompt, limits[r], stops[r])
        assert results.sequences[r].tolist() == expected.tolist()
        if stops[r]:
            assert len(expected) < len(prompt) + limits[r], "the stop token must end the request early"


@pytest.mark.parametrize("graphs", [False, "emulate"])
def test_sampling_and_streaming_rounds_read_the_host_once(monkeypatch, pair, graphs):
    target, draft = pair
    limits = [12, 8, 15]
    kw = dict(backend="fast", block_size=4, temperature=0.8, top_p=0.9, seed=11, stop_token_ids=[[7], [], [3]])
    plain = generate(target, draft, PROMPTS, limits, use_cuda_graphs=False, **kw)  # eager, uncounted
    streamed: dict[int, list[int]] = {}
    results, per_round = counted_generate(monkeypatch, pair, PROMPTS, limits, use_cuda_graphs=graphs,
                                          on_tokens=lambda r, ids: streamed.setdefault(r, []).extend(ids),
                                          **{k: v for k, v in kw.items() if k not in ("backend", "block_size")})
    assert len(per_round) > 2 and per_round == [1] * len(per_round)
    assert results.acceptance_lengths == plain.acceptance_lengths
    for r, prompt in enumerate(PROMPTS):
        assert results.sequences[r].tolist() == plain.sequences[r].tolist()
        # streamed twice: the warm-up call and the counted one, each the whole continuation
        new = results.sequences[r][len(prompt):].tolist()
        assert streamed[r] == new + new


@pytest.mark.parametrize("graphs", [False, "emulate"])
def test_dflash2_sampling_rounds_read_the_host_once(monkeypatch, graphs):
    """A DFlash2 draft's sampled rounds (the selector's draws, verification over its candidates): one read a round,
    and the tokens of an uncounted eager run."""
    from test_dflash2_model import make_dflash2

    target = make_target("qwen3")
    draft = make_dflash2(target, block_size=4)
    limits = [12, 8, 15]
    kw = dict(temperature=0.8, top_k=20, seed=11)
    plain = generate(target, draft, PROMPTS, limits, backend="fast", block_size=4, use_cuda_graphs=False, **kw)
    results, per_round = counted_generate(monkeypatch, (target, draft), PROMPTS, limits, use_cuda_graphs=graphs, **kw)
    assert len(per_round) > 2 and per_round == [1] * len(per_round)
    assert [s.tolist() for s in results.sequences] == [s.tolist() for s in plain.sequences]
