"""A public op call validates its arguments once: the public function checks them (it needs them valid to size
an output or pack parameters), then runs the registered op's body through call_op(checked=True), which skips
the op's own copy of the same checks. A direct torch.ops.dflash.* call still runs them."""
import importlib

import pytest
import torch

from dflash_kernels import commit, gated_mlp, verify

fused_context = importlib.import_module("dflash_kernels.fused_context")  # the package exports the function by that name


def _commit_args():
    r = 2
    return (torch.randint(0, 9, (r, 3)), torch.tensor([1, 0]), torch.tensor([4, 5])), dict(
        out_tokens=torch.zeros(r, 16, dtype=torch.int64), lengths=torch.tensor([0, 3]), positions=torch.tensor([2, 5]),
        anchor=torch.tensor([7, 8]), done=torch.zeros(r, dtype=torch.bool), max_lengths=torch.tensor([16, 16]))


def _cases():
    x, w = torch.randn(3, 8), torch.randn(10, 8)
    taps, fc, nw = [torch.randn(2, 6) for _ in range(3)], torch.randn(6, 18), torch.rand(6) + 0.5
    logits, drafts = torch.randn(2, 4, 11), torch.randint(0, 11, (2, 3))
    seed, offset = torch.tensor([3]), torch.tensor([1])
    cargs, ckw = _commit_args()
    return {
        "gate_up_silu": (gated_mlp, ("_validate",), lambda: gated_mlp.gate_up_silu(x, w, backend="torch"),
                         lambda: torch.ops.dflash.gate_up_silu(x, w, torch.empty(3, 5), None, None, "torch")),
        "fused_context": (fused_context, ("_validate",),
                          lambda: fused_context.fused_context(taps, fc, nw, 1e-6, backend="torch"),
                          lambda: torch.ops.dflash.fused_context(taps, fc, nw, 1e-6, torch.empty(2, 6), "torch")),
        "verify_sample": (verify, ("_validate", "check_packed_sampling"),
                          lambda: verify.verify_sample(logits, drafts, temperature=0.9, top_k=4, seed=seed,
                                                       offset=offset, backend="torch"),
                          lambda: torch.ops.dflash.verify_sample(
                              logits, drafts, *verify.sampling_op_args("verify_sample", logits, 0.9, 4, 1.0, seed,
                                                                       offset), None, None, "torch")),
        "commit_round": (commit, ("_validate",), lambda: commit.commit_round(*cargs, **ckw, backend="torch"),
                         lambda: torch.ops.dflash.commit_round(*cargs, *ckw.values(), None, "torch")),
    }


@pytest.mark.parametrize("op", ["gate_up_silu", "fused_context", "verify_sample", "commit_round"])
def test_public_call_validates_once_and_the_registered_op_still_checks(monkeypatch, op):
    module, names, public, direct = _cases()[op]
    calls = []
    for name in names:
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    public()
    assert calls == [names[0]], f"{op}: the public call validated {calls}"
    calls.clear()
    direct()
    assert sorted(calls) == sorted(names), f"{op}: a direct torch.ops call must run its own checks, ran {calls}"
