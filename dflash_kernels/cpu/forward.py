"""The lean target's forward on the "cpu" backend as one loop of native calls: the CPU's counterpart of a captured
GPU step.

Why: a SmolLM2 forward makes ~240 kernel calls (seven a layer and the LM head), and the Python around them (each
op's argument checks and backend resolution, the output allocations, the ``cpu_linear`` dispatch) cost 11-19 ms of
a 35-57 ms forward on the project's 2-core CPU: the same forward's native calls, recorded once and called back to
back with their recorded arguments, take 20-41 ms (``bench/results/2026-12-02-cpu-smollm2-vocab4096.md``). A
:class:`NativeForward` checks everything once per shape, keeps the activations in buffers of its own, and runs a
forward as the embedding, the RoPE tables, then per layer seven ctypes calls with prepared arguments: the kernels
and arguments of the op path (``LeanTarget``'s layer loop), so the same bits.

Applies where the op path would run exactly these kernels: the "cpu" backend, fp32, the native CPU kernels and
``cpu_linear``'s AMX path available, every projection weight (and the LM head) exactly bf16 (its AMX tiles exist),
head dim a multiple of 16 (at most 512), no sliding window, nothing watching (no ``torch.compile`` tracing,
dispatch mode or autograd: those must see the ops), and at most :data:`MAX_ROWS` rows a request (decode, verify
and tree steps; a long prefill chunk keeps the op path, whose per-call cost is small next to its work).
Elsewhere ``forward`` returns None and ``LeanTarget`` runs its op path. ``DFLASH_NATIVE_FORWARD=0`` (or
:func:`set_enabled`) turns it off (A/B runs, tests).

The weights' AMX tiles are looked up on every forward (``cpu_linear.bf16_tiles``: a dict hit unless a weight was
updated in place, which repacks it), so an in-place update is seen as on the op path.
"""
from __future__ import annotations

import os

import torch

from dflash_kernels.cpu import linear as cpu_linear
from dflash_kernels.cpu import native as cpu_native
from dflash_kernels._dispatch import unobserved_eager
from dflash_kernels.draft_attention import rope_tables_cpu

ENV = "DFLASH_NATIVE_FORWARD"
MAX_ROWS = 64
_on = os.environ.get(ENV, "1") != "0"


def set_enabled(enabled: bool) -> bool:
    """Turn the native forward on or off for this process; returns the previous setting."""
    global _on
    before, _on = _on, bool(enabled)
    return before


def _blocks(weight) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """(weight, bias) of each row block of a projection: a ``cpu_linear.RowBlocks`` or a plain weight."""
    if type(weight) is cpu_linear.RowBlocks:
        biases = weight.biases or (None,) * len(weight.sources)
        return list(zip(weight.sources, biases))
    return [(weight, None)]


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
        # (weight, bias) blocks of each layer's four projections, then the LM head's
        self.projections = [(_blocks(lt.qkv[li][0]), [(p.o_weight, p.o_bias)], _blocks(lt.gate_up[li][0]),
                             [(p.down_weight, p.down_bias)]) for li, p in enumerate(lt.layers)]
        self.head = [(model.lm_head.weight, model.lm_head.bias)]

    @staticmethod
    def supports(lt) -> bool:
        """Whether ``lt``'s layers are what the native forward runs (fixed for a LeanTarget: checked once by it)."""
        d = lt.head_dim  # (a lean target has no sliding window: check_lean_target)
        if lt.backend != "cpu" or d % 16 or d > cpu_native.MAX_HEAD_DIM:
            return False
        if any(type(lt.qkv[li][0]) is not cpu_linear.RowBlocks or type(lt.gate_up[li][0]) is not cpu_linear.RowBlocks
               or lt.qkv[li][1] is not None or lt.gate_up[li][1] is not None for li in range(len(lt.layers))):
            return False
        tensors = [lt.k_cache, lt.v_cache, lt.model.model.embed_tokens.weight, lt.model.model.norm.weight]
        for p in lt.layers:
            tensors += [p.input_norm, p.post_norm] + [t for t in (p.q_norm, p.k_norm) if t is not None]
        return all(t.dtype == torch.float32 and t.is_cpu and t.is_contiguous() for t in tensors)

    @staticmethod
    def available(n: int, q: int) -> bool:
        """Whether it runs now at this shape: turned on, the libraries loaded, at most MAX_ROWS rows."""
        return (_on and 1 <= q <= MAX_ROWS and n >= 1 and cpu_native.library() is not None
                and cpu_linear.amx_library() is not None)

    @staticmethod
    def _kernel_args(blocks) -> tuple | None:
        """``amx_linear``'s (tiles, rows, biases) arguments of a projection's blocks, or None if a block's weight
        is not bf16-exact (no tiles)."""
        tiles = []
        for w, b in blocks:
            t = cpu_linear.bf16_tiles(w)
            if t is None or (b is not None and not (b.dtype == torch.float32 and b.is_contiguous())):
                return None
            tiles.append(t)
        return tiles, [w.shape[0] for w, _ in blocks], [b for _, b in blocks]

    def forward(self, lt, input_ids: torch.Tensor, start: torch.Tensor, rows: torch.Tensor | None,
                tree: tuple[torch.Tensor, torch.Tensor] | None, last_logits_only: bool, argmax: bool = False):
        """``LeanTarget.forward``'s results (fresh logits, or their argmax, and features tensors), or None where it
        does not apply (nothing written then)."""
        n, q = self.n, self.q
        m, hid = n * q, self.hidden
        ops, amx = cpu_native.library(), cpu_linear.amx_library()
        if ops is None or amx is None or not unobserved_eager():
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
        plan = [tuple(self._kernel_args(b) for b in layer) for layer in self.projections]
        head = self._kernel_args(self.head)
        if head is None or any(t is None for layer in plan for t in layer):
            return None
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
        h_view = self.h.view(n, q, hid)  # the residual stream as the taps copy it
        nh, kvh, d = self.nh, self.kvh, self.d
        qkv = self.qkv.view(n, q, -1)
        q_heads = qkv[..., :nh * d].unflatten(-1, (nh, d))
        k_heads = qkv[..., nh * d:(nh + kvh) * d].unflatten(-1, (kvh, d))
        v_heads = qkv[..., (nh + kvh) * d:].unflatten(-1, (kvh, d))
        attn = self.attn.view(n, q, nh, d)

        def project(x, args, y):
            if amx.amx_linear(x, *args, y):
                raise MemoryError(f"native_forward: no memory for the split input rows ({x.shape[0]} x {x.shape[1]})")

        for li, p in enumerate(lt.layers):
            qkv_t, o_t, gu_t, down_t = plan[li]
            ops.add_rms_norm(self.h if li == 0 else self.delta, None if li == 0 else self.h, p.input_norm, self.x,
                             p.input_eps)
            lt.copy_taps(features, lt.taps, li - 1, h_view)
            project(self.x, qkv_t, self.qkv)
            if ops.block_attention(q_heads, k_heads, v_heads, lt.k_cache[li], lt.v_cache[li], start_t, rows_t, None,
                                   p.q_norm, p.k_norm, p.qk_norm_eps, cos, sin, mask, True, True,
                                   d ** -0.5 if p.scale is None else p.scale, attn):
                raise MemoryError(f"native_forward: no memory for the attention's scratch ({n} x {q} rows)")
            project(self.attn, o_t, self.delta)
            ops.add_rms_norm(self.delta, self.h, p.post_norm, self.x, p.post_eps)
            project(self.x, gu_t, self.gu)
            ops.silu_mul(self.gu, self.act)
            project(self.act, down_t, self.delta)
        final = model.model.norm
        ops.add_rms_norm(self.delta, self.h, final.weight, self.x, final.variance_epsilon)
        lt.copy_taps(features, lt.taps, len(lt.layers) - 1, h_view)
        x_rows = self.x.view(n, q, hid)[:, -1] if last_logits_only else self.x
        if argmax:  # the screened argmax (one Python call: its few checks are nothing next to the head's work)
            return lt.head(x_rows, True).view(n, -1), features
        logits = self.h.new_empty((n, 1 if last_logits_only else q, model.lm_head.weight.shape[0]))
        project(x_rows, head, logits)
        return logits, features
