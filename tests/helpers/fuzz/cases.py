"""Fuzz cases, run inside the worker process (``worker.py``): build an op's inputs from a case, call it, judge.

A case is a JSON object: ``op`` (a key of :data:`OPS`), ``path`` (``"public"``: ``dflash_kernels.<op>``;
``"registered"``: ``torch.ops.dflash.<op>``, which runs its backend body without the public checks), ``backend``,
``seed`` (every tensor value comes from it) and the op's knobs (shapes, dtypes, ``layout``, ``mutation``).

The verdict rule, the same for every op:
* The builder classifies its inputs: ``valid`` (the contract in dflash_kernels/README.md accepts them), ``invalid``
  (an index or extent outside the contract: a negative, past-the-end or huge index, a wrong extent, a zero
  budget or block size), ``either`` (outside the documented dtypes or layouts, e.g. int32 where int64 is
  documented, or a non-contiguous view: the op may accept it, then it must compute the reference's result) or
  ``unchecked`` (a value outside a range the README states as the caller's duty and leaves unchecked, e.g.
  target token ids >= 2^31: any result or clean error, only no crash).
* A raised exception passes unless the case is ``valid``, if it is an acceptable type and carries a message:
  ValueError, TypeError or MemoryError from the public functions (the project's rule: a clear error naming the
  argument, raised before any work); from the registered ops also IndexError and RuntimeError (torch's own
  indexing errors inside a reference formula are clean Python errors, not memory errors). torch's failure to
  allocate (a RuntimeError from its CPU allocator; the worker's address space is capped) counts as MemoryError.
* A returned result fails on an ``invalid`` case (an out-of-range index must not be used: the issue's "silently
  overwrite the wrong cache rows"), and otherwise must equal the torch reference run on the same inputs (unless
  the reference itself cannot allocate its work, e.g. a mask over 2^40 positions: then nothing is compared):
  integers exactly, floats within ``helpers/tol.py``'s rule (the reference in fp64 and in the inputs'
  dtype), every output and every tensor the op writes in place. A reference that raises where the op returned
  also fails: the op produced a value for inputs the definition rejects.
* A signal or a hang kills the worker; ``runner`` turns that into a failure naming the case.
"""
from __future__ import annotations

import traceback

import torch

import dflash_kernels as dk
from helpers.tol import assert_within_rule
from dflash_kernels import commit, gated_mlp, layer_ops, tree, verify
from dflash_kernels.candidate_select import candidate_select_reference
from dflash_kernels.conv_prepare import dynamic_conv_prepare_reference
from dflash_kernels.draft_attention import draft_attention_reference, verify_attention_reference
from dflash_kernels.fused_context import fused_context_reference
from dflash_kernels.inject_context_kv import inject_context_kv_reference

FLOATS = {"fp32": torch.float32, "bf16": torch.bfloat16}
INTS = {"i32": torch.int32, "i64": torch.int64}
PUBLIC_ERRORS = (ValueError, TypeError, MemoryError)
REGISTERED_ERRORS = PUBLIC_ERRORS + (IndexError, RuntimeError)
HUGE = 2**40


def out_of_memory(e: BaseException) -> bool:
    """torch's CPU allocator failing (a RuntimeError, not a MemoryError) or a MemoryError."""
    return isinstance(e, MemoryError) or (isinstance(e, RuntimeError) and "can't allocate memory" in str(e))


class Build:
    """Deterministic inputs of one case: a torch.Generator seeded by the case; floats are drawn in fp32,
    rounded to the case's dtype, then held in ``store`` (the dtype itself, or fp64 for the exact reference), so
    the fp64 build sees exactly the low-precision build's values."""

    def __init__(self, case: dict, store: torch.dtype | None):
        self.case = case
        self.gen = torch.Generator().manual_seed(case["seed"])
        self.dtype = FLOATS[case.get("dtype", "fp32")]
        self.store = store or self.dtype
        self.expect = "valid"
        self.inert = True
        self.op_defines_invalid = False  # the registered op has a defined result for the invalid values

    def mark(self, expect: str, inert: bool = False) -> None:
        """Lower the case's class: valid > either > unchecked > invalid. ``inert``: the invalid value reaches no
        element (a batch of 0 requests or rows): the public function must still reject it, a registered op may
        return anything."""
        order = ("valid", "either", "unchecked", "invalid")
        if order.index(expect) > order.index(self.expect):
            self.expect = expect
        if expect == "invalid":
            self.inert = self.inert and inert

    def floats(self, shape, scale: float = 1.0, layout: str = "contiguous", offset: float = 0.0) -> torch.Tensor:
        full = list(shape)
        if len(full) < 2:
            layout = "contiguous"  # one dim: a view of it is strided in its last dim
        if layout == "strided":
            full[0] *= 2  # rows at twice the stride; the last dim stays contiguous
        elif layout == "transposed":
            full[-1], full[-2] = full[-2], full[-1]
        x = (torch.randn(full, generator=self.gen) * scale + offset).to(self.dtype).to(self.store)
        if layout == "strided":
            x = x[::2]
        elif layout == "transposed":
            x = x.transpose(-1, -2)
        return x

    def ints(self, shape, low: int, high: int, dtype=torch.int64) -> torch.Tensor:
        return torch.randint(low, max(high, low + 1), list(shape), generator=self.gen).to(dtype)

    def pick(self, n: int) -> int:
        return int(torch.randint(0, max(n, 1), (), generator=self.gen))

    def index_mutation(self, t: torch.Tensor, bound: int, *, int32_ok: bool) -> torch.Tensor:
        """Apply the case's ``mutation`` to an index tensor whose valid values are ``[0, bound)``."""
        m = self.case.get("mutation", "none")
        if m == "int32":
            self.mark("valid" if int32_ok else "either")
            return t.to(torch.int32)
        if t.numel() == 0 or m not in ("negative", "past_end", "huge"):
            return t
        t = t.clone()
        flat = t.view(-1)
        at = self.pick(flat.numel())
        flat[at] = {"negative": -1 - self.pick(3), "past_end": bound + self.pick(3), "huge": HUGE}[m]
        self.mark("invalid")
        return t


def tree_parents(b: Build, r: int, t: int) -> torch.Tensor:
    """Random valid trees: node 0 the root (parent -1), node i's parent an earlier node."""
    par = torch.empty((r, t), dtype=torch.int64)
    par[:, 0] = -1
    for i in range(1, t):
        par[:, i] = b.ints((r,), 0, i)
    return par


def tree_depths(par: torch.Tensor) -> torch.Tensor:
    dep = torch.zeros_like(par)
    for i in range(1, par.shape[1]):
        dep[:, i] = dep.gather(1, par[:, i:i + 1]).squeeze(1) + 1
    return dep


# --------------------------------------------------------------------------------------------------
# One class per op: inputs from a case, the public and registered calls, the reference; each call returns
# the list of tensors to compare (the outputs, then every tensor written in place).
# --------------------------------------------------------------------------------------------------

class PositionalOp:
    """An op whose public function, registered op and reference take the same inputs ``self.args`` (then the
    backend; the reference none): ``dk.<OP>``, ``torch.ops.dflash.<OP>`` and ``REFERENCE``."""
    OP: str
    REFERENCE: staticmethod
    args: tuple

    def public(self, backend):
        return outputs(getattr(dk, self.OP)(*self.args, backend=backend))

    def registered(self, backend):
        return outputs(getattr(torch.ops.dflash, self.OP)(*self.args, backend))

    def reference(self):
        return outputs(self.REFERENCE(*self.args))


def outputs(result) -> list[torch.Tensor]:
    """An op's result (one tensor or a tuple of them) as the list of tensors to compare."""
    return [result] if isinstance(result, torch.Tensor) else list(result)


class VerifyGreedy(PositionalOp):
    OP = "verify_greedy"
    REFERENCE = staticmethod(verify.verify_greedy_reference)

    def __init__(self, c: dict, b: Build):
        n, bs, v = c["n"], c["b"], c["v"]
        logits = b.floats((n, bs, v), layout=c["layout"])
        if c.get("ties"):
            logits = (logits * 2).round()
        if c["layout"] == "transposed":
            b.mark("either")
        best = logits.argmax(-1)[:, :-1]
        draft = torch.where(torch.rand(best.shape, generator=b.gen) < 0.7, best, b.ints(best.shape, 0, v))
        self.args = (logits, b.index_mutation(draft, v, int32_ok=True))
        if b.case["mutation"] in ("negative", "past_end", "huge"):
            b.expect = "valid"  # a draft token outside the vocabulary is never the argmax: a plain rejection


class VerifyGreedyTokens(PositionalOp):
    OP = "verify_greedy_tokens"
    REFERENCE = staticmethod(verify.verify_greedy_tokens_reference)

    def __init__(self, c: dict, b: Build):
        n, bs, v = c["n"], c["b"], c["v"]
        target = b.ints((n, bs), 0, v)
        draft = torch.where(torch.rand((n, bs - 1), generator=b.gen) < 0.7, target[:, :-1],
                            b.ints((n, bs - 1), 0, v))
        self.args = (b.index_mutation(target, 2**31 - 1, int32_ok=True), draft.to(INTS[c["draft_dtype"]]))
        if b.expect == "invalid":
            b.expect = "unchecked"  # target tokens in [0, 2^31 - 1) are the caller's duty (README), not an index


class AddRmsNorm:
    def __init__(self, c: dict, b: Build):
        shape = (*c["lead"], c["h"])
        self.x = b.floats(shape, layout=c["layout"])
        if c["layout"] == "transposed":
            b.mark("either")
        h = c["h"]
        if c["mutation"] == "past_end":  # a weight one element too long or too short
            h += 1 if h == 1 or b.pick(2) else -1
        if h != c["h"]:
            b.mark("invalid", inert=self.x.numel() == 0)
        self.weight = b.floats((h,), 0.5, offset=1.0)
        self.residual = b.floats(shape) if c["residual"] else None
        self.eps = 1e-6

    def public(self, backend):
        res = None if self.residual is None else self.residual
        out = dk.add_rms_norm(self.x, self.weight, self.eps, residual=res, backend=backend)
        return [out] + ([] if res is None else [res])

    def registered(self, backend):
        out = torch.empty(self.x.shape, dtype=self.x.dtype)
        torch.ops.dflash.add_rms_norm(self.x, self.weight, self.eps, self.residual, out, None, None, backend)
        return [out] + ([] if self.residual is None else [self.residual])

    def reference(self):
        out = layer_ops.add_rms_norm_reference(self.x, self.weight, self.eps, residual=self.residual)
        return [out] + ([] if self.residual is None else [self.residual])


class SiluMul(PositionalOp):
    OP = "silu_mul"
    REFERENCE = staticmethod(layer_ops.silu_mul_reference)

    def __init__(self, c: dict, b: Build):
        cols = 2 * c["i"] + (1 if c["mutation"] == "past_end" else 0)
        gate_up = b.floats((*c["lead"], cols), 2.0, layout=c["layout"])
        self.args = (gate_up,)
        if cols % 2:
            b.mark("invalid", inert=gate_up.numel() == 0)
        if c["layout"] == "transposed":
            b.mark("either")


class BuildTree:
    def __init__(self, c: dict, b: Build):
        r, p, v = c["r"], c["p"], c["v"]
        logits = b.floats((r, p, v), 3.0, layout=c["layout"])
        if c.get("ties"):
            logits = logits.round()
        self.logits = logits
        self.anchor = b.ints((r,), 0, 1000)
        self.budget = c["budget"]
        if self.budget < 1 or tree.distinct_prefixes(p, v, self.budget) < self.budget:
            b.mark("invalid", inert=r == 0)
        ids = None
        m = c["mutation"]
        if c["vocab_ids"]:
            ids = torch.randperm(4 * v, generator=b.gen)[:v]
            if m == "past_end":
                ids = ids[: max(v - 1 - b.pick(v), 0)]  # shorter than the draft vocabulary
                b.mark("invalid", inert=r == 0)
            elif m == "int32":
                ids = ids.to(torch.int32)
                b.mark("either")
        elif m == "int32":
            self.anchor = self.anchor.to(torch.int32)
            b.mark("either")
        self.vocab_ids = ids

    def public(self, backend):
        return list(dk.build_tree(self.logits, self.anchor, self.budget, vocab_ids=self.vocab_ids, backend=backend))

    def registered(self, backend):
        return list(torch.ops.dflash.build_tree(self.logits, self.anchor, self.budget, self.vocab_ids, backend))

    def reference(self):
        return list(tree.build_tree_reference(self.logits, self.anchor, self.budget, vocab_ids=self.vocab_ids))


class TreeAncestorMask(PositionalOp):
    OP = "tree_ancestor_mask"
    REFERENCE = staticmethod(tree.tree_ancestor_mask_reference)

    def __init__(self, c: dict, b: Build):
        r, t = c["r"], c["t"]
        par = tree_parents(b, r, t)
        m = c["mutation"]
        if m in ("negative", "past_end", "huge") and r:
            req, node = b.pick(r), b.pick(t)
            # not an earlier node: below -1, the node itself or later (the root: anything but -1), or huge
            par[req, node] = {"negative": -2 - b.pick(3), "past_end": node + b.pick(t + 2), "huge": HUGE}[m]
            b.mark("invalid")
        elif m == "int32":
            par = par.to(torch.int32)
            b.mark("either")
        if c["layout"] == "strided":
            par = torch.stack([par, par], 1)[:, 0]  # row stride 2T, last dim contiguous
        self.args = (par,)


class TreeGraftLookup:
    """Trees from :func:`tree_parents` over a few token values, rows of committed tokens over as few (so suffixes
    recur), every depth and suffix range; bad index values are the lengths (CPU refuses them, kernels clamp)."""

    def __init__(self, c: dict, b: Build):
        r, t, cap, v = c["r"], c["t"], c["cap"], c["v"]
        self.par = tree_parents(b, r, t)
        self.dep = tree_depths(self.par)
        self.tok = b.ints((r, t), 0, v)
        tokens = b.ints((r, cap), 0, v)
        if c["layout"] == "strided":
            tokens = torch.stack([tokens, tokens], 1)[:, 0]  # row stride 2C, last dim contiguous
        self.tokens = tokens
        self.lengths = b.ints((r,), 0, cap + 1)
        self.kw = dict(depth=c["depth"], max_ngram=c["max_ngram"], min_ngram=c["min_ngram"])
        if c["min_ngram"] > c["max_ngram"]:
            b.mark("invalid", inert=r == 0)
        m = c["mutation"]
        if m == "int32":
            self.tokens = self.tokens.to(torch.int32)
            b.mark("invalid", inert=r == 0)
        elif m in ("negative", "past_end", "huge") and r:
            self.lengths[b.pick(r)] = {"negative": -1 - b.pick(3), "past_end": cap + 1 + b.pick(3), "huge": HUGE}[m]
            b.mark("invalid")

    def args(self):
        return self.tok, self.par, self.dep, self.tokens, self.lengths

    def public(self, backend):
        return list(dk.tree_graft_lookup(*self.args(), **self.kw, backend=backend))

    def registered(self, backend):
        kw = self.kw
        return list(torch.ops.dflash.tree_graft_lookup(*self.args(), kw["depth"], kw["max_ngram"], kw["min_ngram"],
                                                       backend))

    def reference(self):
        return list(tree.tree_graft_lookup_reference(*self.args(), **self.kw))


class TreeAcceptGreedyTokens:
    """Also ``tree_accept_greedy`` (``logits=True``: the target's argmax comes from logits)."""

    def __init__(self, c: dict, b: Build):
        r, t, v = c["r"], c["t"], c["v"]
        self.par = tree_parents(b, r, t)
        self.tokens = b.ints((r, t), 0, v)
        # the target's choice at each node: often one of its children's tokens, so walks go deep
        child = torch.full((r, t), -1, dtype=torch.int64)
        for i in range(t - 1, 0, -1):
            child.scatter_(1, self.par[:, i:i + 1], torch.full((r, 1), i))
        kid_tok = self.tokens.gather(1, child.clamp_min(0))
        target = torch.where((child >= 0) & (torch.rand((r, t), generator=b.gen) < 0.8), kid_tok,
                             b.ints((r, t), 0, v))
        self.block_size = c["block_size"]
        if self.block_size < 1:
            b.mark("invalid", inert=r == 0)
        m = c["mutation"]
        if m in ("negative", "past_end", "huge") and r and t > 1:
            # the walk only compares parents with the current node: a parent outside the tree is a child of no node
            req, node = b.pick(r), 1 + b.pick(t - 1)
            self.par[req, node] = {"negative": -2, "past_end": t + b.pick(3), "huge": HUGE}[m]
            b.mark("either")
        elif m == "int32":
            self.tokens = self.tokens.to(torch.int32)
            b.mark("either")
        self.logits = None
        if c.get("logits"):
            self.logits = b.floats((r, t, v))
            self.logits.scatter_(2, target[..., None], 10.0)
        else:
            self.target = target.to(INTS[c["target_dtype"]])

    def public(self, backend):
        if self.logits is not None:
            return list(dk.tree_accept_greedy(self.logits, self.tokens, self.par, block_size=self.block_size,
                                              backend=backend))
        return list(dk.tree_accept_greedy_tokens(self.target, self.tokens, self.par, block_size=self.block_size,
                                                 backend=backend))

    def registered(self, backend):
        if self.logits is not None:
            return list(torch.ops.dflash.tree_accept_greedy(self.logits, self.tokens, self.par, self.block_size,
                                                            backend))
        return list(torch.ops.dflash.tree_accept_greedy_tokens(self.target, self.tokens, self.par, self.block_size,
                                                               backend))

    def reference(self):
        if self.logits is not None:
            return list(tree.tree_accept_greedy_reference(self.logits, self.tokens, self.par,
                                                          block_size=self.block_size))
        return list(tree.tree_accept_greedy_tokens_reference(self.target, self.tokens, self.par,
                                                             block_size=self.block_size))


class TreeCompact:
    def __init__(self, c: dict, b: Build):
        layers, r, t, kvh, d = c["layers"], c["r"], c["t"], c["kvh"], c["d"]
        bsz = c["bsz"]
        nb = r + c["spare_rows"]
        cap = c["cap"]
        self.k = b.floats((layers, nb, cap, kvh, d))
        self.v = b.floats((layers, nb, cap, kvh, d))
        path = torch.full((r, bsz), -1, dtype=torch.int64)
        accepted = torch.zeros(r, dtype=torch.int64)
        for req in range(r):  # a walk's path: 0, then rising node indices below T
            nodes = sorted(torch.randperm(t - 1, generator=b.gen)[: b.pick(bsz)].add(1).tolist()) if t > 1 else []
            nodes = [x for x, dd in zip(nodes, range(1, bsz)) if x >= dd]
            path[req, : len(nodes) + 1] = torch.tensor([0] + nodes)
            accepted[req] = len(nodes)
        self.path = path
        start = b.ints((r,), 0, max(cap - t + 2, 1))  # sometimes the tree's last nodes lie past the capacity
        rows = torch.randperm(nb, generator=b.gen)[:r]
        m, target = c["mutation"], c.get("target", "start")
        if target == "start":
            start = b.index_mutation(start, cap, int32_ok=False)
            if m in ("past_end", "huge"):
                b.expect = "valid"  # a start at or past the capacity: every source is past it, nothing moves
        elif target == "accepted":
            accepted = b.index_mutation(accepted, bsz, int32_ok=False)
        else:
            rows = b.index_mutation(rows, nb, int32_ok=True)
        self.accepted, self.start = accepted, start
        self.rows = rows if c["batch_idx"] or target == "batch_idx" else None

    def _writes(self):
        return [self.k, self.v]

    def public(self, backend):
        dk.tree_compact(self.k, self.v, self.path, self.accepted, self.start, cache_batch_idx=self.rows,
                        backend=backend)
        return self._writes()

    def registered(self, backend):
        torch.ops.dflash.tree_compact(self.k, self.v, self.path, self.accepted, self.start, self.rows, backend)
        return self._writes()

    def reference(self):
        tree.tree_compact_reference(self.k, self.v, self.path, self.accepted, self.start, cache_batch_idx=self.rows)
        return self._writes()


class Attention:
    """``verify_attention`` (``op == "verify_attention"``, chain or tree) and ``draft_attention``."""

    def __init__(self, c: dict, b: Build):
        n, bs, kvh, g, d, cap = c["n"], c["b"], c["kvh"], c["g"], c["d"], c["cap"]
        self.verify = c["op"] == "verify_attention"
        nb = n + c["spare_rows"]
        self.q = b.floats((n, bs, kvh * g, d), layout=c["layout"])
        if c["layout"] == "transposed":
            b.mark("either")
        self.k = b.floats((n, bs, kvh, d))
        self.v = b.floats((n, bs, kvh, d))
        self.k_cache = b.floats((nb, cap, kvh, d))
        self.v_cache = b.floats((nb, cap, kvh, d))
        room = cap - bs if self.verify else cap
        lens = b.ints((n,), 0, max(room, 0) + 1)
        if c.get("overflow") and n:  # rows past the capacity: the verify drops them, the context clips
            lens[b.pick(n)] = max(cap - b.pick(bs), 0)
        rows = torch.randperm(nb, generator=b.gen)[:n]
        target = c.get("target", "cache_lens")
        if target == "cache_lens":
            lens = b.index_mutation(lens, cap + 1, int32_ok=True)
            if c["mutation"] in ("past_end", "huge"):
                b.expect = "either"  # lengths past the capacity are clipped (the README's live rows)
        else:
            rows = b.index_mutation(rows, nb, int32_ok=True)
        self.cache_lens = lens
        self.rows = rows if c["batch_idx"] or target == "batch_idx" else None
        self.qw = self.kw = None
        if c["qk_norm"]:
            self.qw, self.kw = b.floats((d,), 0.3, offset=1.0), b.floats((d,), 0.3, offset=1.0)
        self.inv_freq = 1.0 / 10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
        self.depths = self.mask = None
        if self.verify and c.get("tree"):
            par = tree_parents(b, n, bs)
            self.depths = tree_depths(par)
            self.mask = tree.tree_ancestor_mask_reference(par) if n else torch.zeros((0, bs, 1), dtype=torch.int64)
        self.block_lens = None
        if not self.verify and c.get("block_lens"):
            self.block_lens = b.ints((n,), 1, bs + 1)
        self.window = c.get("window") if not self.verify else None

    def _writes(self):
        return [self.k_cache, self.v_cache] if self.verify else []

    def public(self, backend):
        kw = dict(inv_freq=self.inv_freq, cache_batch_idx=self.rows, backend=backend)
        if self.verify:
            out = dk.verify_attention(self.q, self.k, self.v, self.k_cache, self.v_cache, self.cache_lens, self.qw,
                                      self.kw, tree_depths=self.depths, tree_mask=self.mask, **kw)
        else:
            out = dk.draft_attention(self.q, self.k, self.v, self.k_cache, self.v_cache, self.cache_lens, self.qw,
                                     self.kw, block_lens=self.block_lens, sliding_window=self.window, **kw)
        return [out] + self._writes()

    def registered(self, backend):
        a = (self.q, self.k, self.v, self.k_cache, self.v_cache, self.cache_lens, self.qw, self.kw, self.inv_freq,
             1.0, 1e-6)
        if self.verify:
            out = torch.ops.dflash.verify_attention(*a, None, None, self.rows, None, None, self.depths, self.mask,
                                                    backend)
        else:
            out = torch.ops.dflash.draft_attention(*a, self.window, None, None, self.rows, self.block_lens, None, None,
                                                   backend)
        return [out] + self._writes()

    def reference(self):
        kw = dict(inv_freq=self.inv_freq, cache_batch_idx=self.rows)
        if self.verify:
            out = verify_attention_reference(
                self.q, self.k, self.v, self.k_cache, self.v_cache, self.cache_lens, self.qw, self.kw,
                tree_depths=self.depths, tree_mask=self.mask, **kw)
        else:
            out = draft_attention_reference(
                self.q, self.k, self.v, self.k_cache, self.v_cache, self.cache_lens, self.qw, self.kw,
                block_lens=self.block_lens, sliding_window=self.window, **kw)
        return [out] + self._writes()

    def valid_rows(self, outs):
        """Output rows past ``block_lens`` are unspecified (README): compare the rows below it only."""
        if self.block_lens is None or not outs:
            return outs
        keep = torch.arange(self.q.shape[1])[None, :] < self.block_lens.to(torch.int64)[:, None]
        return [outs[0][keep]] + outs[1:]


class InjectContextKV:
    def __init__(self, c: dict, b: Build):
        n, kvh, d, cap = c["n"], c["kvh"], c["d"], c["cap"]
        counts = [b.pick(c["max_rows"] + 1) for _ in range(n)]
        cu = torch.tensor([0] + counts).cumsum(0)
        m = int(cu[-1]) + c["extra_rows"]
        nb = n + c["spare_rows"]
        self.k = b.floats((m, kvh, d), layout=c["layout"])
        self.v = b.floats((m, kvh, d), layout=c["layout"])
        self.kw = b.floats((d,), 0.3, offset=1.0)
        self.k_cache = b.floats((nb, cap, kvh, d))
        self.v_cache = b.floats((nb, cap, kvh, d))
        lens = b.ints((n,), 0, cap + 1)  # rows past the capacity are dropped (README)
        rows = torch.randperm(nb, generator=b.gen)[:n]
        target = c["target"]
        if target == "cache_lens":
            lens = b.index_mutation(lens, cap + 1, int32_ok=True)
            if c["mutation"] in ("past_end", "huge"):
                b.expect = "valid"  # every row past the capacity is dropped
        elif target == "batch_idx":
            rows = b.index_mutation(rows, nb, int32_ok=True)
        else:
            cu = b.index_mutation(cu, m + 1, int32_ok=True)
        self.cu, self.cache_lens = cu, lens
        self.rows = rows if c["batch_idx"] or target == "batch_idx" else None
        self.inv_freq = 1.0 / 10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)

    def _writes(self):
        return [self.k_cache, self.v_cache]

    def public(self, backend):
        dk.inject_context_kv(self.k, self.v, self.kw, self.cu, self.cache_lens, self.k_cache, self.v_cache,
                             inv_freq=self.inv_freq, cache_batch_idx=self.rows, backend=backend)
        return self._writes()

    def registered(self, backend):
        torch.ops.dflash.inject_context_kv(self.k, self.v, self.kw, self.cu, self.cache_lens, self.k_cache,
                                           self.v_cache, self.inv_freq, 1.0, 1e-6, None, self.rows, None, backend)
        return self._writes()

    def reference(self):
        inject_context_kv_reference(self.k, self.v, self.kw, self.cu, self.cache_lens, self.k_cache, self.v_cache,
                                    inv_freq=self.inv_freq, cache_batch_idx=self.rows)
        return self._writes()


class CommitRound:
    def __init__(self, c: dict, b: Build):
        r, bs, cap = c["r"], c["b"], c["cap"]
        self.draft = b.ints((r, bs - 1), 0, 50)
        self.accepted = b.ints((r,), 0, bs)
        self.bonus = b.ints((r,), 0, 50)
        self.out = b.ints((r, cap), 0, 50)
        self.lengths = b.ints((r,), 0, cap + 1)
        self.positions = b.ints((r,), 0, 100)
        self.anchor = b.ints((r,), 0, 50)
        self.done = torch.rand(r, generator=b.gen) < 0.25
        self.max_lengths = torch.minimum(self.lengths + b.ints((r,), -1, 6), torch.tensor(cap))
        self.stops = None
        if c["stops"] == "shared":
            self.stops = b.ints((b.pick(4),), -1, 50)
        elif c["stops"] == "per_request":
            self.stops = b.ints((r, b.pick(4)), -1, 50)
        m, target = c["mutation"], c["target"]
        if m in ("negative", "past_end", "huge") and r:
            at = b.pick(r)
            t = {"accepted": self.accepted, "lengths": self.lengths, "max_lengths": self.max_lengths}[target]
            bound = {"accepted": bs, "lengths": cap + 1, "max_lengths": cap + 1}[target]
            t[at] = {"negative": -1 - b.pick(3), "past_end": bound + b.pick(3), "huge": HUGE}[m]
            if not self.done[at] and not (target == "max_lengths" and m == "negative"):
                # the public function checks values (CPU) and raises; the op finishes such a request untouched
                b.mark("invalid")
                b.op_defines_invalid = True
        elif m == "int32":
            setattr(self, target, getattr(self, target).to(torch.int32))
            b.mark("either")

    def _state(self):
        return [self.out, self.lengths, self.positions, self.anchor, self.done]

    def public(self, backend):
        n = dk.commit_round(self.draft, self.accepted, self.bonus, out_tokens=self.out, lengths=self.lengths,
                            positions=self.positions, anchor=self.anchor, done=self.done,
                            max_lengths=self.max_lengths, stop_tokens=self.stops, backend=backend)
        return [n] + self._state()

    def registered(self, backend):
        n = torch.ops.dflash.commit_round(self.draft, self.accepted, self.bonus, self.out, self.lengths,
                                          self.positions, self.anchor, self.done, self.max_lengths, self.stops,
                                          backend)
        return [n] + self._state()

    def reference(self):
        n = commit.commit_round_reference(self.draft, self.accepted, self.bonus, self.out, self.lengths,
                                          self.positions, self.anchor, self.done, self.max_lengths, self.stops)
        return [n] + self._state()


class DraftRoundSetup:
    def __init__(self, c: dict, b: Build):
        n, bs = c["n"], c["b"]
        self.anchor, self.positions = b.ints((n,), 0, 50), b.ints((n,), 0, 100)
        self.num_new, self.max_lengths = b.ints((n,), 0, bs + 1), b.ints((n,), 0, 120)
        block = b.ints((n, bs), 0, 50)
        self.block = block.t().contiguous().t() if c["layout"] == "transposed" else block  # any strides (README)
        self.context_start = torch.zeros(n, dtype=torch.int64)
        self.block_lens = torch.zeros(n, dtype=torch.int64)
        if c["mutation"] == "int32":
            self.positions = self.positions.to(torch.int32)
            b.mark("either")

    def _writes(self):
        return [self.block, self.context_start, self.block_lens]

    def public(self, backend):
        dk.draft_round_setup(self.anchor, self.positions, self.num_new, self.max_lengths, block=self.block,
                             context_start=self.context_start, block_lens=self.block_lens, backend=backend)
        return self._writes()

    def registered(self, backend):
        torch.ops.dflash.draft_round_setup(self.anchor, self.positions, self.num_new, self.max_lengths, self.block,
                                           self.context_start, self.block_lens, backend)
        return self._writes()

    def reference(self):
        commit.draft_round_setup_reference(self.anchor, self.positions, self.num_new, self.max_lengths, self.block,
                                           self.context_start, self.block_lens)
        return self._writes()


class GateUpSilu:
    def __init__(self, c: dict, b: Build):
        k, i = c["k"], c["i"]
        self.x = b.floats((*c["lead"], k), layout=c["layout"])
        if c["layout"] == "transposed":
            b.mark("either")
        rows, cols = 2 * i, k
        if c["mutation"] == "past_end":
            rows, cols = (rows + 1, cols) if b.pick(2) else (rows, cols + 1)
            b.mark("invalid", inert=self.x.numel() == 0 and cols == k)
        self.weight = b.floats((rows, cols), 0.3)

    def public(self, backend):
        return [dk.gate_up_silu(self.x, self.weight, backend=backend)]

    def registered(self, backend):
        out = torch.empty((*self.x.shape[:-1], self.weight.shape[0] // 2), dtype=self.x.dtype)
        torch.ops.dflash.gate_up_silu(self.x, self.weight, out, None, None, backend)
        return [out]

    def reference(self):
        return [gated_mlp.gate_up_silu_reference(self.x, self.weight)]


class GateUpSiluConv:
    """``gate_up_silu`` with DFlash2's prepare convolution in its x-tile load (``conv_dynamic`` / ``conv_base``, x
    ``[N, B, K]``) into a NaN prefilled ``out``. ``bad_extent``: the dynamic kernels one tap longer than base, a
    base of no taps, or ``out`` sharing x's memory."""

    def __init__(self, c: dict, b: Build):
        n, bs, taps, groups, g, i = c["n"], c["b"], c["taps"], c["groups"], c["g"], c["i"]
        k = groups * g
        self.x = b.floats((n, bs, k), layout=c["layout"])
        self.weight = b.floats((2 * i, k), 1.0 / k ** 0.5)
        self.base = b.floats((taps, k))
        dynamic_taps = taps
        self.out = torch.full((n, bs, i), float("nan"), dtype=self.x.dtype)
        if c["mutation"] == "past_end":
            bad = ("taps", "base", "overlap")[b.pick(3)]
            if bad == "taps":
                dynamic_taps += 1
            elif bad == "base":
                self.base = self.base[:0]
            elif self.x.is_contiguous() and 0 < self.out.numel() <= self.x.numel() and i <= k:
                self.out = self.x.view(-1)[:self.out.numel()].view(self.out.shape)
            else:
                bad = None
            if bad is not None:
                b.mark("invalid")
        # one side of a [N, B, 2, K, H/G] projection output, as the engine passes it
        self.dynamic = b.floats((n, bs, 2, dynamic_taps, groups), 0.5)[:, :, 0]

    def public(self, backend):
        return [dk.gate_up_silu(self.x, self.weight, out=self.out, conv_dynamic=self.dynamic, conv_base=self.base,
                                backend=backend)]

    def registered(self, backend):
        torch.ops.dflash.gate_up_silu(self.x, self.weight, self.out, self.dynamic, self.base, backend)
        return [self.out]

    def reference(self):
        return [gated_mlp.gate_up_silu_reference(self.x, self.weight, self.dynamic, self.base)]


class FusedContext:
    def __init__(self, c: dict, b: Build):
        n, h, t = c["n"], c["h"], c["taps"]
        stacked = b.floats((t, n, h))
        concat = stacked.permute(1, 0, 2).reshape(n, t * h)
        self.tap_list = [concat[:, i * h:(i + 1) * h] for i in range(t)]  # the registered op takes a list
        self.taps = {"list": self.tap_list, "stacked": stacked, "concat": concat}[c["form"]]
        cols = t * h + (1 if c["mutation"] == "past_end" else 0)
        if cols != t * h:
            b.mark("invalid", inert=n == 0)
        self.fc = b.floats((h, cols), 0.2)
        self.norm = b.floats((h,), 0.3, offset=1.0)

    def public(self, backend):
        return [dk.fused_context(self.taps, self.fc, self.norm, 1e-6, backend=backend)]

    def registered(self, backend):
        out = torch.empty(self.tap_list[0].shape, dtype=self.tap_list[0].dtype)
        torch.ops.dflash.fused_context(self.tap_list, self.fc, self.norm, 1e-6, out, backend)
        return [out]

    def reference(self):
        return [fused_context_reference(self.taps, self.fc, self.norm, 1e-6)]


class Sampling:
    """``verify_sample`` and ``tree_accept_sample``: the backends draw from different random streams, so a result
    is checked for its form only (accepted counts, token ids and paths in range) and never compared."""

    exact = False

    def __init__(self, c: dict, b: Build):
        r, t, v = c["r"], c["t"], c["v"]
        self.tree = c["op"] == "tree_accept_sample"
        self.logits = b.floats((r, t, v), 2.0)
        self.v, self.t = v, t
        if self.tree:
            self.par = tree_parents(b, r, t)
            self.tokens = b.ints((r, t), 0, v)
            self.block_size = c["block_size"]
            if self.block_size < 1:
                b.mark("invalid", inert=r == 0)
        else:
            self.draft = b.index_mutation(b.ints((r, t - 1), 0, v), v, int32_ok=True)
            if c["mutation"] in ("negative", "past_end", "huge"):
                b.expect = "valid"  # a draft token outside the vocabulary is never drawn: a plain rejection
        self.kw = dict(temperature=c["temperature"], top_k=c["top_k"], top_p=c["top_p"], seed=c["seed"], offset=3)

    def public(self, backend):
        if self.tree:
            return list(dk.tree_accept_sample(self.logits, self.tokens, self.par, block_size=self.block_size,
                                              backend=backend, **self.kw))
        return list(dk.verify_sample(self.logits, self.draft, backend=backend, **self.kw))

    def registered(self, backend):
        op = "tree_accept_sample" if self.tree else "verify_sample"
        packed = verify.sampling_op_args(op, self.logits, *(self.kw[k] for k in ("temperature", "top_k", "top_p",
                                                                                 "seed", "offset")))
        if self.tree:
            return list(torch.ops.dflash.tree_accept_sample(self.logits, self.tokens, self.par, self.block_size,
                                                            *packed, backend))
        return list(torch.ops.dflash.verify_sample(self.logits, self.draft, *packed, None, None, backend))

    def reference(self):
        return []

    def check_form(self, got: list) -> str | None:
        r = self.logits.shape[0]
        if self.tree:
            path, accepted, bonus = got
            if path.shape != (r, self.block_size) or accepted.shape != (r,) or bonus.shape != (r,):
                return f"shapes {tuple(path.shape)}, {tuple(accepted.shape)}, {tuple(bonus.shape)}"
            if ((accepted < 0) | (accepted > min(self.block_size, self.t) - 1)).any():
                return f"accepted out of range: {accepted.tolist()}"
        else:
            accepted, bonus = got
            if ((accepted < 0) | (accepted > self.t - 1)).any():
                return f"accepted out of range: {accepted.tolist()}"
        if ((bonus < 0) | (bonus >= self.v)).any():
            return f"token ids outside [0, {self.v}): {bonus.tolist()}"
        return None


class DynamicConvPrepare:
    """``dynamic_conv_prepare`` (DFlash2's prepare: the kernel projection, then side 0's convolution) into NaN
    prefilled ``out`` / ``dynamic``. ``bad_extent``: a projection one row short (not 2*K*H/G rows), a base of no taps,
    or ``dynamic`` sharing ``out``'s memory."""

    def __init__(self, c: dict, b: Build):
        n, bs, taps, groups, g = c["n"], c["b"], c["taps"], c["groups"], c["g"]
        h = groups * g
        self.x = b.floats((n, bs, h), layout=c["layout"])
        rows = 2 * taps * groups
        self.base = b.floats((taps, h))
        self.out = torch.full((n, bs, h), float("nan"), dtype=self.x.dtype)
        self.dynamic = torch.full((n, bs, 2, taps, groups), float("nan"), dtype=self.x.dtype)
        if c["mutation"] == "past_end":
            bad = ("projection", "base", "overlap")[b.pick(3)]
            if bad == "projection":
                rows -= 1
            elif bad == "base":
                self.base = self.base[:0]
            elif self.dynamic.numel() and self.dynamic.numel() <= self.out.numel():
                self.dynamic = self.out.view(-1)[:self.dynamic.numel()].view(self.dynamic.shape)
            else:
                bad = None
            if bad is not None:
                b.mark("invalid")
        self.projection = b.floats((rows, h), 1.0 / h ** 0.5)

    def _results(self):
        return [self.out, self.dynamic]

    def public(self, backend):
        return list(dk.dynamic_conv_prepare(self.x, self.projection, self.base, out=self.out, dynamic=self.dynamic,
                                            backend=backend))

    def registered(self, backend):
        torch.ops.dflash.dynamic_conv_prepare(self.x, self.projection, self.base, self.out, self.dynamic, backend)
        return self._results()

    def reference(self):
        return list(dynamic_conv_prepare_reference(self.x, self.projection, self.base))


class SparseSample(Sampling):
    """``verify_sample`` with a sparse draft distribution (DFlash2's selector): ``draft_probs`` / ``draft_indices``
    ``[R, T-1, K]``, each row's draft token one of its ids. The torch backend runs the reference with the same
    generator (compared exactly); Triton draws another stream (form only). Mutations: an id outside the vocabulary
    (``bad_index``), or a distribution of the wrong form (``bad_form``: probabilities without ids, 16-bit
    probabilities, float ids, ids of another shape, K above 64): all must raise before any work."""

    def __init__(self, c: dict, b: Build):
        r, t, v, k = c["r"], c["t"], c["v"], c["k"]
        self.tree = False
        self.exact = c["backend"] == "torch"
        self.logits = b.floats((r, t, v), 2.0)
        self.v, self.t = v, t
        ids = b.ints((r, t - 1, k), 0, v)
        probs = torch.softmax(torch.randn((r, t - 1, k), generator=b.gen) * 2, dim=-1)
        picks = b.ints((r, t - 1, 1), 0, k)
        self.draft = ids.gather(-1, picks)[..., 0].to(INTS[c["draft_dtype"]])
        self.ids = b.index_mutation(ids, v, int32_ok=True)
        self.probs = probs.to(torch.float64) if c["probs_fp64"] else probs
        if k > verify.MAX_DRAFT_CANDIDATES:
            b.mark("invalid")
        m = c["mutation"]
        if m == "probs_only":
            self.ids = None
        elif m == "probs_dtype":
            self.probs = self.probs.to(torch.bfloat16)
        elif m == "indices_dtype":
            self.ids = self.ids.to(torch.float32)
        elif m == "shape":
            self.ids = torch.cat([self.ids, self.ids[..., :1]], dim=-1)
        if m in ("probs_only", "probs_dtype", "indices_dtype", "shape"):
            b.mark("invalid")
        self.kw = dict(temperature=c["temperature"], top_k=c["top_k"], top_p=c["top_p"], seed=c["seed"], offset=3)

    def public(self, backend):
        return list(dk.verify_sample(self.logits, self.draft, draft_probs=self.probs, draft_indices=self.ids,
                                     backend=backend, **self.kw))

    def registered(self, backend):
        packed = verify.sampling_op_args("verify_sample", self.logits, *(self.kw[k] for k in (
            "temperature", "top_k", "top_p", "seed", "offset")))
        return list(torch.ops.dflash.verify_sample(self.logits, self.draft, *packed, self.probs, self.ids, backend))

    def reference(self):
        return list(verify.verify_sample_reference(self.logits, self.draft, draft_probs=self.probs,
                                                   draft_indices=self.ids, **self.kw))


class CandidateSelect:
    """``candidate_select``, greedy or sampled (per-request temperatures, some <= 0: those rows take the argmax),
    into -1 / NaN prefilled result buffers that a rejected call must leave untouched. Greedy results and every
    reference-backed backend (torch, cpu) are compared exactly; sampled Triton draws another stream, so its
    candidates are compared exactly (they do not depend on the draws) and its path and q for their form.
    Mutations: the anchor outside the vocabulary (``bad_index``), top_k above min(V, 64) (drawn), or an argument
    of the wrong form (``bad_form``: projections of another rank, codebooks of another vocabulary, a float anchor,
    a temperature of neither [1] nor [N], a result buffer of the wrong shape or sharing memory with another)."""

    def __init__(self, c: dict, b: Build):
        n, p, v, r, k = c["n"], c["p"], c["v"], c["r"], c["top_k"]
        self.logits = b.floats((n, p, v), 3.0, layout=c["layout"])
        if c["ties"]:
            self.logits = self.logits.round()  # equal logits: the candidate order's tie rule decides
        m = c["mutation"]
        self.projected = b.floats((n, p, r + (m == "rank")))
        self.predecessor = b.floats((v, r), 0.5)
        self.successor = b.floats((v + (m == "vocab"), r), 0.5)
        self.anchor = b.index_mutation(b.ints((n,), 0, v), v, int32_ok=True)
        if m == "anchor_dtype":
            self.anchor = self.anchor.float()
        self.top_k = k
        if not 1 <= k <= min(v, 64):
            b.mark("invalid")
        self.temperature = None
        if c["sampled"]:
            temps = torch.rand(n, generator=b.gen, dtype=torch.float64) * 2 - 0.3  # some <= 0: argmax rows
            self.temperature = temps if c["per_request"] else temps[:1].clone() if n else torch.ones(1)
        if m == "temp_shape":
            self.temperature = torch.ones(n + 2)
        self.seed, self.offset = c["seed"], 3
        kk = max(k, 0)
        self.out = [torch.full((n, p), -1, dtype=torch.int64), torch.full((n, p, kk), -1, dtype=torch.int64),
                    torch.full((n, p, kk), float("nan"))]
        if m == "out_shape":
            self.out[1] = torch.full((n, p, kk + 1), -1, dtype=torch.int64)
        elif m == "out_overlap":
            self.out[0] = self.out[1].view(-1)[:n * p].view(n, p) if kk else self.out[0]
        if m in ("rank", "vocab", "anchor_dtype", "temp_shape", "out_shape"):
            b.mark("invalid")
        elif m == "out_overlap" and n * p * kk:  # (empty buffers share no memory: nothing to reject)
            b.mark("invalid")
        self.prefill = [t.clone() for t in self.out]
        self.exact = not c["sampled"] or c["backend"] != "triton"

    def public(self, backend):
        return list(dk.candidate_select(self.logits, self.projected, self.predecessor, self.successor, self.anchor,
                                        top_k=self.top_k, temperature=self.temperature, seed=self.seed,
                                        offset=self.offset, out=tuple(self.out), backend=backend))

    def registered(self, backend):
        torch.ops.dflash.candidate_select(self.logits, self.projected, self.predecessor, self.successor, self.anchor,
                                          self.top_k, self.temperature, torch.tensor([self.seed]),
                                          torch.tensor([self.offset]), *self.out, backend)
        return list(self.out)

    def reference(self):
        return list(candidate_select_reference(
            self.logits, self.projected, self.predecessor, self.successor, self.anchor, self.top_k, self.temperature,
            self.seed, self.offset))

    def untouched(self) -> str | None:
        """After a raise: a result buffer written is work done before the check."""
        if all(torch.equal(a, b) or (a.isnan().all() and b.isnan().all()) for a, b in zip(self.out, self.prefill)):
            return None
        return "raised after writing a result buffer"

    def check_form(self, got: list) -> str | None:
        path, candidates, q = got
        expected = self.reference()[1]
        if not torch.equal(candidates, expected):
            return "candidates differ from the reference's (they do not depend on the draws)"
        if path.numel() and not (candidates == path[..., None]).any(-1).all():
            return "a path token is not one of its position's candidates"
        if q.numel() and not torch.allclose(q.sum(-1).double(), torch.ones(q.shape[:-1], dtype=torch.float64),
                                            atol=1e-5):
            return f"q rows do not sum to 1: {q.sum(-1).tolist()}"
        return None


OPS = {
    "verify_greedy": VerifyGreedy,
    "verify_greedy_tokens": VerifyGreedyTokens,
    "add_rms_norm": AddRmsNorm,
    "silu_mul": SiluMul,
    "build_tree": BuildTree,
    "tree_ancestor_mask": TreeAncestorMask,
    "tree_accept_greedy_tokens": TreeAcceptGreedyTokens,
    "tree_accept_greedy": TreeAcceptGreedyTokens,
    "tree_compact": TreeCompact,
    "tree_graft_lookup": TreeGraftLookup,
    "verify_attention": Attention,
    "draft_attention": Attention,
    "inject_context_kv": InjectContextKV,
    "commit_round": CommitRound,
    "draft_round_setup": DraftRoundSetup,
    "gate_up_silu": GateUpSilu,
    "gate_up_silu_conv": GateUpSiluConv,
    "fused_context": FusedContext,
    "verify_sample": Sampling,
    "tree_accept_sample": Sampling,
    "verify_sample_sparse": SparseSample,
    "candidate_select": CandidateSelect,
    "dynamic_conv_prepare": DynamicConvPrepare,
}


def _generate(case: dict, b: Build):
    """``dflash.generate`` (imported on first use: transformers and the runtime cost a worker ~2 s to import)."""
    from helpers.fuzz.generate_case import Generate

    return Generate(case, b)


OPS["generate"] = _generate


def _make(case: dict, store: torch.dtype | None):
    b = Build(case, store)
    return OPS[case["op"]](case, b), b


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e)[:400]}"


def _compare(got: list, low: list, ref64: list | None) -> str | None:
    if len(got) != len(low):
        return f"{len(got)} outputs, the reference has {len(low)}"
    for i, (g, r) in enumerate(zip(got, low)):
        if g.shape != r.shape or g.dtype != r.dtype:
            return f"output {i}: {g.dtype}{tuple(g.shape)}, the reference {r.dtype}{tuple(r.shape)}"
        if not g.is_floating_point():
            if not torch.equal(g, r):
                bad = (g != r).nonzero()[:4].tolist()
                return f"output {i}: integers differ from the reference at {bad}"
            continue
        try:
            assert_within_rule(g, ref64[i], r, f"output {i}")
        except AssertionError as e:
            return str(e)
    return None


def judge(case: dict) -> dict:
    path, backend = case["path"], case["backend"]
    op, b = _make(case, None)
    if path == "registered" and b.expect == "invalid":
        if b.op_defines_invalid:
            b.expect = "either"  # the op's definition covers these values: its result must be the reference's
        elif b.inert:
            b.expect = "unchecked"  # nothing is read or written through the bad extent: any clean outcome
    allowed = PUBLIC_ERRORS if path == "public" else REGISTERED_ERRORS
    try:
        got = op.public(backend) if path == "public" else op.registered(backend)
    except Exception as e:  # noqa: BLE001 - the verdict decides which exceptions pass
        if b.expect == "valid":
            return {"ok": False, "detail": f"valid input rejected: {_describe(e)}\n{traceback.format_exc()[-1500:]}"}
        if not (isinstance(e, allowed) or out_of_memory(e)) or not str(e).strip():
            return {"ok": False, "detail": f"unclean exception on {b.expect} input (allowed: "
                                           f"{[t.__name__ for t in allowed]}): {_describe(e)}"}
        written = op.untouched() if hasattr(op, "untouched") else None  # ops with result buffers: raised first?
        if written:
            return {"ok": False, "detail": f"{written}: {_describe(e)}"}
        return {"ok": True, "detail": f"raised {_describe(e)}"}
    if b.expect == "invalid":
        return {"ok": False, "detail": "returned a result for invalid input (an index outside the contract was used "
                                       "instead of rejected)"}
    if b.expect == "unchecked":
        return {"ok": True, "detail": "returned (unchecked input: not compared)"}
    if getattr(op, "exact", True) is False:
        problem = op.check_form(got)
        return {"ok": not problem, "detail": f"form: {problem}" if problem else "form checked"}
    ref_op, _ = _make(case, None)
    try:
        low = ref_op.reference()
    except Exception as e:  # noqa: BLE001
        if out_of_memory(e):
            return {"ok": True, "detail": f"returned; the reference cannot allocate its work ({_describe(e)})"}
        return {"ok": False, "detail": f"returned a result where the reference raises {_describe(e)}"}
    ref64 = None
    if any(t.is_floating_point() for t in low):
        op64, _ = _make(case, torch.float64)
        ref64 = op64.reference()
    if hasattr(op, "valid_rows"):
        got, low = op.valid_rows(got), op.valid_rows(low)
        ref64 = ref64 and op.valid_rows(ref64)
    problem = _compare(got, low, ref64)
    if problem:
        return {"ok": False, "detail": f"differs from the reference on {b.expect} input: {problem}"}
    return {"ok": True, "detail": "equal to the reference"}


def run_case(case: dict) -> dict:
    try:
        return judge(case)
    except Exception as e:  # noqa: BLE001 - a bug in the harness itself must be reported, not kill the worker
        return {"ok": False, "detail": f"harness error: {_describe(e)}\n{traceback.format_exc()[-2000:]}"}
