"""Fuzz every public op of dflash_kernels and its registered ``torch.ops.dflash.*`` form on every CPU backend.

Cases come from hypothesis (shapes including 0-sized and odd ones, fp32/bf16, int32/int64 indices, strided and
transposed views, negative / past-the-end / huge index values); each runs in the crash-isolated worker and must
either raise a clean Python error or equal the torch reference (the rule: ``helpers.fuzz.cases`` module docstring).
"""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from helpers.fuzz.settings import fuzz_settings

pytestmark = pytest.mark.fuzz

# Mutation groups (one test each, so that a finding's strict xfail covers exactly its kind of input):
# "none": valid index values (shapes, dtypes, layouts, ties still vary); "int32": int32 where the op reads indices;
# "bad_index": one index negative, past the end or huge. Ops whose inputs carry no index get "bad_extent" instead.
MUTATIONS = {"none": ["none"], "int32": ["int32"], "bad_index": ["negative", "past_end", "huge"]}
EXTENT = {"none": ["none"], "bad_extent": ["past_end"]}
DTYPES = ["fp32", "fp32", "bf16"]  # fp32 first and twice: the native kernels take fp32 only
LAYOUTS = ["contiguous", "contiguous", "strided", "transposed"]


def _ints(lo, hi):
    return st.integers(lo, hi)


# op -> (knob strategies, its backends on CPU, its mutation groups)
KNOBS = {
    "verify_greedy": (dict(n=_ints(0, 4), b=_ints(1, 6), v=_ints(1, 300), ties=st.booleans(),
                           layout=st.sampled_from(LAYOUTS)),
                      ("ext", "triton", "cpu", "torch"), MUTATIONS),
    "verify_greedy_tokens": (dict(n=_ints(0, 4), b=_ints(1, 6), v=_ints(1, 1000),
                                  draft_dtype=st.sampled_from(["i32", "i64"])),
                             ("triton", "cpu", "torch"), MUTATIONS),
    "add_rms_norm": (dict(lead=st.lists(_ints(0, 5), max_size=2), h=_ints(1, 130), residual=st.booleans(),
                          layout=st.sampled_from(LAYOUTS)),
                     ("triton", "cpu", "torch"), EXTENT),
    "silu_mul": (dict(lead=st.lists(_ints(0, 5), max_size=2), i=_ints(1, 70), layout=st.sampled_from(LAYOUTS)),
                 ("triton", "cpu", "torch"), EXTENT),
    "build_tree": (dict(r=_ints(0, 3), p=_ints(1, 5), v=_ints(1, 40), budget=_ints(0, 30), vocab_ids=st.booleans(),
                        ties=st.booleans(), layout=st.sampled_from(["contiguous", "strided"])),
                   ("triton", "cpu", "torch"), {"none": ["none"], "int32": ["int32"], "bad_extent": ["past_end"]}),
    "tree_ancestor_mask": (dict(r=_ints(0, 3), t=_ints(1, 140), layout=st.sampled_from(["contiguous", "strided"])),
                           ("triton", "cpu", "torch"), MUTATIONS),
    "tree_accept_greedy_tokens": (dict(r=_ints(0, 3), t=_ints(1, 20), v=_ints(1, 50), block_size=_ints(0, 8),
                                       target_dtype=st.sampled_from(["i32", "i64"])),
                                  ("triton", "cpu", "torch"), MUTATIONS),
    "tree_accept_greedy": (dict(r=_ints(0, 3), t=_ints(1, 20), v=_ints(1, 50), block_size=_ints(0, 8),
                                logits=st.just(True)),
                           ("triton", "cpu", "torch"), MUTATIONS),
    "tree_compact": (dict(layers=_ints(1, 2), r=_ints(0, 3), t=_ints(1, 10), kvh=_ints(1, 2),
                          d=st.sampled_from([1, 2, 8, 16]),
                          bsz=_ints(1, 6), spare_rows=_ints(0, 2), cap=_ints(1, 24), batch_idx=st.booleans(),
                          target=st.sampled_from(["start", "accepted", "batch_idx"])),
                     ("triton", "cpu", "torch"), MUTATIONS),
    "tree_graft_lookup": (dict(r=_ints(0, 3), t=_ints(1, 20), cap=_ints(0, 60), v=_ints(1, 4), depth=_ints(0, 8),
                               max_ngram=_ints(1, 8), min_ngram=_ints(1, 4),
                               layout=st.sampled_from(["contiguous", "strided"])),
                          ("triton", "cpu", "torch"), MUTATIONS),
}
_ATTN = dict(n=_ints(0, 3), b=_ints(1, 5), kvh=_ints(1, 2), g=_ints(1, 2), d=st.sampled_from([16, 32, 8, 2, 4]),
             cap=_ints(1, 24), spare_rows=_ints(0, 2), batch_idx=st.booleans(), qk_norm=st.booleans(),
             overflow=st.booleans(), target=st.sampled_from(["cache_lens", "batch_idx"]),
             layout=st.sampled_from(LAYOUTS))
KNOBS["verify_attention"] = (dict(_ATTN, tree=st.booleans()), ("triton", "cpu", "torch"), MUTATIONS)
KNOBS["draft_attention"] = (dict(_ATTN, block_lens=st.booleans(), window=st.one_of(st.none(), _ints(1, 6))),
                            ("triton", "cpu", "torch"), MUTATIONS)

KNOBS["inject_context_kv"] = (
    dict(n=_ints(0, 3), kvh=_ints(1, 2), d=st.sampled_from([16, 32, 8, 2]), cap=_ints(1, 16), max_rows=_ints(0, 6),
         extra_rows=_ints(0, 2), spare_rows=_ints(0, 2), batch_idx=st.booleans(),
         target=st.sampled_from(["cache_lens", "batch_idx", "cu_ctx_lens"]),
         layout=st.sampled_from(["contiguous", "contiguous", "strided"])),
    ("triton", "cpu", "torch"), MUTATIONS)
KNOBS["commit_round"] = (
    dict(r=_ints(0, 4), b=_ints(1, 6), cap=_ints(0, 20), stops=st.sampled_from(["none", "shared", "per_request"]),
         target=st.sampled_from(["accepted", "lengths", "max_lengths"])),
    ("ext", "cpu", "torch"), MUTATIONS)
KNOBS["draft_round_setup"] = (dict(n=_ints(0, 5), b=_ints(1, 9), layout=st.sampled_from(["contiguous", "transposed"])),
                              ("triton", "torch"), {"none": ["none"], "int32": ["int32"]})
KNOBS["gate_up_silu"] = (dict(lead=st.lists(_ints(0, 5), max_size=2), k=_ints(1, 70), i=_ints(1, 40),
                              layout=st.sampled_from(LAYOUTS)),
                         ("triton", "torch"), EXTENT)
KNOBS["fused_context"] = (dict(n=_ints(0, 5), h=_ints(1, 40), taps=_ints(1, 4),
                               form=st.sampled_from(["list", "stacked", "concat"])),
                          ("triton", "torch"), EXTENT)
_SAMPLING = dict(r=_ints(0, 3), t=_ints(1, 6), v=_ints(1, 300), temperature=st.sampled_from([1.0, 0.5, 2.0]),
                 top_k=st.sampled_from([0, 1, 5]), top_p=st.sampled_from([1.0, 0.9, 0.3]))
KNOBS["verify_sample"] = (_SAMPLING, ("triton", "torch"), MUTATIONS)
KNOBS["tree_accept_sample"] = (dict(_SAMPLING, block_size=_ints(0, 6)), ("triton", "torch"), {"none": ["none"]})
# DFlash2: verify_sample with the selector's sparse draft distribution, and the selector itself (greedy, sampled)
KNOBS["verify_sample_sparse"] = (
    dict(_SAMPLING, k=st.sampled_from([1, 3, 16, 64, 65]), probs_fp64=st.booleans(),
         draft_dtype=st.sampled_from(["i32", "i64"])),
    ("triton", "torch"),
    dict(MUTATIONS, bad_form=["probs_only", "probs_dtype", "indices_dtype", "shape"]))
KNOBS["dynamic_conv_prepare"] = (
    dict(n=_ints(0, 3), b=_ints(1, 6), taps=_ints(1, 4), groups=_ints(1, 8), g=_ints(1, 6),
         layout=st.sampled_from(["contiguous", "strided"])),
    ("triton", "cpu", "torch"), EXTENT)
KNOBS["gate_up_silu_conv"] = (
    dict(n=_ints(0, 3), b=_ints(1, 6), taps=_ints(1, 4), groups=_ints(1, 8), g=_ints(1, 6), i=_ints(1, 20),
         layout=st.sampled_from(["contiguous", "strided"])),
    ("triton", "torch"), EXTENT)
KNOBS["candidate_select"] = (
    dict(n=_ints(0, 3), p=_ints(0, 5), v=_ints(1, 300), r=_ints(1, 40), top_k=st.sampled_from([1, 2, 5, 16, 64, 65]),
         sampled=st.booleans(), per_request=st.booleans(), ties=st.booleans(),
         layout=st.sampled_from(["contiguous", "strided"])),
    ("triton", "cpu", "torch"),
    dict(MUTATIONS, bad_form=["rank", "vocab", "anchor_dtype", "temp_shape", "out_shape", "out_overlap"]))

# CI examples per test: the interpreter runs a Triton kernel in ~0.1-2 s, the others take milliseconds.
EXAMPLES = {"triton": 8, "ext": 40, "cpu": 50, "torch": 20}

# (op, path, backend, mutation group) -> the finding that still fails there (drop the entry when its fix lands).
KNOWN: dict[tuple[str, str, str, str], str] = {}


def _params():
    for op, (_, backends, groups) in KNOBS.items():
        for path in ("public", "registered"):
            for backend in backends:
                for group in groups:
                    key = (op, path, backend, group)
                    marks = [pytest.mark.xfail(strict=True, reason=KNOWN[key])] if key in KNOWN else []
                    yield pytest.param(*key, id="-".join(key), marks=marks)


def case_strategy(op: str, path: str, backend: str, group: str):
    knobs, _, groups = KNOBS[op]
    return st.fixed_dictionaries(dict(knobs, op=st.just(op), path=st.just(path), backend=st.just(backend),
                                      seed=_ints(0, 2**31 - 1), dtype=st.sampled_from(DTYPES),
                                      mutation=st.sampled_from(groups[group])))


@pytest.mark.parametrize("op,path,backend,group", list(_params()))
def test_fuzz_op(op, path, backend, group, run_case):
    @fuzz_settings(EXAMPLES[backend])
    @given(case=case_strategy(op, path, backend, group))
    def check(case):
        run_case(case)

    check()
