"""Backend selection shared by every public op.

Rule: an explicitly requested backend that cannot run raises; ``"auto"`` picks the fastest
backend that can run on the given tensors. ``DFLASH_KERNELS_BACKEND`` (auto|triton|cpu|torch|ext)
overrides the ``backend=`` argument of every op process-wide; like ``TRITON_INTERPRET`` it is read once, when
``dflash_kernels`` is imported.

``"cpu"`` is the eager CPU path: an op's CPU body (the same definition as its reference, with the per-call
Python work cut: batched over requests, one RoPE table per call; native kernels where they apply) where the CPU
wing (``dflash_kernels.cpu``) registered one, else its reference, which is already what runs on a CPU. It runs
on CPU tensors only.

A backend's wing registers its bodies here (:func:`register`, keyed by op and backend) instead of each op
branching on the backend: an op lists the backends it implements itself, the registered ones join them just
before ``"torch"``, and the op's body runs ``registered(op, chosen)`` when there is one. The runtime reads what a
backend offers its steps from :func:`backend_traits`, never from the backend's name.
"""
from __future__ import annotations

import functools
import inspect
import os
from typing import Callable, NamedTuple

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

BACKENDS = ("auto", "triton", "cpu", "torch", "ext")
ENV_VAR = "DFLASH_KERNELS_BACKEND"


def triton_status(device: torch.device) -> tuple[bool, str]:
    """Whether Triton kernels can run on tensors of ``device``, and why not."""
    try:
        import triton  # noqa: F401
    except ImportError as exc:  # pragma: no cover - triton is a hard dependency
        return False, f"triton is not importable ({exc})"
    interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if device.type == "cuda":
        if interpret:
            return False, "TRITON_INTERPRET=1 runs kernels on the CPU only"
        return True, "compiled for the GPU"
    if device.type == "cpu":
        if interpret:
            return True, "CPU interpreter (TRITON_INTERPRET=1)"
        return False, "CPU tensors need TRITON_INTERPRET=1 set before dflash_kernels is imported"
    return False, f"no Triton backend for device type {device.type!r}"


# Read once: an environment lookup costs ~2 us, against ~1 us for the memo below, on each of the ~250 backend
# resolutions (two per op call) of a SmolLM2 verify step on the CPU.
_FORCED = os.environ.get(ENV_VAR)
# (op, backend, device type, available) -> the backend it resolved to. Every input of a resolution is fixed for
# the process: the override above, TRITON_INTERPRET (read before import), the extension's status (cached).
_resolved: dict[tuple, str] = {}


# (op, backend) -> the body a backend's wing registered for the op: the op's arguments in schema order, the
# backend left out; it returns what the op returns.
_bodies: dict[tuple[str, str], Callable] = {}


def register(op: str, backend: str):
    """Decorator: the function is ``op``'s body on ``backend`` (a wing's implementation, e.g. the CPU wing's).
    Registration happens when ``dflash_kernels`` is imported, before any backend is resolved."""
    if backend not in BACKENDS or backend == "auto":
        raise ValueError(f"register: backend={backend!r} is not one of {BACKENDS[1:]}")

    def add(body: Callable) -> Callable:
        if (op, backend) in _bodies:
            raise ValueError(f"register: {op!r} already has a {backend!r} body ({_bodies[op, backend].__module__})")
        _bodies[op, backend] = body
        return body
    return add


def registered(op: str, backend: str) -> Callable | None:
    """The body a wing registered for ``op`` on ``backend``, or None (the op runs its own code for it)."""
    return _bodies.get((op, backend))


def resolve_backend(op: str, backend: str, device: torch.device, available: tuple[str, ...]) -> str:
    """Return the backend ``op`` will run with.

    ``available`` lists the backends the op implements itself, fastest first (``"torch"`` last); the backends
    with a registered body for ``op`` join them just before ``"torch"``.
    """
    key = (op, backend, device.type, available)
    chosen = _resolved.get(key)
    if chosen is None:
        chosen = _resolved[key] = _resolve(op, backend, device, available)
    return chosen


def _resolve(op: str, backend: str, device: torch.device, available: tuple[str, ...]) -> str:
    wings = tuple(b for b in BACKENDS if (op, b) in _bodies and b not in available)
    available = available[:-1] + wings + available[-1:]  # the registered ones before "torch"
    forced = _FORCED
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"{ENV_VAR}={forced!r} is not one of {BACKENDS}")
        backend = forced
    if backend not in BACKENDS:
        raise ValueError(f"{op}: backend={backend!r} is not one of {BACKENDS}")
    if backend == "auto":
        for candidate in available:
            if backend_status(candidate, device)[0]:
                return candidate
        return "torch"
    if backend not in available and backend != "cpu":
        raise ValueError(f"{op}: backend={backend!r} is not implemented for this op; choose from {available}")
    ok, why = backend_status(backend, device)
    if not ok:
        raise RuntimeError(f"{op}: backend={backend!r} cannot run on {device.type} tensors: {why}")
    # "cpu" on an op without a CPU body: its reference is that op's CPU path.
    return backend if backend in available else "torch"


class BackendTraits(NamedTuple):
    """What a kernel backend offers the runtime's steps, so that they pick their path by capability, not by the
    backend's name."""
    # The ops that fuse a GEMM with its epilogue (fused_context, gate_up_silu) are the fast path. False: the
    # backend's own linear kernel is faster than those ops' GEMM; run it, then the epilogue op (add_rms_norm,
    # silu_mul).
    fused_gemm: bool = True
    # The LM head can return its argmax without computing most logits, so greedy acceptance takes tokens.
    argmax_head: bool = False
    # The steps run eagerly on host tensors: reading a value there is free, and torch's CPU ops (their tie
    # orders) are the ones the reference modules compute with.
    host_eager: bool = False


# backend -> the traits its wing registered; a backend without an entry has the defaults.
_traits: dict[str, BackendTraits] = {}


def register_traits(backend: str, traits: BackendTraits) -> None:
    """Declare what ``backend`` (its wing, at import) offers the runtime's steps."""
    if backend not in BACKENDS:
        raise ValueError(f"register_traits: backend={backend!r} is not one of {BACKENDS}")
    _traits[backend] = traits


def backend_traits(backend: str) -> BackendTraits:
    """What the kernel backend ``backend`` (as a model's steps pass it to every op) offers those steps."""
    if backend not in BACKENDS:
        raise ValueError(f"backend_traits: backend={backend!r} is not one of {BACKENDS}")
    return _traits.get(backend, BackendTraits())


def default_backend(device: torch.device) -> str:
    """The kernel backend a model's steps take on ``device``: ``"auto"`` on GPU; on CPU the ops' eager CPU bodies
    (``"cpu"``), never the Triton interpreter, which is for tests only; elsewhere (meta tensors: the traffic
    accountant, which models the GPU steps) the references."""
    if device.type == "cuda":
        return "auto"
    return "cpu" if device.type == "cpu" else "torch"


def backend_status(backend: str, device: torch.device) -> tuple[bool, str]:
    if backend == "torch":
        return True, "pure PyTorch reference"
    if backend == "cpu":
        if device.type == "cpu":
            return True, "eager CPU implementation"
        return False, f"the CPU implementations need CPU tensors, these are on {device.type}"
    if backend == "triton":
        return triton_status(device)
    if backend == "ext":
        from dflash_kernels import _ext

        return _ext.status(device)
    return False, f"unknown backend {backend!r}"


def lean_version_bump(op) -> None:
    """Give the mutating custom op ``op`` (a ``torch.library.custom_op``) a cheaper ADInplaceOrView kernel.

    Eager calls of a mutating custom op pass through that kernel, which bumps the version counters of the
    written arguments. torch's (``torch/_library/custom_ops.py``) first calls ``fill_defaults``, which rebuilds
    the schema's argument list for every argument: quadratic in the argument count, about 140 us of a
    ``verify_attention`` call (17 arguments) on a 2-core CPU, against 140 us for the attention itself.
    This kernel does the same work (bump the written tensors, found once from the schema; redispatch past the
    key with torch's own keyset) without that. Under ``torch.compile`` and FakeTensor nothing changes.
    """
    overload = op._opoverload
    written = [(i, a.name) for i, a in enumerate(overload._schema.arguments)
               if a.alias_info is not None and a.alias_info.is_write]
    after = torch._C._after_ADInplaceOrView_keyset

    def adinplaceorview(keyset, *args, **kwargs):
        for i, name in written:
            t = args[i] if i < len(args) else kwargs.get(name)
            if t is not None:
                torch._C._increment_version(t)
        return overload.redispatch(keyset & after, *args, **kwargs)

    op._lib.impl(op._name, adinplaceorview, "ADInplaceOrView", with_keyset=True)


def unobserved_eager(tensors=()) -> bool:
    """Whether nothing above plain eager execution watches the calls made now: no ``torch.compile`` tracing,
    no ``TorchDispatchMode`` (the graph emulator of ``dflash.graphs``, FakeTensor, the traffic accountant's
    counter) and no autograd recording through ``tensors`` (an iterable, only read with grad mode on). Only
    then may a call skip the dispatcher (a native kernel called directly, an op's Python body): every watcher above needs to
    see the registered op."""
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        return False
    return not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors))


def _tensor_args(args):
    for a in args:
        for t in (a if isinstance(a, (list, tuple)) else (a,)):
            if isinstance(t, torch.Tensor):
                yield t


def checked_by(check):
    """Decorator of a registered op's body (below ``@torch.library.custom_op``): the op runs ``check`` on its
    arguments (schema order, the backend last) before the body, so ``torch.ops.dflash.<op>`` called directly
    validates exactly as the public function does. ``check`` raises TypeError / ValueError before any work; it
    reads index values on the host only for CPU tensors (free there, and what the C kernels, the references and
    the Triton interpreter index with), never for device tensors (no host sync, so graph capture is unaffected).

    The body without the check stays reachable through one path only: :func:`call_op` with ``checked=True``,
    for a caller that already validated the same arguments (the public functions' ``validate=False``). The
    wrapper carries ``check`` and ``unchecked`` (the body) for the graph emulator, which runs the check outside
    its capture rules (it reads on the host only for CPU tensors) and the body under them."""
    def wrap(body):
        @functools.wraps(body)
        def op_body(*args, **kwargs):
            check(*args, **kwargs)
            return body(*args, **kwargs)
        op_body.unchecked = body
        op_body.check = check
        # custom_op reads the schema from the signature: the body's, its annotations evaluated where it is defined.
        op_body.__signature__ = inspect.signature(body, eval_str=True)
        return op_body
    return wrap


def call_op(op, *args, device: torch.device, checked: bool = False):
    """Run the registered custom op ``op`` (a ``torch.library.custom_op``, i.e. ``torch.ops.dflash.<name>``) on
    ``args`` (its arguments in schema order, the backend last; ``device``: where its tensors are).

    On CPU tensors with nothing watching (:func:`unobserved_eager`) the op's Python body runs directly: the
    dispatcher's round trip (schema parsing, the ADInplaceOrView kernel of a mutating op, the Python kernel
    call) costs 20-70 us per call on a 2-core CPU, against 8-130 us of work for the ~120 op calls of a
    SmolLM2 decoding step. Everywhere else (GPU, capture, compile, fake tensors) the call goes through
    ``torch.ops.dflash``, so those see one op as before.

    ``checked=True`` is the internal unchecked path: on that direct CPU call the body skips its
    :func:`checked_by` check. Only for arguments already validated with the same shapes, dtypes, devices and
    index values (a layer after the first of one forward); anywhere else the op checks as always."""
    if device.type == "cpu" and unobserved_eager(_tensor_args(args)):
        body = op._init_fn  # the function custom_op registered (torch/_library/custom_ops.py)
        return (getattr(body, "unchecked", body) if checked else body)(*args)
    return op(*args)
