"""Captured steps: CUDA graphs, and an emulator that gives their semantics on any device.

A captured step is frozen: replay re-runs the recorded kernels on the same memory, so a Python
value read while capturing (a temperature, a bound, a branch taken) and a tensor the step read
that is later *replaced* rather than overwritten in place keep their capture-time meaning. The
emulator reproduces exactly that on CPU: it records every dispatched op of one run of the step
(aten ops and ``torch.ops.dflash.*`` ops as single units) with the tensors it saw, and replays
that list without running the Python step again, writing each op's results into the tensors
recorded at capture. So a stale-state bug that would return wrong results from a real CUDA graph
returns the same wrong results here.

It refuses (:class:`GraphCaptureError`) what a real capture refuses or silently breaks:

- host reads of device values (``.item()``, ``bool(t)``, ``int(t)``, ``.tolist()``, ``.cpu()``,
  ``.numpy()``, ``torch.equal``): a device-to-host copy and a sync;
- data-dependent shapes (``nonzero``, ``unique``, ``masked_select``, ``bincount``, boolean-mask
  indexing and assignment, ``repeat_interleave`` without ``output_size``): the size is read on the host;
- memory the graph does not own. A real graph owns what the step allocates while capturing (its
  private pool, reused by every replay); every other tensor it reads or writes (weights, state, caches)
  is just an address baked into the graph, so its owner must keep it alive. A tensor allocated before
  capture and then freed (replaced instead of overwritten in place, during the step or later) leaves
  the graph reading and writing memory the allocator may hand to another tensor. The emulator keeps
  every tensor alive, so it detects that case instead: before capture ends and before each replay,
  each such tensor must still be referenced outside the graph.

A ``torch.ops.dflash.*`` op is one unit whose body is not checked: a Triton launch or the CPU backend's
code never meets a CUDA capture. ``record(..., torch_op_bodies=True)`` also checks the bodies of the ops
that run their PyTorch reference (backend ``"torch"``), which do run on the device under a capture. It is
off by default because the CPU backend runs some ops' references (verify_sample's reads its seed on the
host), which is legal there.
``x.to("cpu")`` is not refused: on a CPU emulation it cannot be told apart from a move to the step's
own device.
"""
from __future__ import annotations

import sys
from collections import Counter
from typing import Callable, Iterable

import torch
from torch._library.custom_ops import _maybe_get_opdef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

GRAPH_MODES = ("cuda", "emulate")

_aten = torch.ops.aten
# Ops that copy a device value to the host: a CUDA graph cannot contain them.
_HOST_READS = {_aten._local_scalar_dense.default, _aten.item.default, _aten.is_nonzero.default,
               _aten.equal.default}
# Tensor methods that copy to the host without an aten op on a CPU tensor (there they return the data as is).
_HOST_COPY_METHODS = {torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy}
# Ops that take boolean masks as indices: the mask is turned into indices by a nonzero, a host-sized result.
_MASK_INDEXED = {_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default,
                 _aten._index_put_impl_.default}
# Ops that wrap a tensor built from host data (``torch.tensor(...)``) inside the step: it is new memory.
_LIFTS = {_aten.lift_fresh.default, _aten.lift.default}
# A dflash op's body runs these on the device only with this backend (the last argument of every dflash op).
_DEVICE_TORCH_BACKEND = "torch"


class GraphCaptureError(RuntimeError):
    """A step did something a captured graph cannot hold."""


def _uncapturable(func, args, kwargs) -> str | None:
    """Why the dispatched ``func`` cannot be captured (module docstring), or None."""
    if func in _HOST_READS:
        return (f"{func} reads a device value on the host inside a captured step; keep the value on the "
                "device (a tensor argument) or read it outside the step")
    if func in _MASK_INDEXED:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(t is not None and t.dtype in (torch.bool, torch.uint8) for t in indices):
            return (f"{func} with a boolean mask has a data-dependent size (the mask's nonzero is read on the host) "
                    "inside a captured step; use torch.where / masked_fill_ / integer indices of a static count")
        return None
    if torch.Tag.dynamic_output_shape in func.tags:
        if func is _aten.repeat_interleave.Tensor and kwargs.get("output_size") is not None:
            return None
        return (f"{func} has a data-dependent output shape (read on the host) inside a captured step; use a "
                "static-shape form (torch.where with three arguments, nonzero_static, an output_size)")
    return None


def _refuse_uncapturable(func, args, kwargs) -> None:
    """Raise :class:`GraphCaptureError` if the dispatched ``func`` cannot be captured."""
    reason = _uncapturable(func, args, kwargs)
    if reason is not None:
        raise GraphCaptureError(reason)


def _copies_to_host(func, args, kwargs) -> bool:
    """Whether a tensor-method call copies to the host: ``_HOST_COPY_METHODS``, or ``.to`` a CPU device."""
    if func in _HOST_COPY_METHODS:
        return True
    if func is not torch.Tensor.to:
        return False
    targets = [a for a in (*args[1:], kwargs.get("device")) if isinstance(a, (str, torch.device))]
    return any(torch.device(a).type == "cpu" for a in targets)


class _HostCopyRefusal(TorchFunctionMode):
    """Refuses the tensor methods that copy to the host (``_HOST_COPY_METHODS``)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _HOST_COPY_METHODS:
            raise GraphCaptureError(
                f"Tensor.{func.__name__}() copies a device value to the host inside a captured step; keep the "
                "value on the device or read it outside the step")
        return func(*args, **(kwargs or {}))


class _CaptureRules(TorchDispatchMode):
    """Checks every dispatched op against the capture rules; with ``torch_op_bodies``, runs the body of a
    dflash op on the "torch" backend under the same rules (and :class:`_HostCopyRefusal`)."""

    def __init__(self, torch_op_bodies: bool) -> None:
        super().__init__()
        self.torch_op_bodies = torch_op_bodies

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        _refuse_uncapturable(func, args, kwargs)
        if self.torch_op_bodies and func.namespace == "dflash" and args and args[-1] == _DEVICE_TORCH_BACKEND:
            body = _maybe_get_opdef(func)._init_fn  # the op's Python function, as custom_op registered it
            # Its checked_by check reads index values on the host only for CPU tensors (none on a device, so
            # nothing a capture would see): it runs outside the rules, the body under them.
            check = getattr(body, "check", None)
            if check is not None:
                check(*args, **kwargs)
                body = body.unchecked
            with _HostCopyRefusal(), _CaptureRules(torch_op_bodies=True):
                return body(*args, **kwargs)
        return func(*args, **kwargs)


class _Recorder(_CaptureRules):
    def __init__(self, torch_op_bodies: bool) -> None:
        super().__init__(torch_op_bodies)
        self.calls: list[tuple] = []
        self.pool: set[int] = set()      # storages first seen as an op's new output: allocated by the step
        self.borrowed: set[int] = set()  # storages first seen as an op's input: allocated before capture

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for t in _tensors((args, kwargs)):
            if _storage_key(t) not in self.pool:
                (self.pool if func in _LIFTS else self.borrowed).add(_storage_key(t))
        out = super().__torch_dispatch__(func, types, args, kwargs)
        for t in _tensors(out):
            if _storage_key(t) not in self.borrowed:
                self.pool.add(_storage_key(t))
        # A view aliases memory that is recorded anyway: replay has nothing to redo for it. The schema
        # alone does not tell (``aten.to`` may alias or copy), so check that it really aliased.
        if not (func.is_view and _aliases_inputs(out, args, kwargs)):
            self.calls.append((func, args, kwargs, out))
        return out


class _Tally:
    """A mode that appends to ``reads`` the name of every call ``counts(func, args, kwargs)`` holds for, then runs it."""

    def __init__(self, reads: list[str], counts: Callable[..., object]) -> None:
        super().__init__()
        self.reads, self.counts = reads, counts

    def _tally(self, func, args, kwargs):
        kwargs = kwargs or {}
        if self.counts(func, args, kwargs):
            self.reads.append(func.__name__)
        return func(*args, **kwargs)


class _HostReadTally(_Tally, TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self._tally(func, args, kwargs)


class _HostCopyTally(_Tally, TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return self._tally(func, args, kwargs)


class HostSyncCounter:
    """Counts the host syncs of the code run inside it, by the rules a capture refuses: host reads of tensor
    values (``.item()``, ``bool(t)``, ``int(t)``, ``torch.equal``), copies to the host (``.tolist()``, ``.cpu()``,
    ``.numpy()``, ``.to("cpu")``) and data-dependent shapes (``nonzero``, boolean indexing, ...). Each is a
    device-to-host copy that waits for the device on a GPU; on a CPU they cost nothing, so this is how a test
    sees them. A ``torch.ops.dflash.*`` op counts as device work (its body is not looked into).

    Every read of a tensor counts: on a CPU run host and device tensors cannot be told apart, so the counted
    code keeps what it has read in Python values. ``reads`` lists what was counted, in order."""

    def __init__(self) -> None:
        self.reads: list[str] = []
        self._modes = (_HostCopyTally(self.reads, _copies_to_host),
                       _HostReadTally(self.reads, lambda *call: _uncapturable(*call) is not None))

    @property
    def count(self) -> int:
        return len(self.reads)

    def __enter__(self) -> "HostSyncCounter":
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _aliases_inputs(out, args, kwargs) -> bool:
    storages = {t.untyped_storage().data_ptr() for t in _tensors((args, kwargs))}
    return all(t.untyped_storage().data_ptr() in storages for t in _tensors(out))


class EmulatedGraph:
    """The recorded ops of one step; :meth:`replay` re-runs them on the captured tensors."""

    def __init__(self, calls: list[tuple], borrowed: set[int]):
        self.calls = calls
        # Each tensor object the calls hold on a storage allocated before capture, with how many references
        # the calls hold to it, grouped by storage (what :meth:`check_borrowed_alive` needs).
        held = Counter(id(t) for t in _tensors(calls))
        self._borrowed: dict[int, list[tuple[torch.Tensor, int]]] = {}
        seen: set[int] = set()
        for t in _tensors(calls):
            if id(t) not in seen and _storage_key(t) in borrowed:
                seen.add(id(t))
                self._borrowed.setdefault(_storage_key(t), []).append((t, held[id(t)]))

    @property
    def num_ops(self) -> int:
        return len(self.calls)

    def check_borrowed_alive(self) -> None:
        """Raise :class:`GraphCaptureError` if a tensor allocated before capture that the graph reads or
        writes is referenced by nothing but the graph (its owner freed it: see the module docstring)."""
        # References to a held tensor besides the calls': this loop's (the list entry, the loop variable
        # and getrefcount's argument), measured on an object nobody else holds.
        probe = [(object(), 0)]
        baseline = next(sys.getrefcount(t) - n for t, n in probe)
        for key, held in self._borrowed.items():
            # a storage's use count: one per tensor on it, plus its Python storage object (made by the query)
            if torch._C._storage_Use_Count(key) - 1 > len(held):
                continue  # another tensor (a view, a base) holds the storage
            if any(sys.getrefcount(t) - n > baseline for t, n in held):
                continue
            t = held[0][0]
            raise GraphCaptureError(
                f"a {tuple(t.shape)} {t.dtype} tensor allocated before capture, which the captured step reads "
                "or writes, was freed (replaced instead of overwritten in place?): a CUDA graph would access "
                "memory the allocator may give to another tensor; keep it alive and write it in place")

    def replay(self) -> None:
        self.check_borrowed_alive()
        for func, args, kwargs, recorded in self.calls:
            fresh = func(*args, **kwargs)
            for old, new in zip(tree_leaves(recorded), tree_leaves(fresh)):
                if not isinstance(old, torch.Tensor) or old is new or old.data_ptr() == new.data_ptr():
                    continue  # in-place ops return their (recorded) input
                if old.shape != new.shape:
                    raise GraphCaptureError(f"{func} produced shape {tuple(new.shape)} on replay, "
                                            f"{tuple(old.shape)} at capture: a data-dependent shape cannot be captured")
                old.copy_(new)


def record(step: Callable[[], object], *, torch_op_bodies: bool = False) -> EmulatedGraph:
    """Run ``step`` once, recording every dispatched op (see the module docstring for the refusals and
    ``torch_op_bodies``)."""
    recorder = _Recorder(torch_op_bodies)
    with _HostCopyRefusal(), recorder:
        step()
    graph = EmulatedGraph(recorder.calls, recorder.borrowed)
    graph.check_borrowed_alive()
    return graph


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
