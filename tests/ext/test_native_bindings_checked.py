"""Every ``torch.ops.dflash_cpu`` op checks, before any work, what its kernel walks: called directly (no Python
wrapper in front), a valid call runs and each class of bad input (wrong dtype, a tensor too short for the extent
the kernel walks, a layout the kernel assumes broken, an index that addresses memory out of range, a CPU feature
the code needs missing) raises a RuntimeError naming the op and the argument, instead of reading or writing
outside the tensors (csrc/cpu/bindings.cpp; csrc/README.md, "Native CPU kernels"). Index values are checked as
read once by the op: the kernels get that copy."""
import pytest
import torch

from dflash_kernels.cpu import native as cpu_native
from dflash_kernels.tree import tree_ancestor_mask_reference, tree_compact_reference, tree_graft_lookup_reference

pytestmark = pytest.mark.skipif(cpu_native.unavailable_reason() is not None,
                                reason=f"native CPU kernels unavailable: {cpu_native.unavailable_reason()}")

I64 = torch.int64
HAS_AMX = "amx" in cpu_native.isas()


def ops():
    return torch.ops.dflash_cpu


def nan(*shape):
    return torch.full(shape, float("nan"))


def idx(*values):
    return torch.tensor(values, dtype=I64)


def strided_rows(rows, cols):
    """A [rows, cols] fp32 view whose rows sit at a stride wider than cols (unit stride along cols)."""
    return torch.randn(rows, cols + 7)[:, :cols]


def transposed(*shape):
    """A tensor of ``shape`` whose last dim is not of unit stride."""
    return torch.randn(*shape[:-2], shape[-1], shape[-2]).transpose(-1, -2)


def replace(args, **changes):
    return {**args, **changes}


def replace_item(args, key, i, value):
    items = list(args[key])
    items[i] = value
    return {**args, key: items}


# ---- valid arguments of each op (schema names), drawn at ugly sizes

def rms_args():
    return dict(x=strided_rows(5, 40), residual=torch.randn(5, 40), weight=torch.randn(40), out=nan(5, 40), eps=1e-6)


def silu_args():
    return dict(gate_up=strided_rows(3, 2 * 24), out=nan(3, 24))


def attention_args(n=2, b=3, nh=4, kvh=2, d=16, batch=3, cap=12, write_kv=True):
    def heads(h):  # heads contiguous, rows at a stride
        return torch.randn(n, b, h + 1, d)[:, :, :h]

    return dict(q=heads(nh), k=heads(kvh), v=heads(kvh), k_cache=torch.randn(batch, cap, kvh, d),
                v_cache=torch.randn(batch, cap, kvh, d), lens=idx(*([cap - b] + [1] * (n - 1))),
                rows=idx(*range(n - 1, -1, -1)), block_lens=None, q_norm=torch.rand(d) + 0.5,
                k_norm=torch.rand(d) + 0.5, eps=1e-6, cos=torch.randn(n * b, d), sin_signed=torch.randn(n * b, d),
                tree_mask=None, causal=True, write_kv=write_kv, scale=d ** -0.5, out=nan(n, b, nh, d))


def draft_args():
    return replace(attention_args(write_kv=False), block_lens=idx(3, 1), causal=False, lens=idx(12, 0))


def inject_args(d=16):
    return dict(k=torch.randn(6, 3, d)[:, :2], v=torch.randn(6, 2, d), k_norm=torch.rand(d) + 0.5, eps=1e-6,
                offsets=idx(0, 2, 6), lens=idx(7, 1), rows=idx(2, 0), cos=torch.randn(6, d),
                sin_signed=torch.randn(6, d), k_cache=torch.zeros(3, 8, 2, d), v_cache=torch.zeros(3, 8, 2, d))


def tree_args(t=6):
    logits = torch.randn(2, 3, 16)[:, :, :10]
    return dict(logits=logits, lse=torch.logsumexp(logits, -1), k=min(t - 1, 10), anchor=idx(5, 7), vocab_ids=None,
                tokens=torch.full((2, t), -7), parents=torch.full((2, t), -7), depths=torch.full((2, t), -7))


def mask_args():
    return dict(parents=torch.tensor([[-1, 0, 0, 1, 2, 9], [-1, 0, 1, 2, 3, 0]])[:, :5],
                mask=torch.full((2, 5, 1), -7))


def walk_args():
    tokens = torch.randint(0, 3, (2, 5))
    return dict(target=torch.randint(0, 3, (2, 5)), tokens=tokens, parents=idx(-1, 0, 0, 1, 2).repeat(2, 1),
                path=torch.full((2, 4), -7), accepted=torch.full((2,), -7), bonus=torch.full((2,), -7))


def graft_args():
    # row 0 ends "1 2" after an earlier "1 2 3 4": the continuation 3 4, whose 3 the tree holds (node 1); row 1 ends
    # "8" after an earlier "8 9 8": the continuation 9 8, new to the tree
    return dict(tree_tokens=idx(8, 3, 5, 9, 8, 6, 7, 2).view(2, 4),
                tree_parents=idx(-1, 0, 0, 1, -1, 0, 1, 2).view(2, 4),
                tree_depths=idx(0, 1, 1, 2, 0, 1, 2, 3).view(2, 4),
                tokens=idx(1, 2, 3, 4, 1, 2, 5, 6, 7, 8, 9, 8).view(2, 6),
                lengths=idx(6, 6), limit=2, max_n=4, min_n=1, out_tokens=torch.full((2, 4), -7, dtype=I64),
                out_parents=torch.full((2, 4), -7, dtype=I64), out_depths=torch.full((2, 4), -7, dtype=I64))


def compact_args():
    return dict(k_cache=torch.randn(2, 3, 8, 2, 4), v_cache=torch.randn(2, 3, 8, 2, 4),
                path=idx(0, 2, 3, -1, 0, 1, -1, -1).view(2, 4), accepted=idx(2, 1), start=idx(1, 4), rows=idx(2, 0))


def tiles(n, k):
    return torch.zeros(-(-n // 16) * -(-k // 32) * 512, dtype=torch.int16)


def pack_args():
    return dict(weight=torch.randn(20, 47).bfloat16().float()[:, :40], tiles=tiles(20, 40))


def norms_args():
    return dict(tiles=tiles(20, 40), n=20, k=40, norms=torch.full((20,), float("nan"), dtype=torch.float64))


def amx_linear_args():
    return dict(x=strided_rows(3, 40), tiles=[tiles(20, 40), tiles(5, 40)], rows=[20, 5], biases=[None, torch.randn(5)],
                out=nan(3, 25))


def amx_argmax_args():
    return dict(x=strided_rows(3, 40), tiles=tiles(20, 40), bias=torch.randn(20),
                norms=torch.ones(20, dtype=torch.float64), ids=torch.full((3,), -7))


def amx_argmax_int8_args():
    """amx_argmax with its int8 screen (no bias; bounds of 1 with codes unrelated to the weight: any values, the
    screen's promise, decide only which groups are computed)."""
    return dict(amx_argmax_args(), bias=None, int8_tiles=torch.randint(-127, 128, (2 * 1 * 1024,), dtype=torch.int8),
                scales=torch.rand(20), int8_bounds=torch.ones(2, dtype=torch.float64),
                code_norms=torch.ones(2, dtype=torch.float64), max_scale=1.0)


def argmax_int8_args():
    return dict(x=strided_rows(3, 40), codes=torch.randint(-127, 128, (20, 40), dtype=torch.int8),
                scales=torch.rand(20), bounds=torch.ones(2, dtype=torch.float64), max_scale=1.0,
                packed=torch.randn(20, 40).bfloat16().float().view(torch.int16)[:, 1::2].contiguous(),
                ids=torch.full((3,), -7))


def layer_args(route=3, h=40, nh=2, kvh=1, d=16, inter=24, n=1, b=3, layers=2):
    """Tiny decoder layers: fp32 weights on the fallback route (3, torch's linear: any CPU) unless ``route``; one tap
    entering the last layer."""
    m = n * b
    weights, biases = [], []
    for _ in range(layers):
        weights += [torch.randn(rows, h) * 0.1 for rows in (nh * d, kvh * d, kvh * d)]
        weights += [torch.randn(h, nh * d) * 0.1, torch.randn(inter, h) * 0.1, torch.randn(inter, h) * 0.1,
                    torch.randn(h, inter) * 0.1]
        biases += [None, None, None, torch.randn(h), None, None, None]

    def per_layer(make):
        return [make() for _ in range(layers)]
    return dict(h=torch.randn(m, h), x=nan(m, h), delta=nan(m, h), qkv=nan(n, b, (nh + 2 * kvh) * d),
                attn=nan(n, b, nh, d), gu=nan(m, 2 * inter), act=nan(m, inter), taps=[nan(m, 2 * h)[:, h:]],
                tap_layers=[layers - 1], k_cache=torch.randn(layers, 2, 8, kvh, d),
                v_cache=torch.randn(layers, 2, 8, kvh, d), lens=idx(8 - b), rows=idx(1), cos=torch.randn(m, d),
                sin_signed=torch.randn(m, d), tree_mask=None, input_norms=per_layer(lambda: torch.rand(h) + 0.5),
                input_eps=[1e-6] * layers, post_norms=per_layer(lambda: torch.rand(h) + 0.5),
                post_eps=[1e-6] * layers, q_norms=per_layer(lambda: torch.rand(d) + 0.5),
                k_norms=per_layer(lambda: torch.rand(d) + 0.5), qk_eps=[1e-6] * layers, scales=[d ** -0.5] * layers,
                routes=[route] * 4 * layers, nblocks=[3, 1, 2, 1] * layers, weights=weights,
                block_rows=[w.shape[0] for w in weights], biases=biases)


# ---- valid calls run (and write every output)

def test_valid_calls_run():
    a = rms_args()
    s = a["x"] + a["residual"]
    ops().add_rms_norm(**a)
    assert torch.equal(a["residual"], s)
    torch.testing.assert_close(a["out"], a["weight"] * (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6)))

    a = silu_args()
    ops().silu_mul(**a)
    g, u = a["gate_up"].chunk(2, -1)
    torch.testing.assert_close(a["out"], torch.nn.functional.silu(g) * u)

    for a in (attention_args(), draft_args()):
        assert ops().block_attention(**a) == 0 and not a["out"].isnan().any()

    a = inject_args()
    ops().inject_context_kv(**a)
    # request 0 (cache row 2) from position 7: its first row lands in the last slot, its second is dropped
    assert torch.equal(a["v_cache"][2, 7], a["v"][0]) and torch.equal(a["v_cache"][0, 1:5], a["v"][2:6])
    assert int((a["v_cache"] != 0).any(-1).any(-1).sum()) == 5

    a = tree_args()
    assert ops().build_tree(**a) == 0
    assert a["tokens"][:, 0].tolist() == [5, 7] and a["parents"][:, 0].tolist() == [-1, -1]
    assert (a["depths"] >= 0).all() and (a["parents"][:, 1:] >= 0).all()

    a = mask_args()
    assert ops().tree_ancestor_mask(**a) == -1
    assert torch.equal(a["mask"], tree_ancestor_mask_reference(a["parents"]))

    a = walk_args()
    ops().tree_walk_tokens(**a)
    assert (a["accepted"] >= 0).all() and (a["path"][:, 0] == 0).all()

    a = graft_args()
    ops().tree_graft_lookup(**a)
    want = tree_graft_lookup_reference(a["tree_tokens"], a["tree_parents"], a["tree_depths"], a["tokens"],
                                       a["lengths"], depth=2, max_ngram=4, min_ngram=1)
    assert all(torch.equal(a[k], w) for k, w in zip(("out_tokens", "out_parents", "out_depths"), want))
    assert a["out_tokens"].tolist() == [[8, 3, 5, 4], [8, 6, 9, 8]] and a["out_parents"].tolist() == [[-1, 0, 0, 1],
                                                                                                     [-1, 0, 0, 2]]

    a = compact_args()
    want = [a["k_cache"].clone(), a["v_cache"].clone()]
    tree_compact_reference(*want, a["path"], a["accepted"], a["start"], cache_batch_idx=a["rows"])
    ops().tree_compact(**a)
    assert torch.equal(a["k_cache"], want[0]) and torch.equal(a["v_cache"], want[1])

    for isa in ("avx512", "avx2"):
        if isa in cpu_native.isas():
            a = argmax_int8_args()
            assert getattr(ops(), f"argmax_int8_{isa}")(**a) >= 3 and ((a["ids"] >= 0) & (a["ids"] < 20)).all()

    a = layer_args()
    caches = [a["k_cache"].clone(), a["v_cache"].clone()]
    assert ops().forward_layers(**a) == 0
    assert not any(a[k].isnan().any() for k in ("h", "x", "delta", "qkv", "attn", "gu", "act"))
    assert not a["taps"][0].isnan().any()
    for new, old in zip((a["k_cache"], a["v_cache"]), caches):  # each layer wrote its block's rows, nothing else
        assert all(not torch.equal(new[layer, 1, 5:], old[layer, 1, 5:]) for layer in range(2))
        assert torch.equal(new[:, 0], old[:, 0]) and torch.equal(new[:, 1, :5], old[:, 1, :5])


@pytest.mark.parametrize("route", [1, 2, 4, 5])
def test_valid_layer_on_each_vector_route(route):
    """The fp32 (1: AVX-512, 2: AVX2) and bf16-packed (4, 5) routes take their weights' dtype."""
    isa = "avx512" if route in (1, 4) else "avx2"
    if isa not in cpu_native.isas():
        pytest.skip(f"this CPU lacks {isa}")
    a = layer_args(route)
    if route in (4, 5):
        a["weights"] = [w.bfloat16().float().view(torch.int16)[:, 1::2].contiguous() for w in a["weights"]]
    assert ops().forward_layers(**a) == 0 and not a["delta"].isnan().any()


def test_amx_ops_run_only_where_the_cpu_and_os_allow():
    """The AMX ops run on a CPU with AMX once amx_request() got the tile state; elsewhere they refuse (their code
    would fault) with that reason."""
    if not HAS_AMX:
        for name, make in (("amx_pack", pack_args), ("amx_column_norms", norms_args)):
            with pytest.raises(RuntimeError, match=f"dflash_cpu::{name}: this CPU lacks AMX"):
                getattr(ops(), name)(**make())
        for name, make in (("amx_linear", amx_linear_args), ("amx_argmax", amx_argmax_args)):
            with pytest.raises(RuntimeError, match=f"dflash_cpu::{name}: the AMX tile state is not granted"):
                getattr(ops(), name)(**make())
        with pytest.raises(RuntimeError, match="dflash_cpu::forward_layers: the AMX tile state is not granted"):
            ops().forward_layers(**layer_args(route=0))
        return
    assert ops().amx_request() == 0
    a = pack_args()
    assert ops().amx_pack(**a) == 0
    n = norms_args()
    ops().amx_column_norms(**replace(n, tiles=a["tiles"]))
    assert not n["norms"].isnan().any()
    lin = amx_linear_args()
    assert ops().amx_linear(**lin) == 0 and not lin["out"].isnan().any()
    am = amx_argmax_args()
    assert ops().amx_argmax(**am) >= 0 and ((am["ids"] >= 0) & (am["ids"] < 20)).all()
    if ops().amx_int8():
        am = amx_argmax_int8_args()
        assert ops().amx_argmax(**am) >= 3 and ((am["ids"] >= 0) & (am["ids"] < 20)).all()


# ---- each class of bad input: (op, valid arguments, the change, what the error must name)

BAD = {
    # add_rms_norm
    "rms-x-dtype": ("add_rms_norm", rms_args, lambda a: replace(a, x=a["x"].bfloat16()), "x must be"),
    "rms-x-3d": ("add_rms_norm", rms_args, lambda a: replace(a, x=torch.randn(1, 5, 40)), "x must be"),
    "rms-x-strided-h": ("add_rms_norm", rms_args, lambda a: replace(a, x=transposed(5, 40)), "x must be"),
    "rms-out-short": ("add_rms_norm", rms_args, lambda a: replace(a, out=nan(5, 39)), "out must be"),
    "rms-out-strided": ("add_rms_norm", rms_args, lambda a: replace(a, out=transposed(5, 40)), "out must be"),
    "rms-residual-short": ("add_rms_norm", rms_args, lambda a: replace(a, residual=torch.randn(4, 40)),
                           "residual must be"),
    "rms-weight-short": ("add_rms_norm", rms_args, lambda a: replace(a, weight=torch.randn(39)), "weight must be"),
    # silu_mul
    "silu-odd-width": ("silu_mul", silu_args, lambda a: replace(a, gate_up=strided_rows(3, 47)), "even width"),
    "silu-out-short": ("silu_mul", silu_args, lambda a: replace(a, out=nan(3, 23)), "out must be"),
    "silu-out-rows": ("silu_mul", silu_args, lambda a: replace(a, out=nan(2, 24)), "out must be"),
    "silu-out-strided": ("silu_mul", silu_args, lambda a: replace(a, out=transposed(3, 24)), "out must be"),
    "silu-dtype": ("silu_mul", silu_args, lambda a: replace(a, gate_up=a["gate_up"].double()), "gate_up must be"),
    # block_attention
    "attn-q-dtype": ("block_attention", attention_args, lambda a: replace(a, q=a["q"].bfloat16()), "q must be"),
    "attn-k-heads": ("block_attention", attention_args, lambda a: replace(a, k=torch.randn(2, 3, 1, 16)),
                     "k must be"),
    "attn-v-strided": ("block_attention", attention_args, lambda a: replace(a, v=transposed(2, 3, 2, 16)),
                       "v must be"),
    "attn-cache-strided": ("block_attention", attention_args,
                           lambda a: replace(a, k_cache=torch.randn(3, 2, 12, 16).transpose(1, 2)), "k_cache must be"),
    "attn-cache-short": ("block_attention", attention_args, lambda a: replace(a, v_cache=torch.randn(3, 11, 2, 16)),
                         "v_cache must be"),
    "attn-out-short": ("block_attention", attention_args, lambda a: replace(a, out=nan(2, 3, 3, 16)), "out must be"),
    "attn-cos-short": ("block_attention", attention_args, lambda a: replace(a, cos=torch.randn(5, 16)),
                       "cos must be"),
    "attn-norm-short": ("block_attention", attention_args, lambda a: replace(a, k_norm=torch.randn(15)),
                        "k_norm must be"),
    "attn-head-dim": ("block_attention", lambda: attention_args(d=24), lambda a: a, "head dim 24"),
    "attn-head-dim-big": ("block_attention", lambda: attention_args(d=528, b=1, cap=2), lambda a: a,
                          "head dim 528"),
    "attn-group": ("block_attention", attention_args, lambda a: replace(a, q=torch.randn(2, 3, 3, 16),
                                                                        out=nan(2, 3, 3, 16)), "3 heads"),
    "attn-lens-past-room": ("block_attention", attention_args, lambda a: replace(a, lens=idx(9, 10)),
                            r"lens\[1\] = 10 must be in \[0, 9\]"),
    "attn-lens-negative": ("block_attention", attention_args, lambda a: replace(a, lens=idx(-1, 0)),
                           r"lens\[0\] = -1"),
    "attn-lens-past-cap": ("block_attention", draft_args, lambda a: replace(a, lens=idx(13, 0)),
                           r"lens\[0\] = 13 must be in \[0, 12\]"),
    "attn-lens-int32": ("block_attention", attention_args, lambda a: replace(a, lens=a["lens"].int()),
                        "lens must be"),
    "attn-lens-count": ("block_attention", attention_args, lambda a: replace(a, lens=idx(1)), "lens must be"),
    "attn-rows-past": ("block_attention", attention_args, lambda a: replace(a, rows=idx(3, 0)), r"rows\[0\] = 3"),
    "attn-rows-negative": ("block_attention", attention_args, lambda a: replace(a, rows=idx(0, -1)),
                           r"rows\[1\] = -1"),
    "attn-rows-absent": ("block_attention", attention_args,
                         lambda a: replace(a, rows=None, k_cache=torch.randn(1, 12, 2, 16),
                                           v_cache=torch.randn(1, 12, 2, 16)), "without rows"),
    "attn-block-lens-past": ("block_attention", draft_args, lambda a: replace(a, block_lens=idx(4, 0)),
                             r"block_lens\[0\] = 4"),
    "attn-tree-words": ("block_attention", attention_args,
                        lambda a: replace(a, tree_mask=torch.zeros(2, 3, 0, dtype=I64)),
                        "tree_mask's 0 words"),
    "attn-tree-shape": ("block_attention", attention_args,
                        lambda a: replace(a, tree_mask=torch.zeros(2, 2, 1, dtype=I64)),
                        "tree_mask must be"),
    # inject_context_kv
    "inject-offsets-start": ("inject_context_kv", inject_args, lambda a: replace(a, offsets=idx(1, 2, 6)),
                             r"offsets\[0\] = 1"),
    "inject-offsets-decrease": ("inject_context_kv", inject_args, lambda a: replace(a, offsets=idx(0, 4, 3)),
                                r"offsets\[2\] = 3"),
    "inject-offsets-past-k": ("inject_context_kv", inject_args, lambda a: replace(a, offsets=idx(0, 2, 7)),
                              r"offsets\[2\] = 7"),
    "inject-offsets-count": ("inject_context_kv", inject_args, lambda a: replace(a, offsets=idx(0, 6)),
                             "offsets must be"),
    "inject-lens-negative": ("inject_context_kv", inject_args, lambda a: replace(a, lens=idx(-1, 0)),
                             r"lens\[0\] = -1"),
    "inject-lens-overflow": ("inject_context_kv", inject_args, lambda a: replace(a, lens=idx(2 ** 63 - 3, 0)),
                             r"lens\[0\] = 9223372036854775805"),
    "inject-rows-past": ("inject_context_kv", inject_args, lambda a: replace(a, rows=idx(3, 0)), r"rows\[0\] = 3"),
    "inject-cos-short": ("inject_context_kv", inject_args, lambda a: replace(a, cos=torch.randn(5, 16)),
                         "cos must be"),
    "inject-cache-heads": ("inject_context_kv", inject_args, lambda a: replace(a, k_cache=torch.zeros(3, 8, 1, 16)),
                           "k_cache must be"),
    "inject-v-strided": ("inject_context_kv", inject_args, lambda a: replace(a, v=transposed(6, 2, 16)),
                         "v must be"),
    "inject-norm-short": ("inject_context_kv", inject_args, lambda a: replace(a, k_norm=torch.randn(15)),
                          "k_norm must be"),
    "inject-head-dim-big": ("inject_context_kv", lambda: inject_args(d=528), lambda a: a, "head dim 528"),
    # build_tree
    "tree-k-zero": ("build_tree", tree_args, lambda a: replace(a, k=0), "k = 0"),
    "tree-k-past-v": ("build_tree", tree_args, lambda a: replace(a, k=11), "k = 11"),
    "tree-too-many-nodes": ("build_tree", lambda: tree_args(t=41), lambda a: replace(a, k=3), "T = 41"),
    "tree-no-depths": ("build_tree", tree_args,
                       lambda a: replace(a, logits=torch.randn(2, 0, 10), lse=torch.randn(2, 0)), "depths P"),
    "tree-lse-short": ("build_tree", tree_args, lambda a: replace(a, lse=torch.randn(2, 2)), "lse must be"),
    "tree-lse-strided": ("build_tree", tree_args, lambda a: replace(a, lse=transposed(2, 3)), "lse must be"),
    "tree-logits-strided": ("build_tree", tree_args, lambda a: replace(a, logits=transposed(2, 3, 10)),
                            "logits must be"),
    "tree-anchor-short": ("build_tree", tree_args, lambda a: replace(a, anchor=idx(5)), "anchor must be"),
    "tree-anchor-int32": ("build_tree", tree_args, lambda a: replace(a, anchor=a["anchor"].int()), "anchor must be"),
    "tree-vocab-short": ("build_tree", tree_args, lambda a: replace(a, vocab_ids=torch.arange(9)), "vocab_ids must be"),
    "tree-parents-short": ("build_tree", tree_args, lambda a: replace(a, parents=torch.zeros(2, 5, dtype=I64)),
                           "parents must be"),
    "tree-depths-strided": ("build_tree", tree_args,
                            lambda a: replace(a, depths=torch.zeros(6, 2, dtype=I64).t()), "depths must be"),
    # tree_ancestor_mask
    "mask-no-words": ("tree_ancestor_mask", mask_args, lambda a: replace(a, mask=torch.zeros(2, 5, 0, dtype=I64)),
                      "mask's 0 words"),
    "mask-few-words": ("tree_ancestor_mask", mask_args,
                       lambda a: dict(parents=torch.arange(-1, 69).repeat(2, 1), mask=torch.zeros(2, 70, 1, dtype=I64)),
                       "mask's 1 words"),
    "mask-strided": ("tree_ancestor_mask", mask_args,
                     lambda a: replace(a, mask=torch.zeros(2, 2, 5, dtype=I64).transpose(1, 2)), "mask must be"),
    "mask-parents-int32": ("tree_ancestor_mask", mask_args, lambda a: replace(a, parents=a["parents"].int()),
                           "parents must be"),
    "mask-parents-strided": ("tree_ancestor_mask", mask_args,
                             lambda a: replace(a, parents=a["parents"].t().contiguous().t()), "parents must be"),
    # tree_walk_tokens
    "walk-no-nodes": ("tree_walk_tokens", walk_args,
                      lambda a: replace(a, **dict.fromkeys(("target", "tokens", "parents"),
                                                           torch.zeros(2, 0, dtype=I64))),
                      "nodes T"),
    "walk-no-depths": ("tree_walk_tokens", walk_args, lambda a: replace(a, path=torch.zeros(2, 0, dtype=I64)),
                       "depths B"),
    "walk-path-strided": ("tree_walk_tokens", walk_args,
                          lambda a: replace(a, path=torch.zeros(4, 2, dtype=I64).t()), "path must be"),
    "walk-accepted-short": ("tree_walk_tokens", walk_args, lambda a: replace(a, accepted=idx(0)),
                            "accepted must be"),
    "walk-bonus-int32": ("tree_walk_tokens", walk_args, lambda a: replace(a, bonus=a["bonus"].int()),
                         "bonus must be"),
    "walk-target-short": ("tree_walk_tokens", walk_args, lambda a: replace(a, target=a["target"][:, :4]),
                          "target must be"),
    "walk-parents-strided": ("tree_walk_tokens", walk_args,
                             lambda a: replace(a, parents=a["parents"].t().contiguous().t()), "parents must be"),
    # tree_graft_lookup
    "graft-no-nodes": ("tree_graft_lookup", graft_args,
                       lambda a: replace(a, **dict.fromkeys(("tree_tokens", "tree_parents", "tree_depths",
                                                             "out_tokens", "out_parents", "out_depths"),
                                                            torch.zeros(2, 0, dtype=I64))),
                       "nodes T"),
    "graft-tokens-int32": ("tree_graft_lookup", graft_args, lambda a: replace(a, tokens=a["tokens"].int()),
                           "tokens must be"),
    "graft-tokens-strided": ("tree_graft_lookup", graft_args,
                             lambda a: replace(a, tokens=a["tokens"].t().contiguous().t()), "tokens must be"),
    "graft-lengths-short": ("tree_graft_lookup", graft_args, lambda a: replace(a, lengths=idx(6)), "lengths must be"),
    "graft-out-strided": ("tree_graft_lookup", graft_args,
                          lambda a: replace(a, out_depths=torch.zeros(4, 2, dtype=I64).t()), "out_depths must be"),
    "graft-depths-short": ("tree_graft_lookup", graft_args,
                           lambda a: replace(a, tree_depths=a["tree_depths"][:, :3]), "tree_depths must be"),
    "graft-limit-negative": ("tree_graft_lookup", graft_args, lambda a: replace(a, limit=-1), "limit"),
    "graft-ngrams-crossed": ("tree_graft_lookup", graft_args, lambda a: replace(a, min_n=3, max_n=2), "max_n"),
    # tree_compact
    "compact-accepted-past": ("tree_compact", compact_args, lambda a: replace(a, accepted=idx(4, 1)),
                              r"accepted\[0\] = 4"),
    "compact-accepted-negative": ("tree_compact", compact_args, lambda a: replace(a, accepted=idx(2, -1)),
                                  r"accepted\[1\] = -1"),
    "compact-path-below-depth": ("tree_compact", compact_args,
                                 lambda a: replace(a, path=idx(0, 0, -1, -1, 0, 1, -1, -1).view(2, 4),
                                                   accepted=idx(1, 1), start=idx(7, 4)), r"path\[0, 1\] = 0"),
    "compact-path-negative": ("tree_compact", compact_args,
                              lambda a: replace(a, path=idx(0, 2, 3, -1, 0, -5, -1, -1).view(2, 4)),
                              r"path\[1, 1\] = -5"),
    "compact-path-not-increasing": ("tree_compact", compact_args,
                                    lambda a: replace(a, path=idx(0, 3, 3, -1, 0, 1, -1, -1).view(2, 4)),
                                    r"path\[0, 2\] = 3"),
    "compact-start-negative": ("tree_compact", compact_args, lambda a: replace(a, start=idx(-1, 4)),
                               r"start\[0\] = -1"),
    "compact-start-overflow": ("tree_compact", compact_args, lambda a: replace(a, start=idx(2 ** 63 - 2, 4)),
                               "overflows"),
    "compact-rows-past": ("tree_compact", compact_args, lambda a: replace(a, rows=idx(3, 0)), r"rows\[0\] = 3"),
    "compact-v-shape": ("tree_compact", compact_args, lambda a: replace(a, v_cache=torch.randn(2, 3, 7, 2, 4)),
                        "v_cache must be"),
    "compact-v-dtype": ("tree_compact", compact_args, lambda a: replace(a, v_cache=a["v_cache"].bfloat16()),
                        "v_cache must be"),
    "compact-k-strided": ("tree_compact", compact_args,
                          lambda a: replace(a, k_cache=torch.randn(2, 3, 8, 4, 2).transpose(3, 4)), "k_cache must be"),
    "compact-k-2d": ("tree_compact", compact_args, lambda a: replace(a, k_cache=torch.randn(3, 8)), "k_cache must be"),
    "compact-path-int32": ("tree_compact", compact_args, lambda a: replace(a, path=a["path"].int()), "path must be"),
    # the bf16-packed linear
    "linear-bf16-weight-dtype": ("linear_avx2_bf16", lambda: dict(x=torch.randn(3, 40), weights=[torch.randn(5, 40)],
                                                                  biases=[None], out=nan(3, 5)),
                                 lambda a: a, r"weights\[0\] must be a CPU Short"),
    # the int8-screened argmax
    "int8-x-strided": ("argmax_int8_avx2", argmax_int8_args, lambda a: replace(a, x=transposed(3, 40)), "x must be"),
    "int8-codes-dtype": ("argmax_int8_avx2", argmax_int8_args, lambda a: replace(a, codes=a["codes"].to(torch.uint8)),
                         "codes must be"),
    "int8-codes-k": ("argmax_int8_avx2", argmax_int8_args, lambda a: replace(a, codes=a["codes"][:, :39]),
                     "codes must be"),
    "int8-scales-short": ("argmax_int8_avx2", argmax_int8_args, lambda a: replace(a, scales=a["scales"][1:]),
                          "scales must be"),
    "int8-bounds-short": ("argmax_int8_avx2", argmax_int8_args, lambda a: replace(a, bounds=a["bounds"][1:]),
                          "bounds must be"),
    "int8-packed-rows": ("argmax_int8_avx2", argmax_int8_args, lambda a: replace(a, packed=a["packed"][1:]),
                         "packed must be"),
    "int8-ids-short": ("argmax_int8_avx2", argmax_int8_args, lambda a: replace(a, ids=a["ids"][1:]), "ids must be"),
    "int8-max-scale": ("argmax_int8_avx2", argmax_int8_args, lambda a: replace(a, max_scale=-1.0), "max_scale"),
    # amx_argmax's int8 screen (checked before the CPU's AMX)
    "amx8-partial": ("amx_argmax", amx_argmax_int8_args, lambda a: replace(a, code_norms=None), "go together"),
    "amx8-bias": ("amx_argmax", amx_argmax_int8_args, lambda a: replace(a, bias=torch.randn(20)), "takes no bias"),
    "amx8-tiles-short": ("amx_argmax", amx_argmax_int8_args, lambda a: replace(a, int8_tiles=a["int8_tiles"][1:]),
                         "int8_tiles must be"),
    "amx8-bounds-short": ("amx_argmax", amx_argmax_int8_args,
                          lambda a: replace(a, int8_bounds=a["int8_bounds"][1:]), "int8_bounds must be"),
    "amx8-scales-dtype": ("amx_argmax", amx_argmax_int8_args, lambda a: replace(a, scales=a["scales"].double()),
                          "scales must be"),
    "amx8-max-scale": ("amx_argmax", amx_argmax_int8_args, lambda a: replace(a, max_scale=-2.0), "max_scale"),
    # amx_pack / amx_column_norms / amx_linear / amx_argmax (checked before the CPU's AMX)
    "pack-tiles-short": ("amx_pack", pack_args, lambda a: replace(a, tiles=a["tiles"][1:]), "tiles must be"),
    "pack-tiles-dtype": ("amx_pack", pack_args, lambda a: replace(a, tiles=a["tiles"].float()), "tiles must be"),
    "pack-weight-strided": ("amx_pack", pack_args, lambda a: replace(a, weight=transposed(20, 40)),
                            "weight must be"),
    "norms-negative-n": ("amx_column_norms", norms_args, lambda a: replace(a, n=-16), "rows = -16"),
    "norms-short": ("amx_column_norms", norms_args, lambda a: replace(a, norms=a["norms"][1:]), "norms must be"),
    "norms-dtype": ("amx_column_norms", norms_args, lambda a: replace(a, norms=a["norms"].float()), "norms must be"),
    "norms-tiles-short": ("amx_column_norms", norms_args, lambda a: replace(a, k=70), "tiles must be"),
    "norms-huge": ("amx_column_norms", norms_args, lambda a: replace(a, n=2 ** 62, k=2 ** 62), "overflow"),
    "amx-linear-counts": ("amx_linear", amx_linear_args, lambda a: replace(a, rows=[20]), "1 to 3 tile blocks"),
    "amx-linear-tiles-short": ("amx_linear", amx_linear_args, lambda a: replace(a, rows=[40, 5]),
                               r"tiles\[0\] must be"),
    "amx-linear-bias-short": ("amx_linear", amx_linear_args, lambda a: replace_item(a, "biases", 1, torch.randn(4)),
                              r"biases\[1\] must be"),
    "amx-linear-out-short": ("amx_linear", amx_linear_args, lambda a: replace(a, out=nan(3, 24)), "out must be"),
    "amx-linear-x-strided": ("amx_linear", amx_linear_args, lambda a: replace(a, x=transposed(3, 40)),
                             "x must be"),
    "amx-linear-no-rows": ("amx_linear", amx_linear_args, lambda a: replace(a, x=torch.randn(0, 40), out=nan(0, 25)),
                           "rows M = 0"),
    "amx-argmax-ids-short": ("amx_argmax", amx_argmax_args, lambda a: replace(a, ids=idx(0, 0)), "ids must be"),
    "amx-argmax-norms-dtype": ("amx_argmax", amx_argmax_args, lambda a: replace(a, norms=a["norms"].float()),
                               "norms must be"),
    "amx-argmax-tiles-short": ("amx_argmax", amx_argmax_args, lambda a: replace(a, tiles=a["tiles"][:512]),
                               "tiles must be"),
    "amx-argmax-bias-short": ("amx_argmax", amx_argmax_args, lambda a: replace(a, bias=torch.randn(19)),
                              "bias must be"),
    # forward_layers (two layers; weight blocks 0-6 are layer 0's, 7-13 layer 1's)
    "layer-lens-past-room": ("forward_layers", layer_args, lambda a: replace(a, lens=idx(6)), r"lens\[0\] = 6"),
    "layer-rows-past": ("forward_layers", layer_args, lambda a: replace(a, rows=idx(2)), r"rows\[0\] = 2"),
    "layer-cache-short": ("forward_layers", layer_args, lambda a: replace(a, v_cache=torch.randn(2, 2, 7, 1, 16)),
                          "v_cache must be"),
    "layer-cache-layers": ("forward_layers", layer_args, lambda a: replace(a, k_cache=torch.randn(1, 2, 8, 1, 16),
                                                                           v_cache=torch.randn(1, 2, 8, 1, 16)),
                           "k_cache must be"),
    "layer-cache-strided": ("forward_layers", layer_args,
                            lambda a: replace(a, v_cache=torch.randn(2, 2, 8, 1, 32)[..., ::2]), "v_cache must be"),
    "layer-qkv-narrow": ("forward_layers", layer_args, lambda a: replace(a, qkv=nan(1, 3, 48)), "qkv must be"),
    "layer-attn-rows": ("forward_layers", layer_args, lambda a: replace(a, attn=nan(1, 2, 2, 16)), "attn's 1 x 2"),
    "layer-act-short": ("forward_layers", layer_args, lambda a: replace(a, act=nan(3, 23)), "act must be"),
    "layer-gu-odd": ("forward_layers", layer_args, lambda a: replace(a, gu=nan(3, 47)), "even width"),
    "layer-h-dtype": ("forward_layers", layer_args, lambda a: replace(a, h=a["h"].bfloat16()), "h must be"),
    "layer-tap-short": ("forward_layers", layer_args, lambda a: replace(a, taps=[nan(3, 39)]), r"taps\[0\] must be"),
    "layer-tap-strided": ("forward_layers", layer_args, lambda a: replace(a, taps=[transposed(3, 40)]),
                          r"taps\[0\] must be"),
    "layer-tap-layer-past": ("forward_layers", layer_args, lambda a: replace(a, tap_layers=[2]),
                             r"tap_layers\[0\] = 2 must name one of the 2 layers"),
    "layer-tap-count": ("forward_layers", layer_args, lambda a: replace(a, tap_layers=[]), "one tap_layers entry"),
    "layer-norm-short": ("forward_layers", layer_args, lambda a: replace_item(a, "input_norms", 1, torch.randn(39)),
                         r"input_norms\[1\] must be"),
    "layer-qnorm-short": ("forward_layers", layer_args, lambda a: replace_item(a, "q_norms", 1, torch.randn(15)),
                          r"q_norms\[1\] must be"),
    "layer-eps-count": ("forward_layers", layer_args, lambda a: replace(a, post_eps=[1e-6]), "one entry a layer"),
    "layer-no-layers": ("forward_layers", layer_args,
                        lambda a: replace(a, **{k: [] for k in ("input_norms", "input_eps", "post_norms", "post_eps",
                                                                "q_norms", "k_norms", "qk_eps", "scales")}),
                        "layer count"),
    "layer-cos-short": ("forward_layers", layer_args, lambda a: replace(a, cos=torch.randn(2, 16)), "cos must be"),
    "layer-tree-words": ("forward_layers", layer_args,
                         lambda a: replace(a, tree_mask=torch.zeros(1, 3, 0, dtype=I64)), "tree_mask's 0 words"),
    "layer-weight-depth": ("forward_layers", layer_args,
                           lambda a: replace_item(a, "weights", 10, torch.randn(40, 31)), r"weights\[10\] must be"),
    "layer-weight-strided": ("forward_layers", layer_args,
                             lambda a: replace_item(a, "weights", 6, transposed(40, 24)), r"weights\[6\] must be"),
    "layer-block-rows": ("forward_layers", layer_args, lambda a: replace_item(a, "block_rows", 0, 31),
                         r"block_rows\[0\] = 31"),
    "layer-projection-width": ("forward_layers", layer_args,
                               lambda a: replace_item(replace_item(a, "weights", 4, torch.randn(23, 40)),
                                                      "block_rows", 4, 23), "projection 2's blocks have 47 rows"),
    "layer-bias-short": ("forward_layers", layer_args, lambda a: replace_item(a, "biases", 10, torch.randn(39)),
                         r"biases\[10\] must be"),
    "layer-route": ("forward_layers", layer_args, lambda a: replace_item(a, "routes", 4, 6), "route 0-5"),
    "layer-route-count": ("forward_layers", layer_args, lambda a: replace(a, routes=[3, 3, 3, 3]),
                          "four entries a layer"),
    "layer-blocks-left": ("forward_layers", layer_args, lambda a: replace_item(a, "nblocks", 7, 2),
                          "projection 3 needs"),
    "layer-blocks-unused": ("forward_layers", layer_args,
                            lambda a: replace(a, weights=a["weights"] + [torch.randn(40, 40)],
                                              block_rows=a["block_rows"] + [40], biases=a["biases"] + [None]),
                            "use 14 of the 15 weight blocks"),
    "layer-bf16-route-fp32": ("forward_layers", layer_args, lambda a: replace_item(a, "routes", 0, 5),
                              r"weights\[0\] must be a CPU Short"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_refused_before_any_work(case):
    """The op raises naming itself and the argument, and writes nothing: every output keeps its fill."""
    name, make, change, match = BAD[case]
    args = change(make())
    before = {k: v.clone() for k, v in args.items() if isinstance(v, torch.Tensor)}
    op = "linear" if name.startswith("linear") else "argmax_int8" if name.startswith("argmax_int8") else name
    with pytest.raises(RuntimeError, match=rf"dflash_cpu::{op}: "
                                            rf"(.* )?{match}"):
        getattr(ops(), name)(**args)
    for k, v in before.items():
        assert torch.equal(args[k], v) or torch.allclose(args[k], v, rtol=0, atol=0, equal_nan=True), k
