"""The public ops as torch.library ops: torch.ops.dflash.* registered at import, one op per public call,
opcheck, torch.compile(fullgraph=True), inference_mode / no_grad, and replay through a TorchDispatchMode."""
import os
import subprocess
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import dflash_kernels
from dflash_kernels import _ext

OPS = ("fused_context", "inject_context_kv", "draft_attention", "verify_greedy", "verify_greedy_tokens",
       "verify_sample", "commit_round", "verify_attention", "add_rms_norm", "silu_mul", "draft_round_setup",
       "build_tree", "tree_ancestor_mask", "tree_accept_greedy", "tree_accept_greedy_tokens", "tree_accept_sample",
       "tree_compact", "grouped_dynamic_conv", "candidate_select", "dynamic_conv_prepare", "qkv_proj",
       "tree_graft_lookup")  # every registered op
# The order _round calls them in (verify_attention twice: the chain, then a draft tree;
# verify_sample twice: one-hot proposals, then the selector's sampled path with its q over the candidates).
CALLS = OPS[:11] + ("build_tree", "tree_ancestor_mask", "verify_attention") + OPS[13:] + ("verify_sample",)
EXT_OK = _ext.status("cpu")[0]


class Recorder(TorchDispatchMode):
    """Records every torch.ops.dflash.* call (op, args, kwargs), as a graph-replay emulation would."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "dflash":
            self.calls.append((func, args, kwargs))
        return func(*args, **kwargs)


def _state(device=None):
    """Small inputs of one engine round: N=2 requests, block B=3, L=2 draft layers, H=16, kvH=1, D=8."""
    n, b, h, layers, nh, kvh, d, cap, v = 2, 3, 16, 2, 2, 1, 8, 12, 20
    ctx_lens = [2, 1]
    m = sum(ctx_lens)
    s = dict(
        taps=[torch.randn(m, h) for _ in range(2)], fc_weight=torch.randn(h, 2 * h) / 6, norm_weight=torch.rand(h) + 0.5,
        ctx_k=torch.randn(m, kvh, d), ctx_v=torch.randn(m, kvh, d), k_norm_weight=torch.rand(layers, d) + 0.5,
        cu=torch.tensor([0, 2, 3]), cache_lens=torch.tensor([3, 5]),
        k_cache=torch.randn(layers, n, cap, kvh, d), v_cache=torch.randn(layers, n, cap, kvh, d),
        inv_freq=1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)),
        q=torch.randn(n, b, nh, d), k=torch.randn(n, b, kvh, d), v=torch.randn(n, b, kvh, d),
        q_norm_weight=torch.rand(d) + 0.5, block_lens=torch.tensor([3, 2]),
        logits=torch.randn(n, b, v) * 2, temperature=torch.tensor([0.7, 1.3]), top_k=torch.tensor([0, 5]),
        top_p=torch.tensor([0.9, 1.0]), seed=torch.tensor([7]), offset=torch.tensor([11]),
        out_tokens=torch.zeros(n, 8, dtype=torch.long), lengths=torch.tensor([1, 2]), pos=torch.tensor([4, 6]),
        anchor=torch.tensor([1, 2]), done=torch.tensor([False, False]), max_lengths=torch.tensor([8, 3]),
        target_k_cache=torch.randn(n, cap, kvh, d), target_v_cache=torch.randn(n, cap, kvh, d),
        stop_tokens=torch.tensor([19, -1]), residual=torch.randn(m, h), gate_up=torch.randn(m, 2 * h),
        # A draft tree of budget 4 (T = 5 nodes) from the B-1 draft rows over a 6-id draft vocabulary.
        draft_logits=torch.randn(n, b - 1, 6), vocab_ids=torch.tensor([3, 9, 0, 14, 7, 19]),
        tree_q=torch.randn(n, 5, nh, d), tree_k=torch.randn(n, 5, kvh, d), tree_v=torch.randn(n, 5, kvh, d),
        tree_logits=torch.randn(n, 5, v), tree_k_cache=torch.randn(layers, n, cap, kvh, d),
        tree_v_cache=torch.randn(layers, n, cap, kvh, d),
        # DFlash2's convolution: K = 3 taps, G = 4 channels a group, the kernels one side of a projection output.
        conv_x=torch.randn(n, b, h), conv_dynamic=torch.randn(n, b, 2, 3, h // 4), conv_base=torch.randn(2, 3, h),
        conv_projection=torch.randn(2 * 3 * (h // 4), h) / 4,
        # A merged QKV projection of the block rows over as many context rows: 8 Q columns, 2 x 6 K/V columns.
        qkv_x=torch.randn(2 * n * b, h), qkv_weight=torch.randn(20, h) / 4,
        # DFlash2's selector: rank 4 codebooks over the v-token vocabulary, proposals of rows 1..b-1.
        projected=torch.randn(n, b - 1, 4), predecessor=torch.randn(v, 4), successor=torch.randn(v, 4),
    )
    s["draft"] = s["logits"].argmax(-1)[:, :-1].clone()
    s["draft"][1, 0] = (s["draft"][1, 0] + 1) % v
    return s


def _clone(s):
    return {k: (v.clone() if isinstance(v, torch.Tensor) else [t.clone() for t in v]) for k, v in s.items()}


def _round(s, backend):
    """One call of each public op, in engine order. Returns the new outputs (the caches and the commit
    state are updated in place)."""
    ctx = dflash_kernels.fused_context(s["taps"], s["fc_weight"], s["norm_weight"], 1e-6, backend=backend)
    dflash_kernels.inject_context_kv(s["ctx_k"], s["ctx_v"], s["k_norm_weight"][0], s["cu"], s["cache_lens"],
                                     s["k_cache"][0], s["v_cache"][0], inv_freq=s["inv_freq"],
                                     attention_scaling=1.1, backend=backend)
    att = dflash_kernels.draft_attention(s["q"], s["k"], s["v"], s["k_cache"][0], s["v_cache"][0], s["cache_lens"],
                                         s["q_norm_weight"], s["k_norm_weight"][0], inv_freq=s["inv_freq"],
                                         sliding_window=4, block_lens=s["block_lens"], backend=backend)
    acc, bonus = dflash_kernels.verify_greedy(s["logits"], s["draft"], backend=backend)
    tok_acc, tok_bonus = dflash_kernels.verify_greedy_tokens(s["logits"].argmax(-1), s["draft"], backend=backend)
    sacc, stok = dflash_kernels.verify_sample(s["logits"], s["draft"], temperature=s["temperature"],
                                              top_k=s["top_k"], top_p=s["top_p"], seed=s["seed"],
                                              offset=s["offset"], backend=backend)
    num_new = dflash_kernels.commit_round(s["draft"], acc, bonus, out_tokens=s["out_tokens"], lengths=s["lengths"],
                                          positions=s["pos"], anchor=s["anchor"], done=s["done"],
                                          max_lengths=s["max_lengths"], stop_tokens=s["stop_tokens"],
                                          backend="torch" if backend == "triton" else backend)
    target = dflash_kernels.verify_attention(s["q"], s["k"], s["v"], s["target_k_cache"], s["target_v_cache"],
                                             s["cache_lens"], inv_freq=s["inv_freq"], scale=0.3, backend=backend)
    normed = dflash_kernels.add_rms_norm(ctx, s["norm_weight"], residual=s["residual"], backend=backend)
    act = dflash_kernels.silu_mul(s["gate_up"], backend=backend)
    setup = (torch.full((2, 3), -1), torch.full((2,), -1), torch.full((2,), -1))
    dflash_kernels.draft_round_setup(s["anchor"], s["pos"], num_new, s["max_lengths"], block=setup[0],
                                     context_start=setup[1], block_lens=setup[2], backend=backend)
    tokens, parents, depths = dflash_kernels.build_tree(s["draft_logits"], s["anchor"], 4, vocab_ids=s["vocab_ids"],
                                                        backend=backend)
    mask = dflash_kernels.tree_ancestor_mask(parents, backend=backend)
    tree_att = dflash_kernels.verify_attention(s["tree_q"], s["tree_k"], s["tree_v"], s["target_k_cache"],
                                               s["target_v_cache"], s["cache_lens"], inv_freq=s["inv_freq"],
                                               tree_depths=depths, tree_mask=mask, backend=backend)
    path, tacc, tbonus = dflash_kernels.tree_accept_greedy(s["tree_logits"], tokens, parents, block_size=3,
                                                           backend=backend)
    tok_walk = dflash_kernels.tree_accept_greedy_tokens(s["tree_logits"].argmax(-1), tokens, parents, block_size=3,
                                                        backend=backend)
    spath, sacc_t, sbonus = dflash_kernels.tree_accept_sample(s["tree_logits"], tokens, parents, block_size=3,
                                                              temperature=s["temperature"], top_k=s["top_k"],
                                                              top_p=s["top_p"], seed=s["seed"], offset=s["offset"],
                                                              backend=backend)
    dflash_kernels.tree_compact(s["tree_k_cache"], s["tree_v_cache"], path, tacc, s["cache_lens"], backend=backend)
    conv = dflash_kernels.grouped_dynamic_conv(s["conv_x"], s["conv_dynamic"][:, :, 1], s["conv_base"][1],
                                               backend=backend)
    selected = dflash_kernels.candidate_select(s["logits"][:, 1:], s["projected"], s["predecessor"], s["successor"],
                                               s["anchor"], top_k=4, temperature=s["temperature"], seed=s["seed"],
                                               offset=s["offset"], backend=backend)
    prepared = dflash_kernels.dynamic_conv_prepare(s["conv_x"], s["conv_projection"], s["conv_base"][0],
                                                   backend=backend)
    qkv = dflash_kernels.qkv_proj(s["qkv_x"], s["qkv_weight"], q_cols=8, q_rows=6, out=torch.zeros(12, 20),
                                  conv_dynamic=s["conv_dynamic"][:, :, 0], conv_base=s["conv_base"][0], backend=backend)
    grafted = dflash_kernels.tree_graft_lookup(tokens, parents, depths, s["out_tokens"], s["lengths"], depth=2,
                                               backend=backend)
    drawn = dflash_kernels.verify_sample(s["logits"], selected[0], temperature=s["temperature"], top_k=s["top_k"],
                                         top_p=s["top_p"], seed=s["seed"], offset=s["offset"], draft_probs=selected[2],
                                         draft_indices=selected[1], backend=backend)
    return (ctx, att, target, acc, bonus, sacc, stok, num_new, normed, act, tokens, parents, depths, mask, tree_att,
            path, tacc, tbonus, spath, sacc_t, sbonus, *setup, tok_acc, tok_bonus, *tok_walk, conv, *selected,
            *prepared, qkv, *grafted, *drawn)


MUTATED = ("k_cache", "v_cache", "target_k_cache", "target_v_cache", "out_tokens", "lengths", "pos", "anchor", "done",
           "residual", "tree_k_cache", "tree_v_cache")


def _assert_same(a, b):
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_import_alone_registers_every_op_and_works_without_the_extension():
    """A fresh interpreter: `import dflash_kernels` registers torch.ops.dflash.*, loads no compiled code, and
    runs with `dflash_kernels._C` unimportable (a plain install without the extension)."""
    code = (
        "import sys, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'dflash_kernels._C':\n"
        "            raise ImportError('blocked for the test')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import torch, dflash_kernels\n"
        "assert 'dflash_kernels._C' not in sys.modules\n"
        f"for name in {OPS!r}:\n"
        "    op = getattr(torch.ops.dflash, name).default\n"
        "    assert 'str backend' in str(op._schema), op._schema\n"
        "l = torch.tensor([[[0., 2., 2.], [5., 1., 0.]]])\n"
        "a, b = dflash_kernels.verify_greedy(l, torch.tensor([[1]]))\n"
        "assert (a.item(), b.item()) == (1, 0)\n"
        "assert not dflash_kernels.available_backends()['ext'][0]\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items()
           if k not in ("DFLASH_KERNELS_BACKEND", "DFLASH_KERNELS_JIT", "DFLASH_CPU_SANITIZE")}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env,
                         cwd=os.path.join(os.path.dirname(__file__), "..", ".."))
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-3000:]


def test_schemas_and_mutations():
    schemas = {name: getattr(torch.ops.dflash, name).default._schema for name in OPS}
    mutated = {name: sorted(a.name for a in s.arguments if a.alias_info is not None and a.alias_info.is_write)
               for name, s in schemas.items()}
    assert mutated == {"fused_context": ["out"], "inject_context_kv": ["k_cache", "v_cache"], "draft_attention": [],
                       "verify_attention": ["k_cache", "v_cache"], "verify_greedy": [], "verify_greedy_tokens": [],
                       "verify_sample": [],
                       "commit_round": ["anchor", "done", "lengths", "out_tokens", "positions"],
                       "add_rms_norm": ["out", "residual"], "silu_mul": [],
                       "draft_round_setup": ["block", "block_lens", "context_start"], "build_tree": [],
                       "tree_ancestor_mask": [], "tree_accept_greedy": [], "tree_accept_greedy_tokens": [],
                       "tree_accept_sample": [],
                       "tree_compact": ["k_cache", "v_cache"], "grouped_dynamic_conv": ["out"],
                       "candidate_select": ["candidates", "path", "q"], "dynamic_conv_prepare": ["dynamic", "out"],
                       "qkv_proj": ["out"], "tree_graft_lookup": []}
    args = {a.name: str(a.type) for a in schemas["draft_attention"].arguments}
    assert args["block_lens"] == "Optional[Tensor]" and args["backend"] == "str"
    assert args["q_norm_weight"] == args["k_norm_weight"] == "Optional[Tensor]"
    verify = {a.name: str(a.type) for a in schemas["verify_attention"].arguments}
    assert verify["q_norm_weight"] == "Optional[Tensor]" and verify["scale"] == "Optional[float]"
    assert verify["tree_depths"] == verify["tree_mask"] == "Optional[Tensor]"
    sample = {a.name: str(a.type) for a in schemas["verify_sample"].arguments}
    assert all(sample[x] == "Tensor" for x in ("temperature", "top_k", "top_p", "seed", "offset"))
    assert {a.name: str(a.type) for a in schemas["commit_round"].arguments}["stop_tokens"] == "Optional[Tensor]"


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_each_public_call_is_one_registered_op(backend):
    """Exactly one torch.ops.dflash.* call per public call; results equal the calls made outside the mode."""
    plain = _state()
    recorded = _clone(plain)
    expected = _round(plain, backend)
    with Recorder() as rec:
        got = _round(recorded, backend)
    assert [f.__name__ for f, _, _ in rec.calls] == [f"{name}.default" for name in CALLS]
    _assert_same(expected, got)
    for k in MUTATED:
        assert torch.equal(plain[k], recorded[k]), k


def _wrong_dtype(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.complex64) if t.is_floating_point() else t.to(torch.float32)


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_registered_ops_validate_like_the_public_functions(backend):
    """Every torch.ops.dflash.* op checks its arguments itself (a direct call is not a way around the public
    function's checks): each recorded call of a round, its first tensor given a dtype no op accepts, raises a
    TypeError or ValueError naming the op, before touching any state. The unchecked bodies are reachable only
    through call_op(checked=True)."""
    from torch._library.custom_ops import OPDEFS

    ours = {name: d for name, d in OPDEFS.items() if name.startswith("dflash::")}
    assert len(ours) == len(OPS) + 1 and all(hasattr(d._init_fn, "unchecked") for d in ours.values())
    state = _state()
    with Recorder() as rec:
        _round(state, backend)
    before = _clone(state)
    for func, args, kwargs in rec.calls:
        first = args[0]
        bad = [_wrong_dtype(first[0]), *first[1:]] if isinstance(first, list) else _wrong_dtype(first)
        with pytest.raises((TypeError, ValueError), match=func.__name__.split(".")[0]):
            func(bad, *args[1:], **kwargs)
    for k in MUTATED:
        assert torch.equal(state[k], before[k]), k


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_eager_cpu_calls_skip_the_dispatcher(backend, monkeypatch):
    """Plain eager calls on CPU tensors run the ops' bodies without torch.ops (dflash_kernels._dispatch.call_op):
    same results as through the dispatcher, and not one dispatched dflash op; with grad on and an input that
    requires grad, the call goes through the dispatcher again."""
    from torch._library.custom_ops import CustomOpDef

    plain = _state()
    dispatched = _clone(plain)
    with Recorder() as rec:  # a watching mode: every call goes through torch.ops
        expected = _round(dispatched, backend)
    assert len(rec.calls) == len(CALLS)
    calls = []
    real_call = CustomOpDef.__call__
    monkeypatch.setattr(CustomOpDef, "__call__", lambda op, *a, **k: calls.append(op._name) or real_call(op, *a, **k))
    with torch.inference_mode():
        got = _round(plain, backend)
    assert calls == []
    _assert_same(expected, got)
    for k in MUTATED:
        assert torch.equal(plain[k], dispatched[k]), k
    x = torch.randn(3, 16, requires_grad=True)
    dflash_kernels.silu_mul(x, backend=backend)
    assert calls == ["silu_mul"]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_replay_reads_tensor_arguments_at_run_time(backend):
    """Replaying recorded verify_sample / commit_round / draft_attention calls after changing their tensor
    arguments in place (offset, sampling parameters, stop tokens, block_lens) equals fresh public calls."""
    s = _state()
    with Recorder() as rec:
        dflash_kernels.verify_sample(s["logits"], s["draft"], temperature=s["temperature"], top_k=s["top_k"],
                                     top_p=s["top_p"], seed=s["seed"], offset=s["offset"], backend=backend)
        dflash_kernels.draft_attention(s["q"], s["k"], s["v"], s["k_cache"][0], s["v_cache"][0], s["cache_lens"],
                                       s["q_norm_weight"], s["k_norm_weight"][0], inv_freq=s["inv_freq"],
                                       block_lens=s["block_lens"], backend=backend)
    (vs_op, vs_args, vs_kw), (da_op, da_args, da_kw) = rec.calls
    outs = set()
    for step in range(3):
        s["offset"].add_(1)
        s["temperature"].mul_(1.5)
        s["top_k"].add_(1)
        s["block_lens"].copy_(torch.tensor([1 + step, 3 - step]))
        fresh = dflash_kernels.verify_sample(s["logits"], s["draft"], temperature=s["temperature"].clone(),
                                             top_k=s["top_k"].clone(), top_p=s["top_p"].clone(), seed=int(s["seed"]),
                                             offset=int(s["offset"]), backend=backend)
        _assert_same(fresh, vs_op(*vs_args, **vs_kw))
        outs.add(tuple(fresh[1].tolist()) + tuple(fresh[0].tolist()))
        fresh = dflash_kernels.draft_attention(s["q"], s["k"], s["v"], s["k_cache"][0], s["v_cache"][0],
                                               s["cache_lens"], s["q_norm_weight"], s["k_norm_weight"][0],
                                               inv_freq=s["inv_freq"], block_lens=s["block_lens"].clone(),
                                               backend=backend)
        assert torch.equal(fresh, da_op(*da_args, **da_kw))
    assert len(outs) > 1, "the replayed sampling ignored the new offset"

    # commit_round: the stop tokens are re-read on replay.
    state = {k: s[k].clone() for k in ("out_tokens", "lengths", "pos", "anchor", "done")}
    acc = torch.tensor([2, 1])
    bonus = torch.tensor([5, 6])
    stop = torch.tensor([-1, -1])
    with Recorder() as rec:
        dflash_kernels.commit_round(s["draft"], acc, bonus, out_tokens=state["out_tokens"], lengths=state["lengths"],
                                    positions=state["pos"], anchor=state["anchor"], done=state["done"],
                                    max_lengths=s["max_lengths"], stop_tokens=stop, backend="torch")
    (cr_op, cr_args, cr_kw), = rec.calls
    assert not state["done"][0]
    state["lengths"][0] = 1
    stop[0] = int(s["draft"][0, 0])  # now the first committed token of request 0 stops it
    n = cr_op(*cr_args, **cr_kw)
    assert int(n[0]) == 1 and bool(state["done"][0])


def _opcheck_all(backend):
    s = _state()
    with Recorder() as rec:
        _round(s, backend)
    for op, args, kwargs in rec.calls:
        torch.library.opcheck(op, args, kwargs)


def test_opcheck_torch():
    _opcheck_all("torch")


def test_opcheck_triton():
    _opcheck_all("triton")


@pytest.mark.skipif(not EXT_OK, reason=f"compiled extension unavailable: {_ext.status('cpu')[1]}")
def test_opcheck_ext():
    s = _state()
    with Recorder() as rec:
        acc, bonus = dflash_kernels.verify_greedy(s["logits"], s["draft"], backend="ext")
        dflash_kernels.commit_round(s["draft"], acc, bonus, out_tokens=s["out_tokens"], lengths=s["lengths"],
                                    positions=s["pos"], anchor=s["anchor"], done=s["done"],
                                    max_lengths=s["max_lengths"], stop_tokens=s["stop_tokens"], backend="ext")
    assert [f.__name__ for f, _, _ in rec.calls] == ["verify_greedy.default", "commit_round.default"]
    assert [a[-1] for _, a, _ in rec.calls] == ["ext", "ext"]
    for op, args, kwargs in rec.calls:
        torch.library.opcheck(op, args, kwargs)


@pytest.mark.parametrize("mode", ["inference_mode", "no_grad"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_inference_mode_and_no_grad(mode, backend):
    plain = _state()
    inner = _clone(plain)
    expected = _round(plain, backend)
    with getattr(torch, mode)():
        got = _round(inner, backend)
    _assert_same(expected, got)
    for k in MUTATED:
        assert torch.equal(plain[k], inner[k]), k


def test_compile_fullgraph_no_graph_breaks():
    """torch.compile(fullgraph=True) of a round through every public op (backend "torch"): one graph that
    holds every torch.ops.dflash call of the round, run with aot_eager (functionalized mutations) and equal to eager."""
    seen = []

    def backend_fn(gm, example_inputs):
        seen.append([n.target for n in gm.graph.nodes if n.op == "call_function"])
        from torch._dynamo.backends.registry import lookup_backend

        return lookup_backend("aot_eager")(gm, example_inputs)

    torch._dynamo.reset()
    eager = _state()
    compiled = _clone(eager)
    expected = _round(eager, "torch")
    got = torch.compile(lambda s: _round(s, "torch"), fullgraph=True, backend=backend_fn)(compiled)
    _assert_same(expected, got)
    for k in MUTATED:
        assert torch.equal(eager[k], compiled[k]), k
    assert len(seen) == 1
    dflash_ops = [str(t).split(".")[1] for t in seen[0] if str(t).startswith("dflash.")]  # dflash.<op>[.default]
    assert sorted(dflash_ops) == sorted(CALLS)
    torch._dynamo.reset()
