"""GPU checks at real shapes (marked ``gpu``: collected by ``pytest tests`` and skipped there without CUDA; run on
a GPU by bench/gpu_check.sh).

  * every op's compiled backends (triton, ext) vs its reference at the real Qwen3-8B-DFlash-b16
    shapes (verify_attention, add_rms_norm, silu_mul: the Qwen3-8B target's), on CUDA, with the
    kernel tests' tolerance rule (error vs fp64 at most 2x the torch reference's error in the same
    dtype + 1 ulp) and exact integer outputs;
  * the engine's verify step (the lean target) vs HF's forward in bf16, Qwen3 and LLaMA targets;
  * the fast runtime with CUDA graphs: both steps captured and replayed, output == the target's own
    greedy output == the eager fast runtime == the reference runtime, and sampling graph == eager;
  * the kernel-backed draft step proposes what the reference draft proposes.

Run: python -m pytest -q -rs tests/gpu/test_gpu.py
"""
from __future__ import annotations

import os
from functools import partial

import pytest
import torch

from helpers.bench import bench_module

# DFLASH_GPU_TESTS_DEVICE=cpu dry-runs the logic on CPU (no graphs, torch/ext backends only).
DEV = os.environ.get("DFLASH_GPU_TESTS_DEVICE", "cuda")
GRAPHS = DEV == "cuda"
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(DEV == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device")]

import dflash_kernels as dk  # noqa: E402
from dflash_kernels._dispatch import backend_status  # noqa: E402
from dflash.sampling import SamplingParams  # noqa: E402

H, T, L, NH, KVH, D, V, I = 4096, 5, 5, 32, 8, 128, 151936, 12288
BF = torch.bfloat16


def _backends(op_backends):
    if DEV == "cpu":  # dry run: the torch backend exercises the test logic
        op_backends = ["torch"] + [b for b in op_backends if b == "ext"]
    out = []
    for b in op_backends:
        ok, why = backend_status(b, torch.device(DEV)) if (DEV != "cuda" or torch.cuda.is_available()) \
            else (False, "no CUDA")
        out.append(pytest.param(b, marks=pytest.mark.skipif(not ok, reason=f"{b}: {why}")))
    return out


def _inv_freq(d):
    return (1.0 / (1e6 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))).to(DEV)


def _rnd(*shape, scale=1.0, dtype=BF):
    return (torch.randn(*shape, device=DEV) * scale).to(dtype)


# ------------------------------------------------------------------------------------------ kernels
@pytest.mark.parametrize("backend", _backends(["triton"]))
@pytest.mark.parametrize("n", [1, 16, 256])
def test_fused_context_real_shape(backend, n):
    from helpers.tol import assert_within_rule
    from dflash_kernels.fused_context import fused_context_reference

    taps, w = _rnd(n, T * H), _rnd(H, T * H, scale=(T * H) ** -0.5)
    nw = (1 + 0.1 * torch.randn(H, device=DEV)).to(BF)
    out = dk.fused_context(taps, w, nw, 1e-6, backend=backend)
    ref = fused_context_reference(taps.double(), w.double(), nw.double(), 1e-6)
    assert_within_rule(out, ref, fused_context_reference(taps, w, nw, 1e-6), f"fused_context n={n}")


@pytest.mark.parametrize("backend", _backends(["triton"]))
def test_inject_context_kv_real_shape(backend):
    from helpers.tol import assert_within_rule
    from dflash_kernels.inject_context_kv import inject_context_kv_reference

    rows = [16, 3, 16, 1]
    cached = [0, 2048, 17, 8000]
    n, m, cap = len(rows), sum(rows), 8100
    # One layer's projected context rows as the engine passes them: column views of the merged QKV output.
    qkv = _rnd(m, (H // D + 2 * KVH) * D)
    k, v = qkv[:, H:].unflatten(-1, (2, KVH, D)).unbind(-3)
    knw = (1 + 0.1 * torch.randn(D, device=DEV)).to(BF)
    cu = torch.tensor([0] + rows, device=DEV).cumsum(0)
    lens = torch.tensor(cached, device=DEV)
    inv = _inv_freq(D)
    outs = {}
    for name, dt in (("kernel", BF), ("f64", torch.float64), ("lowp", BF)):
        kc = torch.full((n, cap, KVH, D), float("nan"), device=DEV, dtype=dt)
        vc = kc.clone()
        args = (k.to(dt), v.to(dt), knw.to(dt), cu, lens, kc, vc)
        if name == "kernel":
            dk.inject_context_kv(*args, inv_freq=inv, backend=backend)
        else:
            inject_context_kv_reference(*args, inv_freq=inv)
        outs[name] = (kc, vc)
    for i, what in enumerate("KV"):
        got, r64, lo = outs["kernel"][i], outs["f64"][i], outs["lowp"][i]
        written = ~torch.isnan(r64)
        assert torch.equal(~torch.isnan(got), written), f"{what}: rows written differ from the reference's"
        assert_within_rule(got[written], r64[written], lo[written], f"inject {what}")


def _attention_inputs(lens=(8191, 0, 17, 2048), b=16):
    """Qwen3-8B-shaped block q/k/v of 4 requests with ragged context lengths, caches holding them plus a block."""
    n, cap = len(lens), max(lens) + b
    q, k, v = _rnd(n, b, NH, D), _rnd(n, b, KVH, D), _rnd(n, b, KVH, D)
    return q, k, v, _rnd(n, cap, KVH, D), _rnd(n, cap, KVH, D), torch.tensor(lens, device=DEV)


@pytest.mark.parametrize("backend", _backends(["triton"]))
@pytest.mark.parametrize("window", [None, 2048])
def test_draft_attention_real_shape(backend, window):
    from helpers.tol import assert_within_rule
    from dflash_kernels.draft_attention import draft_attention_reference

    q, k, v, kc, vc, cl = _attention_inputs()
    cap = kc.shape[1]
    qw, kw = (1 + 0.1 * torch.randn(D, device=DEV)).to(BF), (1 + 0.1 * torch.randn(D, device=DEV)).to(BF)
    kwargs = dict(inv_freq=_inv_freq(D), sliding_window=window)
    out = dk.draft_attention(q, k, v, kc, vc, cl, qw, kw, max_context_len=cap, backend=backend, **kwargs)
    # The split-KV merge runs in the kernel, in whichever split finishes last (arrival counters that reset
    # themselves): calls back to back, splits racing on the GPU, must give the same bits every time.
    for _ in range(3):
        again = dk.draft_attention(q, k, v, kc, vc, cl, qw, kw, max_context_len=cap, backend=backend, **kwargs)
        assert torch.equal(again, out), "draft_attention: a repeated call differs (in-kernel split merge)"
    ref = draft_attention_reference(*(x.double() for x in (q, k, v, kc, vc)), cl, qw.double(), kw.double(), **kwargs)
    lowp = draft_attention_reference(q, k, v, kc, vc, cl, qw, kw, **kwargs)
    assert_within_rule(out, ref, lowp, f"draft_attention window={window}")


@pytest.mark.parametrize("backend", _backends(["triton"]))
@pytest.mark.parametrize("qk_norm", [True, False])
def test_verify_attention_real_shape(backend, qk_norm):
    """Output and caches (the block rows written, every other row untouched) within the rule."""
    from helpers.tol import assert_within_rule
    from dflash_kernels.draft_attention import verify_attention_reference

    q, k, v, kc, vc, cl = _attention_inputs()
    norms = [(1 + 0.1 * torch.randn(D, device=DEV)).to(BF) if qk_norm else None for _ in "qk"]
    outs = {}
    for name, dt in (("kernel", BF), ("f64", torch.float64), ("lowp", BF)):
        caches = kc.to(dt, copy=True), vc.to(dt, copy=True)
        args = (q.to(dt), k.to(dt), v.to(dt), *caches, cl, *(w if w is None else w.to(dt) for w in norms))
        fn = verify_attention_reference if name != "kernel" else partial(dk.verify_attention, backend=backend)
        outs[name] = (fn(*args, inv_freq=_inv_freq(D)), *caches)
    for i, what in enumerate(("out", "K cache", "V cache")):
        assert_within_rule(outs["kernel"][i], outs["f64"][i], outs["lowp"][i], f"verify_attention {what}")


@pytest.mark.parametrize("backend", _backends(["triton"]))
@pytest.mark.parametrize("rows", [16, 128])
def test_add_rms_norm_real_shape(backend, rows):
    from helpers.tol import assert_within_rule
    from dflash_kernels.layer_ops import add_rms_norm_reference

    x, res = _rnd(rows, H), _rnd(rows, H)
    w = (1 + 0.1 * torch.randn(H, device=DEV)).to(BF)
    got_res, low_res = res.clone(), res.clone()
    out = dk.add_rms_norm(x, w, 1e-6, residual=got_res, backend=backend)
    ref = add_rms_norm_reference(x.double(), w.double(), 1e-6, residual=res.double())
    assert_within_rule(out, ref, add_rms_norm_reference(x, w, 1e-6, residual=low_res), f"add_rms_norm rows={rows}")
    assert torch.equal(got_res, low_res), "the residual must be residual + x rounded once, as PyTorch adds"


@pytest.mark.parametrize("backend", _backends(["triton"]))
@pytest.mark.parametrize("rows", [16, 128])
def test_silu_mul_real_shape(backend, rows):
    from helpers.tol import assert_within_rule
    from dflash_kernels.layer_ops import silu_mul_reference

    gate_up = _rnd(rows, 2 * I, scale=3.0)
    out = dk.silu_mul(gate_up, backend=backend)
    assert_within_rule(out, silu_mul_reference(gate_up.double()), silu_mul_reference(gate_up), f"silu_mul rows={rows}")


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_verify_step_equals_hf_forward_bf16(arch):
    """The engine's verify-step forward (lean target: add_rms_norm, merged GEMMs, verify_attention, silu_mul; the
    compiled kernels on CUDA) over [anchor, 15 proposals] after a 100-token prefill, vs HF's forward over the
    same 116 tokens. Rule: the block's logits within 2x the largest difference between HF's own bf16 and fp32
    forwards (+ 1 bf16 ulp, `helpers.tol`). Then greedy tokens: a 40-token decode through the engine (captured steps on
    CUDA) equals HF's bf16 greedy generate, on the same target made tie-free (bench/e2e.py make_margin_target:
    a random bf16 target has near-ties that either side may legitimately flip)."""
    import copy

    from helpers.tol import assert_within_rule
    make_margin_target = bench_module("e2e").make_margin_target
    from helpers.tiny_models import make_draft, make_target

    from dflash import generate
    from dflash.engine import DFlashEngine

    torch.manual_seed(4)
    ref32 = make_target(arch, vocab=1024, layers=4, hidden=256).to(DEV)  # head_dim 64
    with torch.no_grad():  # non-trivial norms: a misplaced norm shows
        for name, p in ref32.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    target = copy.deepcopy(ref32).to(BF)
    draft = make_draft(target, layers=1, block_size=16).to(DEV, BF)
    prompt = torch.randint(0, 1024, (100,), device=DEV)
    eng = DFlashEngine(target, draft, batch=1, capacity=192, block_size=16, use_cuda_graphs=False)
    with torch.inference_mode():
        eng.reset([prompt], [40], [[]], SamplingParams(), 0)
        eng.proposals.copy_(torch.randint(0, 1024, (1, 15), device=DEV))
        block = torch.cat([eng.anchor[:, None], eng.proposals], dim=1)
        logits, _ = eng.target.forward(block, eng.positions, eng.kv_bound)  # what verify_step runs
        ids = torch.cat([prompt[None], block], dim=1)
        ref, lowp = (m(ids).logits[:, -16:] for m in (ref32, target))
    assert_within_rule(logits, ref.double(), lowp, f"{arch} verify logits")
    make_margin_target(target)
    with torch.inference_mode():
        fast = generate(target, draft, prompt, 40, backend="fast", use_cuda_graphs=GRAPHS)
    assert torch.equal(fast.sequences[0], _greedy(target, prompt, 40))


@pytest.mark.parametrize("backend", _backends(["triton", "ext"]))
@pytest.mark.parametrize("dtype", [BF, torch.float32])
@pytest.mark.parametrize("n", [1, 16])
def test_verify_greedy_real_shape(backend, dtype, n):
    b = 16
    logits = _rnd(n, b, V, scale=3.0, dtype=dtype)
    drafts = logits.argmax(-1)[:, :-1].clone()
    cut = torch.randint(0, b, (n,), device=DEV)
    drafts = torch.where(torch.arange(b - 1, device=DEV)[None] >= cut[:, None], (drafts + 1) % V, drafts)
    logits[0, 3, 1000] = logits[0, 3].max()  # a tie: the first index must win
    got = dk.verify_greedy(logits, drafts, backend=backend)
    ref = dk.verify_greedy(logits, drafts, backend="torch")
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


@pytest.mark.parametrize("backend", _backends(["triton"]))
@pytest.mark.parametrize("filt", [False, True])
def test_verify_sample_real_shape_valid_and_reproducible(backend, filt):
    n, b = 16, 16
    logits = _rnd(n, b, V, scale=3.0)
    drafts = logits.argmax(-1)[:, :-1].clone()
    kw = dict(temperature=0.8, top_k=50 if filt else 0, top_p=0.9 if filt else 1.0)
    seed, off = torch.tensor([5], device=DEV), torch.tensor([2], device=DEV)
    a1, t1 = dk.verify_sample(logits, drafts, seed=seed, offset=off, backend=backend, **kw)
    a2, t2 = dk.verify_sample(logits, drafts, seed=seed, offset=off, backend=backend, **kw)
    assert torch.equal(a1, a2) and torch.equal(t1, t2)
    assert bool(((a1 >= 0) & (a1 <= b - 1)).all()) and bool(((t1 >= 0) & (t1 < V)).all())
    # drafts planted 20 logits above everything else are (almost surely) all accepted
    planted = logits.clone()
    rows = torch.arange(n, device=DEV)[:, None]
    cols = torch.arange(b - 1, device=DEV)[None, :]
    planted[rows, cols, drafts] = logits.float().amax().to(logits.dtype) + 20
    sharp = dk.verify_sample(planted, drafts, seed=seed, offset=off, backend=backend, **kw)[0]
    assert float(sharp.float().mean()) > (b - 1) * 0.99, sharp


@pytest.mark.parametrize("backend", _backends(["ext"]))
def test_commit_round_cuda_equals_reference(backend):
    r, b, cap = 64, 16, 512
    lengths = torch.randint(1, cap - 40, (r,), device=DEV)
    lengths[:4] = torch.tensor([cap - 3, cap, 1, 5], device=DEV)
    state = dict(out_tokens=torch.randint(0, 100, (r, cap), device=DEV), lengths=lengths, positions=lengths - 1,
                 anchor=torch.randint(0, 100, (r,), device=DEV), done=torch.rand(r, device=DEV) < 0.1,
                 max_lengths=torch.clamp(lengths + torch.randint(0, 30, (r,), device=DEV), max=cap))
    drafts = torch.randint(0, 100, (r, b - 1), device=DEV)
    acc, bonus = torch.randint(0, b, (r,), device=DEV), torch.randint(0, 100, (r,), device=DEV)
    stops = torch.tensor([7, 13, -1], device=DEV)
    outs = []
    for be in (backend, "torch"):
        st = {k: v.clone() for k, v in state.items()}
        num = dk.commit_round(drafts, acc, bonus, stop_tokens=stops, backend=be, check=False, **st)
        outs.append([num] + [st[k] for k in sorted(st)])
    for x, y in zip(*outs):
        assert torch.equal(x, y)


# ------------------------------------------------------------------------------------------ runtime
def _tiny_pair(dtype=torch.float32, block=8, layer_types=None, window=None):
    from helpers.tiny_models import make_draft, make_target

    target = make_target("qwen3", vocab=512, layers=4, hidden=64).to(DEV, dtype)
    draft = make_draft(target, layers=2, block_size=block, layer_types=layer_types, sliding_window=window,
                       mask_token_id=5).to(DEV, dtype)
    return target, draft


def _greedy(target, ids, max_new):
    out = target.generate(ids[None], attention_mask=torch.ones_like(ids[None]), max_new_tokens=max_new,
                          do_sample=False)
    return out[0]


def _oracle_engine(target, draft, prompts, expected, accept, block, graphs):
    oracle_fast_class = bench_module("e2e").oracle_fast_class

    width = max(len(e) for e in expected) + block + 2
    seq = torch.zeros(len(prompts), width, dtype=torch.long, device=DEV)
    for r, e in enumerate(expected):
        seq[r, :len(e)] = e
    cls = oracle_fast_class(seq, accept, target.config.vocab_size)
    cap = -(-width // 64) * 64
    return cls(target, draft, batch=len(prompts), capacity=cap, block_size=block, use_cuda_graphs=graphs)


@pytest.mark.parametrize("layer_types,window", [(None, None), (["sliding_attention", "full_attention"], 5)])
def test_graph_replay_of_both_steps_equals_target_greedy_and_eager(layer_types, window):
    torch.manual_seed(0)
    block, accept = 8, 4
    target, draft = _tiny_pair(block=block, layer_types=layer_types, window=window)
    prompts = [torch.randint(0, 500, (n,), device=DEV) for n in (5, 40, 17)]
    limits = [30, 21, 37]
    expected = [_greedy(target, p, m) for p, m in zip(prompts, limits)]
    results = {}
    for graphs in ((True, False) if GRAPHS else (False,)):
        eng = _oracle_engine(target, draft, prompts, expected, accept, block, graphs)
        accs = []
        with torch.inference_mode():
            eng.reset(prompts, limits, [[] for _ in prompts], SamplingParams(), 0)
            while not bool(eng.done.all()):
                eng.round()
                accs.append(eng.num_new.clone())
        if graphs:
            assert {key[0] for key in eng.graphs} == {"draft", "verify"}, "both steps must be captured"
        seqs = [eng.out_tokens[r, :int(eng.lengths[r])].clone() for r in range(len(prompts))]
        for r, e in enumerate(expected):
            assert torch.equal(seqs[r], e), f"graphs={graphs}: request {r} differs from the target's greedy output"
        results[graphs] = torch.stack(accs)
    if GRAPHS:
        assert torch.equal(results[True], results[False]), "graph replay and eager steps accepted differently"
    assert int(results[GRAPHS].max()) == accept


def test_fast_equals_reference_runtime_real_draft():
    from dflash import generate

    torch.manual_seed(1)
    target, draft = _tiny_pair(block=4)
    ids = torch.randint(0, 500, (23,), device=DEV)
    ref = generate(target, draft, ids, 40, backend="reference")
    fast = generate(target, draft, ids, 40, backend="fast")
    eager = generate(target, draft, ids, 40, backend="fast", use_cuda_graphs=False)
    assert torch.equal(fast.sequences, ref.sequences)
    assert torch.equal(eager.sequences, ref.sequences)
    assert torch.equal(fast.sequences[0], _greedy(target, ids, 40))


def test_sampling_graph_equals_eager():
    from dflash import generate

    torch.manual_seed(2)
    target, draft = _tiny_pair(block=4)
    ids = torch.randint(0, 500, (9,), device=DEV)
    kw = dict(temperature=0.8, top_k=40, top_p=0.95, seed=3)
    a = generate(target, draft, ids, 32, backend="fast", use_cuda_graphs=GRAPHS, **kw)
    b = generate(target, draft, ids, 32, backend="fast", use_cuda_graphs=False, **kw)
    assert torch.equal(a.sequences, b.sequences) and a.acceptance_lengths == b.acceptance_lengths


def test_draft_step_matches_reference_draft_bf16():
    """Kernel draft step vs the reference draft on the same state (bf16, near-ties may flip a few)."""
    from dflash.engine import DFlashEngine

    torch.manual_seed(3)
    target, draft = _tiny_pair(dtype=BF, block=16)
    prompt = torch.randint(0, 500, (200,), device=DEV)
    eng = DFlashEngine(target, draft, batch=1, capacity=256, block_size=16, use_cuda_graphs=GRAPHS)
    with torch.inference_mode():
        eng.reset([prompt], [40], [[]], SamplingParams(), 0)
        eng.run_step("draft")
        feats = target(prompt[None], output_hidden_states=True).hidden_states
        ctx = torch.cat([feats[i + 1] for i in draft.config.target_layer_ids], dim=-1)
        block = torch.full((1, 16), draft.config.mask_token_id, device=DEV)
        block[0, 0] = eng.anchor[0]
        hidden = draft(position_ids=torch.arange(216, device=DEV)[None], noise_embedding=target.model.embed_tokens(block),
                       target_hidden=ctx)
        expected = torch.argmax(draft.compute_logits(hidden[:, 1:], target.lm_head), dim=-1)
    agree = float((eng.proposals == expected).float().mean())
    assert agree >= 0.8, f"only {agree:.0%} of proposals agree with the reference draft"
