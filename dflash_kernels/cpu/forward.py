"""The lean target's forward on the "cpu" backend with its decoder layers in one native call: the CPU's counterpart
of a captured GPU step, and the one CPU target forward wherever it applies.

Why: a SmolLM2 forward makes ~240 kernel calls (seven a layer and the LM head), and the Python around them (each
op's argument checks and backend resolution, the output allocations, the ``cpu_linear`` dispatch) cost 11-19 ms of
a 35-57 ms forward on the project's 2-core CPU: the same forward's native calls, recorded once and called back to
back with their recorded arguments, take 20-41 ms (``bench/results/2026-12-02-cpu-smollm2-vocab4096.md``). A
:class:`NativeForward` checks everything once per shape, keeps the activations in buffers of its own, and runs a
forward as the embedding, the RoPE tables, then one ``torch.ops.dflash_cpu.forward_layers`` call for every layer
(``csrc/cpu/forward.cpp``: each layer's seven kernels in C++), the final norm and the LM head: the kernels and
arguments of the op path (``LeanTarget``'s layer loop), so the same bits. One call, not one a layer: the Python and
dispatch around 30 per-layer calls, with the routes planned on every forward, cost ~1.9 ms of an 11.9 ms one-token
SmolLM2 step (2-core Xeon), ~16 % (``bench/results/2026-12-05-cpu-one-call-forward.md``).

Each projection takes the route ``cpu_linear.linear`` would take at these rows (``cpu_linear.route``, the one rule):
the AMX tiles of a bf16-exact weight, the fp32 kernel (AVX-512 or AVX2) on a bf16-exact weight's bf16-packed copy
or on the fp32 weight, or torch's linear (``F.linear``'s
arithmetic, in C++). Applies where the op path runs the native kernels: the "cpu" backend, fp32, the native CPU
kernels available (:func:`dflash_kernels.cpu.native.enabled`), head dim a multiple of 16 (at most 512), no sliding
window, nothing watching (no ``torch.compile`` tracing, dispatch mode or autograd: those must see the ops), and at
most :data:`MAX_ROWS` rows a request (decode, verify and tree steps, and prefill chunks up to the engine's 512 rows:
a SmolLM2 prefill of 117 / 256 / 512 rows took 58.6 / 147 / 404 ms against the op path's 70.3 / 171 / 454 on the
2-core Xeon; its buffers are ~31 KB a row for SmolLM2). Elsewhere ``forward`` returns None and ``LeanTarget`` runs
its op path.
``DFLASH_NATIVE_FORWARD=0`` (or :func:`set_enabled`) turns it off (A/B runs, tests).

The routes (and the weights' packed forms: ``cpu_linear.bf16_tiles`` / ``bf16_rows``) are planned once and kept
while ``cpu_linear.route_key`` (the settings, each weight's version and storage) is unchanged, so an in-place update
(which repacks the weight) or a switched setting is seen as on the op path.
"""
from __future__ import annotations

import os

import torch

from dflash_kernels.cpu import linear as cpu_linear
from dflash_kernels.cpu import native as cpu_native
from dflash_kernels._dispatch import unobserved_eager
from dflash_kernels.cpu.rope import rope_tables_cpu

ENV = "DFLASH_NATIVE_FORWARD"
MAX_ROWS = 512  # dflash.engine's prefill chunk
# cpu_linear.route's answers as forward_layers' route codes (dflash_cpu::Route, csrc/cpu/dflash_cpu.h)
ROUTES = {"amx": 0, "avx512": 1, "avx2": 2, "torch": 3, "avx512_bf16": 4, "avx2_bf16": 5}
_on = os.environ.get(ENV, "1") != "0"


def set_enabled(enabled: bool) -> bool:
    """Turn the native forward on or off for this process; returns the previous setting."""
    global _on
    before, _on = _on, bool(enabled)
    return before


class _Projection:
    """One projection of a layer as ``cpu_linear.linear`` reads it: the tensors its AMX tiles are kept for
    (``sources``), the weights the other routes read, the biases (None: none) and the fewest rows its fp32 kernel
    takes (row blocks from one, a plain weight from ``cpu_linear.MIN_ROWS``)."""

    __slots__ = ("sources", "weights", "biases", "sizes", "min_rows")

    def __init__(self, weight, bias=None):
        if type(weight) is cpu_linear.RowBlocks:
            self.sources = weight.sources
            self.weights, self.biases = weight.args
            self.min_rows = 1
        else:
            self.sources, self.weights, self.biases = (weight,), [weight], [bias]
            self.min_rows = cpu_linear.MIN_ROWS
        self.sizes = [w.shape[0] for w in self.weights]

    def plan(self, rows: int, out: tuple[list, list, list, list, list]) -> None:
        """Append this projection's route, block count, tensors, block rows and biases at ``rows`` rows to ``out``
        (forward_layers' ``routes, nblocks, weights, block_rows, biases``)."""
        how, tensors = cpu_linear.route(self.sources, self.weights, rows, self.min_rows)
        routes, nblocks, weights, block_rows, biases = out
        routes.append(ROUTES[how])
        nblocks.append(len(tensors))
        weights += tensors
        block_rows += self.sizes
        biases += self.biases


class NativeForward:
    """The native forward of one :class:`dflash.lean_target.LeanTarget` at one shape (``n`` requests of ``q`` rows):
    its activation buffers and the per-layer constants of the kernel calls."""

    def __init__(self, lt, n: int, q: int):
        model = lt.model
        self.n, self.q = n, q
        m = n * q
        self.hidden = h = model.config.hidden_size
        self.nh, self.kvh, self.d = lt.num_heads, lt.num_kv_heads, lt.head_dim
        self.inter = inter = lt.gate_up[0][0].out_features // 2  # gate and up: row blocks of one call

        def empty(cols: int) -> torch.Tensor:
            return torch.empty((m, cols), dtype=torch.float32)
        self.h, self.x, self.delta = empty(h), empty(h), empty(h)  # residual stream, normed input, sub-block out
        self.qkv, self.attn = empty((self.nh + 2 * self.kvh) * self.d), empty(self.nh * self.d)
        self.gu, self.act = empty(2 * inter), empty(inter)
        # each layer's four projections
        self.projections = [(_Projection(lt.qkv[li][0]), _Projection(p.o_weight, p.o_bias),
                             _Projection(lt.gate_up[li][0]), _Projection(p.down_weight, p.down_bias))
                            for li, p in enumerate(lt.layers)]
        # what autograd would record through (read only with grad mode on)
        self.parameters = [t for layer in self.projections for proj in layer
                           for t in (*proj.sources, *proj.biases) if t is not None]
        self.sources = [t for layer in self.projections for proj in layer for t in proj.sources]
        self.plan_key, self.plan = None, None  # the projections' routes, kept while cpu_linear.route_key holds
        # forward_layers' per-layer constants; the residual stream entering layer li is tapped for the output of
        # layer li - 1 (the last layer's output is tapped after the final norm's add)
        layers = lt.layers
        self.norms = ([p.input_norm for p in layers], [float(p.input_eps) for p in layers],
                      [p.post_norm for p in layers], [float(p.post_eps) for p in layers],
                      [p.q_norm for p in layers], [p.k_norm for p in layers], [float(p.qk_norm_eps) for p in layers],
                      [float(self.d ** -0.5 if p.scale is None else p.scale) for p in layers])
        taps = [(li, t) for li in range(len(layers)) for t in lt.taps.get(li - 1, ())]
        self.tap_layers, self.tap_slots = [li for li, _ in taps], [t for _, t in taps]

    @staticmethod
    def supports(lt) -> bool:
        """Whether ``lt``'s layers are what the native forward runs (fixed for a LeanTarget: checked once by it)."""
        d = lt.head_dim  # (a lean target has no sliding window: check_lean_target)
        if lt.backend != "cpu" or d % 16 or d > cpu_native.MAX_HEAD_DIM:
            return False
        if any(type(lt.qkv[li][0]) is not cpu_linear.RowBlocks or type(lt.gate_up[li][0]) is not cpu_linear.RowBlocks
               or lt.qkv[li][1] is not None or lt.gate_up[li][1] is not None or not lt.qkv[li][0].fast
               or not lt.gate_up[li][0].fast for li in range(len(lt.layers))):
            return False
        tensors = [lt.k_cache, lt.v_cache, lt.model.model.embed_tokens.weight, lt.model.model.norm.weight]
        rows_of = []  # weights and biases read with unit stride along their last dimension (cpu_linear's fast path)
        for p in lt.layers:
            tensors += [p.input_norm, p.post_norm] + [t for t in (p.q_norm, p.k_norm) if t is not None]
            rows_of += [t for t in (p.o_weight, p.o_bias, p.down_weight, p.down_bias) if t is not None]
        return (all(t.dtype == torch.float32 and t.is_cpu and t.is_contiguous() for t in tensors)
                and all(t.dtype == torch.float32 and t.is_cpu and t.stride(-1) == 1 for t in rows_of))

    @staticmethod
    def available(n: int, q: int) -> bool:
        """Whether it runs now at this shape: turned on, the native kernels loaded, at most MAX_ROWS rows."""
        return _on and 1 <= q <= MAX_ROWS and n >= 1 and cpu_native.library() is not None

    def forward(self, lt, input_ids: torch.Tensor, start: torch.Tensor, rows: torch.Tensor | None,
                tree: tuple[torch.Tensor, torch.Tensor] | None, last_logits_only: bool, argmax: bool = False):
        """``LeanTarget.forward``'s results (fresh logits, or their argmax, and features tensors), or None where it
        does not apply (nothing written then)."""
        n, q = self.n, self.q
        m, hid = n * q, self.hidden
        ops = cpu_native.library()
        if ops is None or not unobserved_eager(self.parameters):
            return None
        if not (start.dtype == torch.int64 and start.is_contiguous() and start.numel() == n
                and input_ids.shape == (n, q)):
            return None
        lens = start.tolist()
        cap = lt.k_cache.shape[2]
        if min(lens) < 0 or max(lens) + q > cap:
            return None  # left to the op path
        if rows is not None:
            rows = rows.tolist()
            if len(rows) != n or not all(0 <= r < lt.k_cache.shape[1] for r in rows):
                return None
        elif n > lt.k_cache.shape[1]:
            return None
        # The kernels read private int64 copies of exactly the values checked above (another thread may write the
        # caller's tensors meanwhile; int32 rows would otherwise be read as int64).
        start_t, rows_t = (None if x is None else torch.tensor(x, dtype=torch.int64) for x in (lens, rows))
        mask, depths = None, None
        if tree is not None:
            depths, mask = tree
            mask = mask.contiguous()
            if (mask.shape[:2] != (n, q) or mask.shape[2] * 64 < q or mask.dtype != torch.int64
                    or depths.shape != (n, q)):
                return None
        cos, sin = rope_tables_cpu(lens, q, lt.inv_freq, lt.attention_scaling, torch.float32, depths)
        cos, sin = cos.contiguous(), sin.contiguous()
        if cos.shape != (n * q, self.d) or sin.shape != cos.shape:  # the kernel reads a row per block row
            return None

        model = lt.model
        torch.index_select(model.model.embed_tokens.weight, 0, input_ids.reshape(-1), out=self.h)
        features = self.h.new_empty((n, q, len(lt.layer_ids) * hid)) if lt.layer_ids else None
        columns = None if features is None else features.view(m, -1)
        key = cpu_linear.route_key(self.sources)
        if key != self.plan_key:
            plan = ([], [], [], [], [])
            for layer in self.projections:
                for proj in layer:
                    proj.plan(m, plan)
            self.plan_key, self.plan = key, plan
        taps = [columns[:, t * hid:(t + 1) * hid] for t in self.tap_slots]
        status = ops.forward_layers(self.h, self.x, self.delta, self.qkv.view(n, q, -1),
                                    self.attn.view(n, q, self.nh, self.d), self.gu, self.act, taps, self.tap_layers,
                                    lt.k_cache, lt.v_cache, start_t, rows_t, cos, sin, mask, *self.norms, *self.plan)
        if status:
            what = "the attention's scratch" if status == 1 else "a projection's split input rows"
            raise MemoryError(f"native_forward: not enough memory for {what} ({n} x {q} rows)")
        final = model.model.norm
        ops.add_rms_norm(self.delta, self.h, final.weight, self.x, final.variance_epsilon)
        lt.copy_taps(features, lt.taps, len(lt.layers) - 1, self.h.view(n, q, hid))
        x = self.x.view(n, q, hid)
        return lt.head(x[:, -1:] if last_logits_only else x, argmax), features
