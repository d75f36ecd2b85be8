"""CUDA-graph semantics proven on CPU with the emulator of :mod:`dflash.graphs`.

1. The emulator freezes what a real graph freezes (Python values, replaced tensors) and refuses what a
   real capture refuses (host reads), while in-place state updates replay correctly.
2. One engine reused across calls with different settings (greedy/sampling, filters, stop tables,
   prompts) gives, with emulated graphs and eagerly, exactly what a fresh engine gives.
3. Planted stale-state bugs (a replaced stop table, a Python temperature baked into the verify step)
   are invisible eagerly and caught by the emulator.
"""
from __future__ import annotations

import pytest
import torch

import dflash.engine as engine_module
from dflash import generate
from dflash.engine import DFlashEngine
from dflash.graphs import GraphCaptureError, capture, record
from dflash_kernels import verify_sample
from tiny_models import make_draft, make_target


# ------------------------------------------------------------------------------------ the emulator
def test_replay_repeats_in_place_updates_and_intermediates():
    state = torch.arange(4.0)
    scale = torch.tensor([2.0])
    out = torch.zeros(4)

    def step():
        tmp = state * scale          # a fresh intermediate tensor
        out.copy_(tmp + 1)
        state.add_(1)

    graph = capture(step, "emulate", [state, out])
    assert torch.equal(state, torch.arange(4.0)) and torch.equal(out, torch.zeros(4)), "capture must restore state"
    for i in range(3):
        graph.replay()
        assert torch.equal(out, (torch.arange(4.0) + i) * 2 + 1)
    scale.fill_(10.0)  # written in place: the replayed step sees it
    graph.replay()
    assert torch.equal(out, (torch.arange(4.0) + 3) * 10 + 1)


def test_an_aliasing_schema_op_that_copies_is_replayed():
    """``aten.to`` may alias (same dtype) or copy (new dtype): the copy must be replayed."""
    ints = torch.arange(3)
    out = torch.zeros(3, dtype=torch.float64)
    graph = record(lambda: out.copy_(ints.to(torch.float64) * 2))
    ints.add_(10)
    graph.replay()
    assert out.tolist() == [20.0, 22.0, 24.0]


def test_python_values_and_replaced_tensors_are_frozen():
    box = {"scale": 2.0, "bias": torch.tensor([1.0])}
    out = torch.zeros(1)
    graph = record(lambda: out.copy_(torch.ones(1) * box["scale"] + box["bias"]))
    box["scale"] = 5.0                   # a Python value read at capture
    box["bias"] = torch.tensor([100.0])  # a replaced (not overwritten) tensor
    out.zero_()
    graph.replay()
    assert float(out) == 3.0, "replay must use the capture-time value and the captured tensor"


def test_host_read_inside_a_step_is_refused():
    flag = torch.tensor([1])
    with pytest.raises(GraphCaptureError, match="host"):
        record(lambda: flag.add_(1) if bool(flag) else None)
    with pytest.raises(GraphCaptureError, match="host"):
        record(lambda: flag.item())


def test_dflash_ops_replay_as_single_units():
    """verify_sample reads its seed/offset/temperature tensors inside the op on every replay."""
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 11)
    drafts = torch.randint(0, 11, (2, 2))
    temperature = torch.full((2,), 0.7)
    seed, offset = torch.tensor([7]), torch.tensor([0])
    out = torch.zeros(2, 2, dtype=torch.long)

    def step():
        accepted, token = verify_sample(logits, drafts, temperature=temperature, seed=seed, offset=offset,
                                        backend="torch")
        out.copy_(torch.stack([accepted, token], dim=1))

    graph = record(step)
    names = [str(call[0]) for call in graph.calls]
    assert any(name.startswith("dflash.verify_sample") for name in names), names
    for off in range(4):
        offset.fill_(off)
        temperature.fill_(0.3 + 0.2 * off)
        graph.replay()
        a, t = verify_sample(logits, drafts, temperature=temperature, seed=seed, offset=offset, backend="torch")
        assert torch.equal(out, torch.stack([a, t], dim=1)), off


# ------------------------------------------------------------------------------- engine reuse
CALLS = [  # (prompt lengths, max_new_tokens, stop tokens per request, sampling settings)
    ((5, 9), 14, [[3], [40, 41]], dict()),
    ((5, 9), 14, [[7, 8, 9], []], dict(temperature=0.7, top_k=5)),
    ((5, 9), 14, None, dict()),
    ((5, 9), 14, [[2], [2]], dict(temperature=1.0, top_p=0.9)),
    ((12, 2), 10, [[11], []], dict()),
]


def _pair():
    target = make_target("qwen3")
    draft = make_draft(target, layers=2, block_size=4)
    return target, draft


def _run(target, draft, prompts, max_new, stops, settings, graphs):
    return generate(target, draft, prompts, max_new, stop_token_ids=stops, backend="fast", max_length=64,
                    seed=11, use_cuda_graphs=graphs, **settings)


@pytest.mark.parametrize("graphs", ["emulate", False])
def test_engine_reused_across_settings_equals_fresh_engine(graphs):
    torch.manual_seed(0)
    target, draft = _pair()
    engine_module._ENGINE.clear()
    prompt_sets = [[torch.randint(0, 48, (n,)) for n in lengths] for lengths, *_ in CALLS]
    reused, engine = [], None
    for prompts, (_, max_new, stops, settings) in zip(prompt_sets, CALLS):
        reused.append(_run(target, draft, prompts, max_new, stops, settings, graphs))
        engine = engine or engine_module._ENGINE["engine"]
        assert engine_module._ENGINE["engine"] is engine, "the calls must share one engine"
    if graphs:
        # one draft graph; one verify graph per (greedy, filtered, stop-table width) the calls used
        assert sorted(engine.graphs) == [("draft",), ("verify", False, True, 1), ("verify", False, True, 3),
                                         ("verify", True, False, 0), ("verify", True, False, 1),
                                         ("verify", True, False, 2)]
    for i, (prompts, (_, max_new, stops, settings)) in enumerate(zip(prompt_sets, CALLS)):
        engine_module._ENGINE.clear()
        fresh = _run(target, draft, prompts, max_new, stops, settings, graphs)
        assert [s.tolist() for s in reused[i].sequences] == [s.tolist() for s in fresh.sequences], i
        assert reused[i].acceptance_lengths == fresh.acceptance_lengths, i
        if not settings:  # greedy: also the reference loop, request by request
            for r, p in enumerate(prompts):
                ref = generate(target, draft, p, max_new, stop_token_ids=stops[r] if stops else None,
                               backend="reference")
                assert torch.equal(reused[i].sequences[r], ref.sequences[0]), (i, r)


def _reuse_differs_from_fresh(target, draft, graphs, prompts, first, second):
    """Run call ``first`` then ``second`` on one engine; return whether ``second`` differs from a fresh engine."""
    engine_module._ENGINE.clear()
    _run(target, draft, prompts, 14, *first, graphs)
    reused = _run(target, draft, prompts, 14, *second, graphs)
    engine_module._ENGINE.clear()
    fresh = _run(target, draft, prompts, 14, *second, graphs)
    return [s.tolist() for s in reused.sequences] != [s.tolist() for s in fresh.sequences]


def test_planted_replaced_stop_table_is_caught_only_by_the_emulator(monkeypatch):
    torch.manual_seed(1)
    target, draft = _pair()
    prompts = [torch.randint(0, 48, (n,)) for n in (5, 9)]
    free = generate(target, draft, prompts, 14, backend="fast", max_length=64)
    stop_b = [[int(free.sequences[0][7])], [int(free.sequences[1][11])]]  # tokens the free run emits
    first, second = ([[47], [47]], {}), (stop_b, {})
    real_reset = DFlashEngine.reset

    def reset_replacing_the_table(self, *args, **kwargs):
        self.stop_tables.clear()  # the old bug: each call's stop table is a new tensor
        real_reset(self, *args, **kwargs)

    monkeypatch.setattr(DFlashEngine, "reset", reset_replacing_the_table)
    assert not _reuse_differs_from_fresh(target, draft, False, prompts, first, second), "eagerly the bug is invisible"
    assert _reuse_differs_from_fresh(target, draft, "emulate", prompts, first, second), "the emulator must expose it"
    monkeypatch.setattr(DFlashEngine, "reset", real_reset)
    assert not _reuse_differs_from_fresh(target, draft, "emulate", prompts, first, second), "fixed code is clean"


def test_planted_python_temperature_is_caught_only_by_the_emulator(monkeypatch):
    torch.manual_seed(2)
    target, draft = _pair()
    first, second = (None, dict(temperature=0.3)), (None, dict(temperature=3.0))

    def verify_step_with_python_temperature(self):
        block = torch.cat([self.anchor[:, None], self.proposals], dim=1)
        logits, feats = self.target.forward(block, self.positions, self.kv_bound)
        accepted, bonus = verify_sample(logits, self.proposals, temperature=self.sampling.temperature,
                                        seed=self.seed, offset=self.offset, backend=self.backend)
        self.offset.add_(1)
        self.features.copy_(feats)
        self.num_new.copy_(engine_module.commit_round(
            self.proposals, accepted, bonus, out_tokens=self.out_tokens, lengths=self.lengths,
            positions=self.positions, anchor=self.anchor, done=self.done, max_lengths=self.max_lengths,
            backend=self.commit_backend, check=False))

    monkeypatch.setattr(DFlashEngine, "verify_step", verify_step_with_python_temperature)
    prompts = [torch.randint(0, 48, (n,)) for n in (5, 9)]
    assert not _reuse_differs_from_fresh(target, draft, False, prompts, first, second), "eagerly the bug is invisible"
    assert _reuse_differs_from_fresh(target, draft, "emulate", prompts, first, second), "the emulator must expose it"
