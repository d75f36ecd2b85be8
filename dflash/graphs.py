"""Captured steps: CUDA graphs, and an emulator that gives their semantics on any device.

A captured step is frozen: replay re-runs the recorded kernels on the same memory, so a Python
value read while capturing (a temperature, a bound, a branch taken) and a tensor the step read
that is later *replaced* rather than overwritten in place keep their capture-time meaning. The
emulator reproduces exactly that on CPU: it records every dispatched op of one run of the step
(aten ops and ``torch.ops.dflash.*`` ops as single units) with the tensors it saw, and replays
that list without running the Python step again, writing each op's results into the tensors
recorded at capture. A host read of a device value inside the step (``.item()``, ``bool(t)``)
raises :class:`GraphCaptureError` while capturing, as it breaks a real capture. So a stale-state
bug that would return wrong results from a real CUDA graph returns the same wrong results here.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

GRAPH_MODES = ("cuda", "emulate")

_aten = torch.ops.aten
# Ops that copy a device value to the host: a CUDA graph cannot contain them.
_HOST_READS = {_aten._local_scalar_dense.default, _aten.is_nonzero.default, _aten.equal.default}


class GraphCaptureError(RuntimeError):
    """A step did something a captured graph cannot hold."""


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _HOST_READS:
            raise GraphCaptureError(
                f"{func} reads a device value on the host inside a captured step; keep the value on the "
                "device (a tensor argument) or read it outside the step")
        out = func(*args, **kwargs)
        # A view aliases memory that is recorded anyway: replay has nothing to redo for it. The schema
        # alone does not tell (``aten.to`` may alias or copy), so check that it really aliased.
        if not (func.is_view and _aliases_inputs(out, args, kwargs)):
            self.calls.append((func, args, kwargs, out))
        return out


def _aliases_inputs(out, args, kwargs) -> bool:
    storages = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
    return all(t.untyped_storage().data_ptr() in storages for t in tree_leaves(out) if isinstance(t, torch.Tensor))


class EmulatedGraph:
    """The recorded ops of one step; :meth:`replay` re-runs them on the captured tensors."""

    def __init__(self, calls: list[tuple]):
        self.calls = calls

    @property
    def num_ops(self) -> int:
        return len(self.calls)

    def replay(self) -> None:
        for func, args, kwargs, recorded in self.calls:
            fresh = func(*args, **kwargs)
            for old, new in zip(tree_leaves(recorded), tree_leaves(fresh)):
                if not isinstance(old, torch.Tensor) or old is new or old.data_ptr() == new.data_ptr():
                    continue  # in-place ops return their (recorded) input
                if old.shape != new.shape:
                    raise GraphCaptureError(f"{func} produced shape {tuple(new.shape)} on replay, "
                                            f"{tuple(old.shape)} at capture: a data-dependent shape cannot be captured")
                old.copy_(new)


def record(step: Callable[[], object]) -> EmulatedGraph:
    """Run ``step`` once, recording every dispatched op (see the module docstring)."""
    recorder = _Recorder()
    with recorder:
        step()
    return EmulatedGraph(recorder.calls)


def capture(step: Callable[[], object], mode: str, state: Iterable[torch.Tensor] = ()):
    """Capture ``step`` as a CUDA graph (``mode="cuda"``) or an :class:`EmulatedGraph` (``"emulate"``).

    The step runs once first (compiles Triton kernels, sets up cuBLAS; on a side stream on CUDA),
    then is captured. ``state``: the tensors the step mutates; they hold their pre-capture values
    afterwards, so the first :meth:`replay` performs the first real step in both modes.
    Returns an object with ``replay()``.
    """
    if mode not in GRAPH_MODES:
        raise ValueError(f"capture: mode={mode!r} is not one of {GRAPH_MODES}")
    state = list(state)
    snapshot = [t.clone() for t in state]

    def restore() -> None:
        for t, saved in zip(state, snapshot):
            t.copy_(saved)

    if mode == "emulate":
        step()
        restore()
        graph = record(step)
        restore()
        return graph
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    restore()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    restore()  # capture records without running; restore anyway in case a kernel ran eagerly
    torch.cuda.synchronize()
    return graph
