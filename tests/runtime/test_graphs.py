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
from dflash_kernels import add_rms_norm, verify_sample
from helpers.tiny_models import make_draft, make_target


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


def test_python_values_and_tensors_read_at_capture_are_frozen():
    box = {"scale": 2.0, "bias": torch.tensor([1.0])}
    out = torch.zeros(1)
    graph = record(lambda: out.copy_(torch.ones(1) * box["scale"] + box["bias"]))
    kept = box["bias"]
    box["scale"] = 5.0                   # a Python value read at capture
    box["bias"] = torch.tensor([100.0])  # another tensor in its place (the captured one stays alive)
    out.zero_()
    graph.replay()
    assert float(out) == 3.0, "replay must use the capture-time value and the captured tensor"
    kept.fill_(7.0)  # the captured tensor, written in place
    graph.replay()
    assert float(out) == 9.0


@pytest.mark.parametrize("read", [
    lambda t: t.item(), lambda t: bool(t), lambda t: int(t), lambda t: float(t), lambda t: t.tolist(),
    lambda t: t.cpu(), lambda t: t.numpy(), lambda t: torch.equal(t, t), lambda t: t.sum().tolist(),
], ids=["item", "bool", "int", "float", "tolist", "cpu", "numpy", "equal", "tolist-of-result"])
def test_host_read_inside_a_step_is_refused(read):
    """A device-to-host copy syncs the stream: a CUDA capture refuses it (a CPU tensor's .cpu(), .tolist()
    and .numpy() run no op, so they are refused by name)."""
    flag = torch.tensor([1])
    with pytest.raises(GraphCaptureError, match="host"):
        record(lambda: read(flag.add_(1)))


_MASK = torch.tensor([True, False, True, True])
_VALUES = torch.tensor([3.0, 1.0, 3.0, 2.0])


@pytest.mark.parametrize("step", [
    lambda: _VALUES.nonzero(), lambda: torch.where(_MASK), lambda: torch.argwhere(_MASK),
    lambda: torch.unique(_VALUES), lambda: torch.unique_consecutive(_VALUES), lambda: _VALUES.masked_select(_MASK),
    lambda: _VALUES[_MASK], lambda: _VALUES.clone().__setitem__(_MASK, 0.0),
    lambda: _VALUES.clone().index_put_((_MASK,), torch.zeros(())), lambda: torch.bincount(_MASK.long()),
    lambda: torch.repeat_interleave(_MASK.long()),
], ids=["nonzero", "where-1-arg", "argwhere", "unique", "unique_consecutive", "masked_select", "mask-index",
        "mask-assign", "mask-index_put", "bincount", "repeat_interleave"])
def test_data_dependent_shape_inside_a_step_is_refused(step):
    """The output size is read on the host, even when replay would give the same size again."""
    with pytest.raises(GraphCaptureError, match="data-dependent"):
        record(step)


def test_static_shape_forms_of_those_ops_replay():
    """Integer indices, a three-argument where, masked_fill and repeat_interleave with its output_size
    have static shapes: they record and replay."""
    mask, values = _MASK.clone(), _VALUES.clone()
    idx = torch.tensor([3, 0])
    out = torch.zeros(2 + 4 + 4 + 4)

    def step():
        counts = mask.long() + 1
        out.copy_(torch.cat([values[idx], torch.where(mask, values, -values), values.masked_fill(mask, 9.0),
                             torch.repeat_interleave(values, counts, output_size=7)[:4]]))

    graph = record(step)
    mask.copy_(torch.tensor([True, True, False, True]))  # still 7 repeats in all
    values.mul_(2)
    idx.fill_(1)
    graph.replay()
    expected = torch.cat([values[idx], torch.where(mask, values, -values), values.masked_fill(mask, 9.0),
                          torch.repeat_interleave(values, mask.long() + 1)[:4]])
    assert torch.equal(out, expected)


def test_tensor_replaced_after_capture_is_refused_at_replay():
    """A real graph holds the address of a tensor allocated before capture, not the tensor: once its owner
    frees it, replay would read memory the allocator may have handed to another tensor."""
    box = {"bias": torch.tensor([1.0])}
    out = torch.zeros(1)
    graph = record(lambda: out.copy_(out + box["bias"]))
    graph.replay()
    assert float(out) == 2.0  # recording ran the step once
    box["bias"] = torch.tensor([100.0])  # the captured tensor's last outside reference goes
    with pytest.raises(GraphCaptureError, match="freed"):
        graph.replay()


def test_tensor_replaced_inside_the_step_is_refused_at_capture():
    """``state = state + 1`` frees the pre-capture tensor the recorded op reads."""
    box = {"state": torch.zeros(3)}

    def step():
        box["state"] = box["state"] + 1

    with pytest.raises(GraphCaptureError, match="freed"):
        record(step)


def test_memory_the_graph_owns_or_its_owner_keeps_is_accepted():
    """Tensors the step allocates (the graph's pool, a ``torch.tensor`` constant included) and views whose
    view object is gone are not freed memory while a tensor on their storage is kept; a storage the graph
    alone holds is."""
    base = torch.arange(6.0)
    with torch.inference_mode():  # no autograd view metadata keeping the bases alive
        view_only = {"v": torch.arange(4.0)[1:]}  # its base tensor is referenced by nothing but this view
    out = torch.zeros(3)
    graph = record(lambda: out.copy_(base[2:5] * torch.tensor([1.0, 2.0, 3.0]) + view_only["v"]))
    base.add_(1)
    graph.replay()
    assert out.tolist() == [3.0 + 1.0, 4.0 * 2 + 2.0, 5.0 * 3 + 3.0]
    del view_only["v"]  # now the graph holds the last reference
    with pytest.raises(GraphCaptureError, match="freed"):
        graph.replay()


def test_dflash_ops_replay_as_single_units():
    """verify_sample reads its seed/offset/temperature tensors inside the op on every replay."""
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
    target, draft = _pair()
    engine_module.clear_engine_cache()
    prompt_sets = [[torch.randint(0, 48, (n,)) for n in lengths] for lengths, *_ in CALLS]
    reused, engine = [], None
    for prompts, (_, max_new, stops, settings) in zip(prompt_sets, CALLS):
        reused.append(_run(target, draft, prompts, max_new, stops, settings, graphs))
        engine = engine or engine_module.current_engine()
        assert engine_module.current_engine() is engine, "the calls must share one engine"
    if graphs:
        # one draft graph; one verify graph per (greedy, filtered, stop-table width) the calls used
        assert sorted(engine.graphs) == [("draft",), ("verify", False, True, 1), ("verify", False, True, 3),
                                         ("verify", True, False, 0), ("verify", True, False, 1),
                                         ("verify", True, False, 2)]
    for i, (prompts, (_, max_new, stops, settings)) in enumerate(zip(prompt_sets, CALLS)):
        engine_module.clear_engine_cache()
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
    engine_module.clear_engine_cache()
    _run(target, draft, prompts, 14, *first, graphs)
    reused = _run(target, draft, prompts, 14, *second, graphs)
    engine_module.clear_engine_cache()
    fresh = _run(target, draft, prompts, 14, *second, graphs)
    return [s.tolist() for s in reused.sequences] != [s.tolist() for s in fresh.sequences]


def test_planted_replaced_stop_table_is_caught_only_by_the_emulator(monkeypatch):
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
    # the captured verify step reads the first call's table, which the second call frees: refused at replay
    with pytest.raises(GraphCaptureError, match="freed"):
        _reuse_differs_from_fresh(target, draft, "emulate", prompts, first, second)
    monkeypatch.setattr(DFlashEngine, "reset", real_reset)
    assert not _reuse_differs_from_fresh(target, draft, "emulate", prompts, first, second), "fixed code is clean"


def test_planted_python_temperature_is_caught_only_by_the_emulator(monkeypatch):
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


# ------------------------------------------------------------------- the torch backend under capture
def test_op_bodies_on_the_torch_backend_are_checked_on_request():
    """``torch_op_bodies=True`` runs a dflash op's reference under the capture rules: add_rms_norm's passes and
    still replays as one unit; verify_sample's reads its seed on the host (legal on the CPU backend, which runs
    that reference, so unchecked by default)."""
    x, w = torch.randn(3, 8), torch.randn(8)
    out = torch.full((3, 8), float("nan"))
    graph = record(lambda: add_rms_norm(x, w, 1e-6, out=out, backend="torch"), torch_op_bodies=True)
    assert [str(call[0]) for call in graph.calls] == ["dflash.add_rms_norm.default"]
    x.mul_(3)
    graph.replay()
    assert torch.equal(out, add_rms_norm(x, w, 1e-6, backend="torch"))
    logits, drafts = torch.randn(1, 3, 11), torch.randint(0, 11, (1, 2))

    def step():
        verify_sample(logits, drafts, temperature=torch.ones(1), seed=torch.tensor([1]), offset=torch.tensor([0]),
                      backend="torch")

    record(step)
    with pytest.raises(GraphCaptureError, match="host"):
        record(step, torch_op_bodies=True)


@pytest.fixture(scope="module")
def torch_backend_engine():
    """An engine on kernel_backend="torch" after a greedy call with emulated graphs (equal to eager)."""
    torch.manual_seed(3)
    target, draft = _pair()
    engine_module.clear_engine_cache()
    prompts = [torch.randint(0, 48, (n,)) for n in (5, 9)]
    runs = [generate(target, draft, prompts, 10, backend="fast", max_length=64, kernel_backend="torch",
                     use_cuda_graphs=graphs) for graphs in (False, "emulate")]
    assert [s.tolist() for s in runs[0].sequences] == [s.tolist() for s in runs[1].sequences]
    engine = engine_module.current_engine()
    engine_module.clear_engine_cache()
    return engine


@pytest.mark.parametrize("name, bodies", [("draft_step", {"inject_context_kv", "draft_attention"}),
                                          ("verify_step", {"verify_attention"})])
def test_engine_steps_on_the_torch_backend_capture_with_their_op_bodies_checked(torch_backend_engine, name, bodies):
    """The references of the KV-cache and attention ops run under the capture rules (no host read, static
    shapes) inside the engine's steps on kernel_backend="torch"."""
    graph = record(getattr(torch_backend_engine, name), torch_op_bodies=True)
    assert bodies <= {str(call[0]).split(".")[1] for call in graph.calls}
