"""Compile every Triton kernel for sm_90 (H200) ahead of time, on a machine without a GPU.

The CPU interpreter does not check GPU rules (scf.if type agreement, dot shapes, layouts, register or
shared-memory limits); this catches those at PTX/cubin level with the launch configs the launchers use
on a GPU. Run without TRITON_INTERPRET:  python tests/kernels/aot_compile_sm90.py
(``--list`` prints the planned configs, one ``kernel<TAB>label`` line each, without compiling; ``--spills``
also runs the bundled ``ptxas -v`` on each PTX for its spill bytes, which the cubin's LOCAL does not show).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time

assert os.environ.get("TRITON_INTERPRET", "0") != "1", "run without TRITON_INTERPRET"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import importlib  # noqa: E402
import itertools  # noqa: E402

# The package re-exports functions under the module names, so import the modules explicitly.
cm = importlib.import_module("dflash_kernels.commit")
da = importlib.import_module("dflash_kernels.draft_attention")
fc = importlib.import_module("dflash_kernels.fused_context")
gm = importlib.import_module("dflash_kernels.gated_mlp")
ik = importlib.import_module("dflash_kernels.inject_context_kv")
lo = importlib.import_module("dflash_kernels.layer_ops")
vf = importlib.import_module("dflash_kernels.verify")
tr = importlib.import_module("dflash_kernels.tree")
dc = importlib.import_module("dflash_kernels.dynamic_conv")
cs = importlib.import_module("dflash_kernels.candidate_select")
cp = importlib.import_module("dflash_kernels.conv_prepare")
qp = importlib.import_module("dflash_kernels.qkv_proj")

TARGET = GPUTarget("cuda", 90, 32)


def sig_of(fn, types: dict, consts: dict) -> dict:
    out = {}
    for name in fn.arg_names:
        if name in consts:
            out[name] = "constexpr"
        else:
            out[name] = types.get(name, "i32")
    return out


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def resource_usage(cubin: bytes) -> tuple[int, str]:
    """(registers per thread, "REG= STACK= LOCAL=") from the cuobjdump bundled with Triton. STACK holds the
    spills and the slow-path sin/cos frame."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([_tool("cuobjdump"), "-res-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+).*?LOCAL:(\d+)", out)
    if not m:
        return 0, "res-usage n/a"
    return int(m.group(1)), f"REG={m.group(1):>3s} STACK={m.group(2):>4s} LOCAL={m.group(3):>4s}"


def spills(ptx: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".ptx", mode="w") as f:
        f.write(ptx)
        f.flush()
        log = subprocess.run([_tool("ptxas"), "-v", "--gpu-name=sm_90a", f.name, "-o", os.devnull],
                             capture_output=True, text=True).stderr
    m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return f"spill_st={m.group(1)}B spill_ld={m.group(2)}B" if m else "spills n/a"


def max_ctas_per_sm(regs: int, warps: int, shared: int) -> int:
    """sm_90 occupancy limit: 64K registers (allocated per warp in units of 256), 228 KB shared memory
    (+1 KB reserved per CTA), 64 warps and 32 CTAs per SM."""
    by_regs = 65536 // (-(-regs * 32 // 256) * 256 * warps) if regs else 0
    return min(by_regs, 228 * 1024 // (shared + 1024), 64 // warps, 32)


def jit_attrs(fn, sig: dict, ints: dict | None) -> dict:
    """The divisibility hints the JIT gives a launch: 16 for pointers (the caching allocator's alignment) and
    for the integer arguments that are multiples of 16. ``ints``: a config's integer arguments fixed by the
    model shape; None = no hints (runtime values unknown)."""
    if ints is None:
        return {}
    return {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
            if sig[name].startswith("*") or ints.get(name, 1) % 16 == 0}


def compile_one(label, fn, types, consts, launch, with_spills=False, ints=None):
    t = time.time()
    sig = sig_of(fn, types, consts)
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=jit_attrs(fn, sig, ints))
    k = triton.compile(src, target=TARGET, options=dict(launch))
    md = k.metadata
    regs, usage = resource_usage(k.asm["cubin"])
    print(f"{label:60s} ok {time.time() - t:5.1f}s shared={md.shared:6d}B warps={md.num_warps} {usage} "
          f"ctas/sm={max_ctas_per_sm(regs, md.num_warps, md.shared)}"
          + (f" {spills(k.asm['ptx'])}" if with_spills else ""))
    return k


def configs():
    """Every (label, kernel, argument types, constexprs, launch options, shape-fixed ints) compiled here: each
    launched kernel with the launch configs the launchers use on a GPU."""
    out = []

    def add(label, fn, types, consts, num_warps=4, ints=None, launch=None):
        # launch: the launcher's own options (num_warps, maxnreg) where it returns them
        out.append((label, fn, types, consts, launch or dict(num_warps=num_warps), ints))

    bf, f32 = "*bf16", "*fp32"
    fc_ptrs = {f"t{i}": bf for i in range(8)}
    fc_ptrs.update(out_ptr=bf, ws_ptr=f32, w_ptr=bf, norm_w_ptr=bf, eps="fp32", tap_stride="i64")
    for uniform, fuse in ((False, False), (True, True)):
        add(f"fused_context GEMM uniform={uniform} fuse_norm={fuse}", fc._fc_gemm_kernel, fc_ptrs,
            dict(NUM_TAPS=5, UNIFORM=uniform, FUSE_NORM=fuse, DOT_PREC="tf32", BLOCK_M=16, BLOCK_N=32, BLOCK_K=128))
    add("fused_context GEMM fp32 ieee", fc._fc_gemm_kernel,
        {**fc_ptrs, **{f"t{i}": f32 for i in range(8)}, "out_ptr": f32, "w_ptr": f32, "norm_w_ptr": f32},
        dict(NUM_TAPS=3, UNIFORM=False, FUSE_NORM=False, DOT_PREC="ieee", BLOCK_M=64, BLOCK_N=64, BLOCK_K=64))
    add("fused_context row RMSNorm", fc._rmsnorm_rows_kernel, dict(out_ptr=bf, x_ptr=f32, w_ptr=bf, eps="fp32"),
        dict(BLOCK_H=4096))

    add("verify argmax partial", vf._argmax_partial_kernel,
        dict(logits_ptr=bf, pval_ptr=f32, pidx_ptr="*i32", stride_n="i64"), dict(BLOCK_ROWS=1, BLOCK_V=2048))
    add("verify greedy accept", vf._greedy_accept_kernel,
        dict(pval_ptr=f32, pidx_ptr="*i32", draft_ptr="*i64", acc_ptr="*i64", bonus_ptr="*i64"),
        dict(BLOCK_REQ=64, BLOCK_S=32))
    thr_ptrs = dict(logits_ptr=bf, temp_ptr=f32, topk_ptr="*i32", topp_ptr=f32, cnt_ptr="*i32", mass_ptr=f32,
                    pmax_ptr=f32, pre_ptr="*i64", acc_ptr="*i64", budget_ptr=f32, thr_ptr="*i32", stride_n="i64")
    for prev, hist in ((0, 1), (1, 1), (0, 2), (1, 2), (2, 2), (1, 0), (2, 0)):  # every launch _filter_threshold makes
        add(f"verify_sample threshold pass prev={prev} hist={hist}", vf._threshold_pass_kernel, thr_ptrs,
            dict(PREV=prev, HIST=hist, BLOCK_ROWS=1, BLOCK_V=256, BLOCK_S=32))
    # one-hot proposals, and a DFlash2 selector's distribution over 16 candidates (SPARSE)
    for filt, sparse in itertools.product((False, True), (False, True)):
        add(f"verify_sample partial filter={filt} sparse={sparse}", vf._sample_partial_kernel,
            dict(z_ptr=bf, draft_ptr="*i64", seed_ptr="*i64", offset_ptr="*i64", thr_ptr="*i32",
                 pm_ptr=f32, ps_ptr=f32, pbest_ptr=f32, pidx_ptr="*i32", temp_ptr=f32, stride_n="i64"),
            dict(FILTER=filt, BLOCK_ROWS=1, BLOCK_V=2048, SPARSE=sparse))
        add(f"verify_sample accept filter={filt} sparse={sparse}", vf._sample_accept_kernel,
            dict(z_ptr=bf, draft_ptr="*i64", seed_ptr="*i64", offset_ptr="*i64", thr_ptr="*i32",
                 pm_ptr=f32, ps_ptr=f32, pbest_ptr=f32, pidx_ptr="*i32", acc_ptr="*i64", tok_ptr="*i64",
                 temp_ptr=f32, stride_n="i64", cand_ptr="*i64", q_ptr=f32),
            dict(FILTER=filt, BLOCK_REQ=16 if sparse else 64, BLOCK_S=32, SPARSE=sparse, BLOCK_K=16 if sparse else 1))

    att = dict(q_ptr=bf, k_ptr=bf, v_ptr=bf, kc_ptr=bf, vc_ptr=bf, lens_ptr="*i64", blens_ptr="*i64",
               table_ptr="*i32", qw_ptr=bf, kw_ptr=bf, inv_freq_ptr=f32, po_ptr=f32, pm_ptr=f32, pl_ptr=f32,
               sem_ptr="*i32", out_ptr=bf, depth_ptr="*i64", tmask_ptr="*i64", attention_scaling="fp32", eps="fp32",
               qk_scale="fp32", stride_kcp="i64", stride_vcp="i64")
    # The launcher's tiles (_split_tile): Qwen3-8B (nH 32, kvH 8, D 128, B 16: B*G = 64 rows, 8 warps) and the
    # SmolLM2-135M draft/target (nH 9, kvH 3, D 64, B 8: B*G = 24 -> 32 rows, 4 warps); bf16 -> 16-bit dots.
    (qwen, qwen_launch), (smol, smol_launch) = da._split_tile(16, 4, 128, True), da._split_tile(8, 3, 64, True)
    qwen.update(MIN_CHUNK=da.MIN_CHUNK, LOWP_DOT=True, DOT_PREC="tf32")
    smol.update(MIN_CHUNK=da.MIN_CHUNK, LOWP_DOT=True, DOT_PREC="tf32")

    def shape_ints(nh, kvh, d, b):
        """The split kernel's integer arguments fixed by the model shape: q, k, v viewed from one fused QKV
        projection [N*B, (nH + 2*kvH)*D], caches [..., rows, kvH, D] (pages of 16 rows)."""
        row = (nh + 2 * kvh) * d
        ints = dict(B=b, G=nh // kvh, NH=nh, HALF=d // 2)
        for x in "qkv":
            ints.update({f"stride_{x}n": b * row, f"stride_{x}b": row, f"stride_{x}h": d})
        for x in "kv":
            ints.update({f"stride_{x}cp": 16 * kvh * d, f"stride_{x}cs": kvh * d, f"stride_{x}ch": d})
        return ints

    qwen_ints, smol_ints = shape_ints(32, 8, 128, 16), shape_ints(9, 3, 64, 8)
    for table, sliding, causal, blens in ((False, False, False, False), (True, False, False, True),
                                          (True, True, True, True), (True, True, False, False)):
        add(f"draft_attention split Qwen3-8B table={table} sliding={sliding} causal={causal} block_lens={blens}",
            da._attn_split_kernel, att,
            dict(HAS_TABLE=table, SLIDING=sliding, CAUSAL=causal, HAS_BLOCK_LENS=blens, HAS_QK_NORM=True,
                 WRITE_KV=False, TREE=False, **qwen), launch=qwen_launch, ints=qwen_ints)
    add("draft_attention split Qwen3-8B fp32 operands (tf32)", da._attn_split_kernel, att,
        dict(HAS_TABLE=False, SLIDING=False, CAUSAL=False, HAS_BLOCK_LENS=False, HAS_QK_NORM=True, WRITE_KV=False,
             TREE=False, **dict(qwen, LOWP_DOT=False)), launch=da._split_tile(16, 4, 128, False)[1], ints=qwen_ints)
    add("draft_attention split SmolLM2", da._attn_split_kernel, att,
        dict(HAS_TABLE=False, SLIDING=False, CAUSAL=False, HAS_BLOCK_LENS=False, HAS_QK_NORM=True, WRITE_KV=False,
             TREE=False, **smol), launch=smol_launch, ints=smol_ints)
    for name, tile, table, norm, launch, ints in (("Qwen3-8B", qwen, False, True, qwen_launch, qwen_ints),
                                                  ("Qwen3-8B", qwen, True, False, qwen_launch, qwen_ints),
                                                  ("SmolLM2", smol, False, False, smol_launch, smol_ints)):
        add(f"verify_attention split {name} table={table} qk_norm={norm}", da._attn_split_kernel, att,
            dict(HAS_TABLE=table, SLIDING=False, CAUSAL=True, HAS_BLOCK_LENS=False, HAS_QK_NORM=norm, WRITE_KV=True,
                 TREE=False, **tile), launch=launch, ints=ints)
    # Draft trees of T = 16 nodes (budget 15, the chain's tile) and T = 32 (budget 31: 128 packed rows).
    for t in (16, 32):
        tile, launch = da._split_tile(t, 4, 128, True)
        tile.update(MIN_CHUNK=da.MIN_CHUNK, LOWP_DOT=True, DOT_PREC="tf32")
        add(f"verify_attention split Qwen3-8B tree T={t}", da._attn_split_kernel, att,
            dict(HAS_TABLE=False, SLIDING=False, CAUSAL=False, HAS_BLOCK_LENS=False, HAS_QK_NORM=True, WRITE_KV=True,
                 TREE=True, **tile), launch=launch, ints=dict(shape_ints(32, 8, 128, t), stride_dn=t, stride_mi=1))
    add("inject_context_kv", ik._inject_kernel,
        dict(k_ptr=bf, v_ptr=bf, knw_ptr=bf, cu_ptr="*i64", lens_ptr="*i64", table_ptr="*i32", inv_freq_ptr=f32,
             kc_ptr=bf, vc_ptr=bf, attention_scaling="fp32", eps="fp32", stride_kcp="i64", stride_vcp="i64"),
        dict(HAS_TABLE=True, BLOCK_M=16, BLOCK_HALF=64, BLOCK_REQ=1))
    norm_args = dict(eps="fp32", stride_x="i64", stride_xn="i64", stride_dn="i64", stride_dt="i64", stride_do="i64",
                     stride_on="i64", stride_ot="i64")
    for res, taps in ((False, 0), (True, 0), (True, 2)):  # taps 2: DFlash2's finish convolution in front
        add(f"add_rms_norm residual={res} conv taps={taps}", lo._add_rms_norm_kernel,
            dict(out_ptr=bf, x_ptr=bf, res_ptr=bf, w_ptr=bf, d_ptr=bf, base_ptr=f32, **norm_args),
            dict(HAS_RESIDUAL=res, TAPS=taps, BLOCK_H=4096), num_warps=8)
    add("add_rms_norm fp32", lo._add_rms_norm_kernel,
        dict(out_ptr=f32, x_ptr=f32, res_ptr=f32, w_ptr=f32, d_ptr=f32, base_ptr=f32, **norm_args),
        dict(HAS_RESIDUAL=True, TAPS=0, BLOCK_H=1024), num_warps=2)
    add("draft_round_setup", cm._draft_round_setup_kernel,
        {name: "*i64"
         for name in ("anchor_ptr", "pos_ptr", "new_ptr", "maxl_ptr", "block_ptr", "start_ptr", "lens_ptr")},
        dict(BLOCK_N=16))
    add("silu_mul", lo._silu_mul_kernel, dict(out_ptr=bf, gu_ptr=bf, stride_gu="i64"), dict(BLOCK_I=1024))
    # The launcher's tiles (_tile) at the decode rows: batch 1 and 8 x block 16 (M = 16, 128) and 64; Qwen3-8B
    # target and z-lab draft share K = 4096, I = 12288 (so do their 16-aligned strides). fp32: IEEE dots.
    # taps 2: DFlash2's prepare convolution in the x-tile load (the draft's MLP: K 2, G 16, bf16 base)
    for (ptr, fp32), m, taps in itertools.product(((bf, False), (f32, True)), (16, 64, 128), (0, 2)):
        tile, warps = gm._tile(m, 4096, 12288, fp32)
        add(f"gate_up_silu M={m} Qwen3-8B {'fp32 ieee' if fp32 else 'bf16'} conv taps={taps}",
            gm._gate_up_silu_kernel, dict(out_ptr=ptr, x_ptr=ptr, w_ptr=ptr, d_ptr=ptr, base_ptr=ptr),
            dict(LOWP_DOT=not fp32, DOT_PREC="ieee" if fp32 else "tf32", TAPS=taps, **tile), num_warps=warps,
            ints=dict(M=m, K=4096, I=12288, B=1 if taps == 0 else 16, G=1 if taps == 0 else 16, stride_xm=4096,
                      stride_xn=0 if taps == 0 else 16 * 4096, stride_wn=4096, stride_om=12288,
                      stride_dn=0 if taps == 0 else 16 * 1024, stride_dt=0 if taps == 0 else 1024,
                      stride_do=0 if taps == 0 else 256))
    # qkv_proj: the launcher's tiles (_tile) at the draft step's rows, block + context rows of batch 1 and 8 x block
    # 16 (M = 32, 256) and batch 4 (128); Qwen3-8B's draft layer (K 4096, N 6144, 4096 Q columns); taps 2: DFlash2's prepare
    # convolution of the block rows in the x-tile load (K 2, G 16)
    for (ptr, fp32), m, taps in itertools.product(((bf, False), (f32, True)), (32, 128, 256), (0, 2)):
        tile, launch = qp._tile(m, fp32)
        add(f"qkv_proj M={m} Qwen3-8B {'fp32 ieee' if fp32 else 'bf16'} conv taps={taps}",
            qp._qkv_proj_kernel, dict(out_ptr=ptr, x_ptr=ptr, w_ptr=ptr, d_ptr=ptr, base_ptr=ptr),
            dict(LOWP_DOT=not fp32, DOT_PREC="ieee" if fp32 else "tf32", TAPS=taps, **tile), launch=launch,
            ints=dict(M=m, K=4096, N=6144, Q_COLS=4096, Q_ROWS=m // 2, B=1 if taps == 0 else 16,
                      G=1 if taps == 0 else 16, stride_xm=4096, stride_wn=4096, stride_om=6144,
                      stride_dn=0 if taps == 0 else 16 * 1024, stride_dt=0 if taps == 0 else 1024,
                      stride_do=0 if taps == 0 else 256))

    # Draft trees at budget 64 (T = 65) over a full Qwen3 draft vocabulary (151,936 ids: 75 splits of 2048).
    add("build_tree top-K partial", tr._topk_partial_kernel, dict(z_ptr=bf, pval_ptr=f32, pidx_ptr="*i32",
                                                                  stride_r="i64", stride_p="i64"), dict(BLOCK_V=2048))
    add("build_tree top-K merge", tr._topk_merge_kernel,
        dict(pval_ptr=f32, pidx_ptr="*i32", lse_ptr=f32, lp_ptr=f32, ids_ptr="*i32"), dict(BLOCK_SK=8192))
    add("build_tree enumerate", tr._tree_enumerate_kernel,
        dict(lp_ptr=f32, ids_ptr="*i32", anchor_ptr="*i64", vocab_ptr="*i64", tok_ptr="*i64", par_ptr="*i64",
             dep_ptr="*i64"), dict(HAS_VOCAB=True, BLOCK_T=128))
    add("tree_ancestor_mask", tr._ancestor_mask_kernel, dict(par_ptr="*i64", mask_ptr="*i64", stride_pr="i64"),
        dict(BLOCK_T=128, BLOCK_W=2))
    for sample in (False, True):
        add(f"tree walk sample={sample}", tr._tree_walk_kernel,
            dict(pval_ptr=f32, pidx_ptr="*i32", tok_ptr="*i64", par_ptr="*i64", path_ptr="*i64", acc_ptr="*i64",
                 bonus_ptr="*i64", stride_tr="i64", stride_pr="i64"),
            dict(SAMPLE=sample, BLOCK_REQ=16, BLOCK_T=128, BLOCK_S=32))
    add("tree_graft_lookup", tr._graft_lookup_kernel,
        dict(tok_ptr="*i64", par_ptr="*i64", dep_ptr="*i64", seq_ptr="*i64", len_ptr="*i64", otok_ptr="*i64",
             opar_ptr="*i64", odep_ptr="*i64", stride_tok="i64", stride_par="i64", stride_dep="i64",
             stride_seq="i64"), dict(MAX_N=4, MIN_N=1, BLOCK_C=128, BLOCK_T=128, BLOCK_K=8))
    add("tree_compact", tr._tree_compact_kernel,
        dict(k_ptr=bf, v_ptr=bf, path_ptr="*i64", acc_ptr="*i64", start_ptr="*i64", bidx_ptr="*i64",
             stride_l="i64", stride_b="i64"), dict(HAS_BATCH_IDX=True, BLOCK_B=16, BLOCK_D=128))

    # DFlash2 (Qwen3-8B width H 4096, 2 taps, the launcher's 1024-column tiles; the selector over a full Qwen3
    # vocabulary in 1024-id tiles, top-k 16, rank 256), greedy and sampled.
    add("grouped_dynamic_conv", dc._grouped_dynamic_conv_kernel,
        dict(out_ptr=bf, x_ptr=bf, d_ptr=bf, base_ptr=bf, stride_xn="i64", stride_xt="i64", stride_dn="i64",
             stride_dt="i64", stride_do="i64"), dict(TAPS=2, BLOCK_C=1024))
    # dynamic_conv_prepare: the launcher's tiles at M = 16 and 128 rows (batch 1 and 8 x block 16), 2 taps, G 16
    for (ptr, fp32), m in itertools.product(((bf, False), (f32, True)), (16, 128)):
        tile, warps = cp._tile(m, 2, 256, 16, fp32)
        add(f"dynamic_conv_prepare M={m} Qwen3-8B {'fp32 ieee' if fp32 else 'bf16'}", cp._dynamic_conv_prepare_kernel,
            dict(out_ptr=ptr, dyn_ptr=ptr, x_ptr=ptr, w_ptr=ptr, base_ptr=f32, stride_xn="i64", stride_xt="i64",
                 stride_w="i64"),
            dict(TAPS=2, LOWP_DOT=not fp32, DOT_PREC="ieee" if fp32 else "tf32", **tile), num_warps=warps)
    for sample in (False, True):
        add(f"candidate_select sample={sample}", cs._candidate_select_kernel,
            dict(path_ptr="*i64", cand_ptr="*i64", q_ptr=f32, logits_ptr=bf, proj_ptr=bf, pred_ptr=bf, succ_ptr=bf,
                 anchor_ptr="*i64", temp_ptr=f32 if sample else bf, seed_ptr="*i64", offset_ptr="*i64",
                 stride_ln="i64", stride_lp="i64", stride_pn="i64", stride_pp="i64", stride_pred="i64",
                 stride_succ="i64", stride_anchor="i64", stride_temp="i64"),
            dict(SAMPLE=sample, NO_ID=cs._NO_ID, STREAM=cs.SELECTOR_STREAM, BLOCK_V=1024, BLOCK_K=16, BLOCK_R=256))
    return out


def main():
    plan = configs()
    if "--list" in sys.argv[1:]:
        for label, fn, *_ in plan:
            print(f"{fn.__name__}\t{label}")
        return
    for label, fn, types, consts, launch, ints in plan:
        compile_one(label, fn, types, consts, launch, with_spills="--spills" in sys.argv[1:], ints=ints)


if __name__ == "__main__":
    main()
