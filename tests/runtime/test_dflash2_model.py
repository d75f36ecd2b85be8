"""DFlash2 drafts: config keys and their errors, checkpoint layouts (z-lab published, transformers-saved,
speculators ``dflash2``), the convolution and selector against direct definitions, and the runtimes' choices
(both runtimes run it greedily, sampling runs on the reference, trees refuse it with a clear error)."""
from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash import DFlash2DraftModel, DFlashConfig, DFlashDraftModel, generate
from dflash.config import DFlash2Settings
from dflash.dflash2 import GroupedDynamicCausalConv
from dflash.draft import RMSNorm
from dflash_apps import cli, smollm2, zlab_cli

from test_speculators import write_speculators
from helpers.tiny_models import VOCAB, make_draft, make_target
from helpers.tol import assert_within_rule

D2 = DFlash2Settings(conv_kernel_size=3, conv_group_size=8, selector_rank=12, selector_top_k=6)


def make_dflash2(target, *, block_size: int = 8, settings: DFlash2Settings = D2, layers: int = 2,
                 mask_token_id: int = 5) -> DFlash2DraftModel:
    """A random DFlash2 draft for ``target``: random base kernels and norms, so every tensor matters."""
    tcfg = target.config
    config = DFlashConfig(
        hidden_size=tcfg.hidden_size, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        head_dim=tcfg.hidden_size // 4, intermediate_size=48, num_target_layers=tcfg.num_hidden_layers,
        block_size=block_size, mask_token_id=mask_token_id, vocab_size=tcfg.vocab_size, dflash2=settings,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    draft = DFlash2DraftModel(config)
    draft.reset_parameters(std=0.2)
    with torch.no_grad():
        for module in draft.modules():
            if isinstance(module, GroupedDynamicCausalConv):
                module.base_kernel.normal_(0, 0.5)
            if isinstance(module, RMSNorm):
                module.weight.uniform_(0.5, 1.5)
    return draft.eval()


def test_config_round_trip_and_key_errors():
    draft = make_dflash2(make_target("qwen3"))
    raw = draft.config.to_dict()
    assert raw["architectures"] == ["DFlash2DraftModel"]
    assert {k: raw["dflash_config"][k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank",
                                                 "selector_top_k")} == {"conv_kernel_size": 3, "conv_group_size": 8,
                                                                        "selector_rank": 12, "selector_top_k": 6}
    assert DFlashConfig.from_dict(raw).dflash2 == D2
    top_level = {**raw, "dflash_config": {k: v for k, v in raw["dflash_config"].items() if k != "selector_rank"},
                 "selector_rank": 12}
    assert DFlashConfig.from_dict(top_level).dflash2 == D2  # the official lookup falls back to the top level
    without = {**raw, "dflash_config": {k: v for k, v in raw["dflash_config"].items() if k != "selector_top_k"}}
    with pytest.raises(ValueError, match=r"missing \['selector_top_k'\]"):
        DFlashConfig.from_dict(without)
    bad = [({"conv_group_size": 5}, "conv_group_size=5 must divide hidden_size=32"),
           ({"selector_top_k": VOCAB + 1}, f"selector_top_k={VOCAB + 1} exceeds vocab_size={VOCAB}"),
           ({"conv_kernel_size": 0}, "conv_kernel_size must be a positive integer"),
           ({"selector_rank": True}, "selector_rank must be a positive integer"),
           ({"sample_from_anchor": True}, "sample_from_anchor to false"),
           ({"draft_vocab_size": 16}, "draft_vocab_size to null")]
    for edit, message in bad:
        with pytest.raises(ValueError, match=message):
            DFlashConfig.from_dict({**raw, "dflash_config": {**raw["dflash_config"], **edit}})
    with pytest.raises(ValueError, match="needs vocab_size"):
        DFlashConfig.from_dict({**raw, "vocab_size": None})


def test_classes_refuse_the_other_kind_of_config(tmp_path):
    target = make_target("qwen3")
    d2 = make_dflash2(target)
    with pytest.raises(ValueError, match="DFlash2 draft, which DFlashDraftModel does not run.*DFlash2DraftModel"):
        DFlashDraftModel(d2.config)
    v1 = make_draft(target)
    with pytest.raises(ValueError, match="a DFlash draft, which DFlash2DraftModel does not run.*DFlashDraftModel"):
        DFlash2DraftModel(v1.config)
    v1.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="build it with dflash.DFlashDraftModel"):
        DFlash2DraftModel.from_pretrained(tmp_path)


@pytest.mark.parametrize("codebook_suffix", ["", ".weight"], ids=["published", "transformers"])
def test_checkpoint_layouts_round_trip(tmp_path, codebook_suffix):
    draft = make_dflash2(make_target("qwen3"))
    draft.save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    stored = load_file(path)
    assert "candidate_selector.predecessor_codebook" in stored  # saved in the published layout
    assert stored["layers.1.mlp_conv.kernel_projection.weight"].shape == (2 * 3 * 32 // 8, 32)
    assert stored["layers.0.attention_conv.base_kernel"].shape == (2, 3, 32)
    assert stored["candidate_selector.successor_codebook"].shape == (VOCAB, 12)
    assert stored["candidate_selector.hidden_projection.weight"].shape == (12, 32)
    save_file({(k + codebook_suffix if "codebook" in k else k): v for k, v in stored.items()}, str(path))
    for cls in (DFlash2DraftModel, DFlashDraftModel):
        loaded = cls.from_pretrained(tmp_path)
        assert type(loaded) is DFlash2DraftModel
        assert loaded.state_dict().keys() == draft.state_dict().keys()
        assert all(torch.equal(loaded.state_dict()[k], v) for k, v in draft.state_dict().items())


def test_checkpoint_shape_errors_name_the_tensor(tmp_path):
    draft = make_dflash2(make_target("qwen3"))
    draft.save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    stored = load_file(path)
    stored["candidate_selector.hidden_projection.weight"] = torch.zeros(13, 32)
    save_file(stored, str(path))
    with pytest.raises(ValueError, match=r"candidate_selector.hidden_projection.weight: checkpoint \[13, 32\], "
                                         r"config implies \[12, 32\] \(selector_rank=12"):
        DFlash2DraftModel.from_pretrained(tmp_path)
    del stored["candidate_selector.hidden_projection.weight"]
    del stored["layers.0.mlp_conv.base_kernel"]
    save_file(stored, str(path))
    with pytest.raises(ValueError, match="missing tensors.*layers.0.mlp_conv.base_kernel"):
        DFlash2DraftModel.from_pretrained(tmp_path)


def test_dflash2_weights_under_a_dflash_config_say_so(tmp_path):
    draft = make_dflash2(make_target("qwen3"))
    draft.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["architectures"] = ["DFlashDraftModel"]  # e.g. a config written by hand
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r'describes a DFlash draft.*these are DFlash2 tensors: set architectures to '
                                         r'\["DFlash2DraftModel"\]'):
        DFlashDraftModel.from_pretrained(tmp_path)


def test_speculators_dflash2_checkpoint_runs_like_zlab(tmp_path):
    target = make_target("qwen3")
    draft = make_dflash2(target)
    keys = dict(speculators_model_type="dflash2", architectures=["DFlash2DraftModel"],
                **{k: getattr(D2, k) for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")})
    folder = write_speculators(tmp_path / "spec", draft, target, config_edits=keys)
    loaded = DFlashDraftModel.from_pretrained(folder)
    assert type(loaded) is DFlash2DraftModel and loaded.config.dflash2 == D2
    prompt = torch.randint(0, VOCAB, (1, 6))
    a = generate(target, draft, prompt, 15, backend="reference")
    b = generate(target, loaded, prompt, 15, backend="reference")
    assert torch.equal(a.sequences, b.sequences) and a.acceptance_lengths == b.acceptance_lengths
    raw = json.loads((folder / "config.json").read_text())
    for key in ("selector_rank", "selector_top_k"):
        del raw[key]  # speculators' defaults fill them: rank 256, top-k 16
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"successor_codebook: checkpoint \[48, 12\], config "
                                         r"implies \[48, 256\]"):
        DFlashDraftModel.from_pretrained(folder)


def test_selector_walks_from_the_anchor(seed):
    target = make_target("qwen3")
    draft = make_dflash2(target)
    selector = draft.candidate_selector
    hidden = torch.randn(1, 7, 32)
    logits = torch.randn(1, 7, VOCAB)
    anchor = torch.tensor([11])
    path, candidates, q = selector.select(hidden, logits, anchor)
    assert q is None and path.shape == (1, 7) and candidates.shape == (1, 7, 6)
    prev = 11
    for i in range(7):
        cand = candidates[0, i]
        assert set(cand.tolist()) == set(torch.topk(logits[0, i], 6).indices.tolist())
        u = selector.hidden_projection(hidden[0, i])
        scores = logits[0, i, cand] + (selector.predecessor_codebook[prev] * u * selector.successor_codebook[cand]).sum(-1)
        prev = int(cand[scores.argmax()])
        assert int(path[0, i]) == prev
    sampled_path, _, q = selector.select(hidden, logits, anchor, temperature=0.7,
                                         generator=torch.Generator().manual_seed(seed))
    assert q.shape == (1, 7, 6) and torch.allclose(q.sum(-1), torch.ones(1, 7))
    assert all(int(sampled_path[0, i]) in candidates[0, i].tolist() for i in range(7))


def test_runtimes_choose_and_refuse_clearly():
    target = make_target("qwen3")
    draft = make_dflash2(target)
    prompt = torch.randint(0, VOCAB, (1, 5))
    expected = target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False)
    ref = generate(target, draft, prompt, 12, backend="reference")
    auto = generate(target, draft, prompt, 12)
    assert torch.equal(ref.sequences, expected) and torch.equal(auto.sequences, expected)
    assert ref.acceptance_lengths == auto.acceptance_lengths
    for kernel_backend in ("cpu", "triton"):  # the engine's DFlash2 ops: references, then the Triton kernels
        fast = generate(target, draft, prompt, 12, backend="fast", kernel_backend=kernel_backend)
        assert torch.equal(fast.sequences, expected) and fast.acceptance_lengths == ref.acceptance_lengths
    sampled = generate(target, draft, prompt, 12, temperature=0.7, seed=3)  # auto: the engine, sampling too
    assert torch.equal(sampled.sequences, generate(target, draft, prompt, 12, temperature=0.7, seed=3,
                                                   backend="fast").sequences)
    for backend in ("reference", "fast"):
        with pytest.raises(ValueError, match="tree_budget needs a DFlash draft.*pass tree_budget=None"):
            generate(target, draft, prompt, 12, backend=backend, tree_budget=4)
    with pytest.raises(TypeError, match="select_block"):
        draft.propose(torch.zeros(1, 8, 32), target.lm_head)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_blocks_convolve_each_block_alone(dtype):
    """Blocks packed into one call with a mask (as ``dflash train`` packs them) give each block the rows it gets
    alone: the convolution never reaches across a block boundary; a row count that is not whole blocks is refused."""
    torch.manual_seed(0)
    target = make_target("qwen3")
    draft64 = make_dflash2(target).double()
    B, C, n = draft64.config.block_size, 3, 3
    noise = torch.randn(n, B, 32, dtype=torch.float64)
    target_hidden = torch.randn(1, C, 32 * draft64.config.num_taps, dtype=torch.float64)
    positions = torch.arange(C + B)[None]
    own_block = torch.arange(n).repeat_interleave(B)
    mask = torch.cat([torch.ones(n * B, C, dtype=torch.bool), own_block[:, None] == own_block[None, :]], dim=1)
    packed_positions = torch.cat([positions[:, :C], positions[:, C:].repeat(1, n)], dim=1)

    def alone(model):
        return torch.cat([model(position_ids=positions, noise_embedding=noise[j:j + 1].to(dtype=model.fc.weight.dtype),
                                target_hidden=target_hidden.to(model.fc.weight.dtype)) for j in range(n)], dim=1)

    draft = copy.deepcopy(draft64).to(dtype)
    packed = draft(position_ids=packed_positions, noise_embedding=noise.reshape(1, n * B, 32).to(dtype),
                   target_hidden=target_hidden.to(dtype), attention_mask=mask[None, None])
    assert_within_rule(packed, alone(draft64), alone(draft), f"packed blocks, {dtype}")
    with pytest.raises(ValueError, match=f"not a whole number of blocks of block_size={B}"):
        draft(position_ids=packed_positions[:, :-1], noise_embedding=noise.reshape(1, n * B, 32)[:, :-1].to(dtype),
              target_hidden=target_hidden.to(dtype), attention_fn=lambda q, k, v: q)


@pytest.mark.parametrize("backend", ["reference", "fast"])
def test_target_vocabulary_must_match_the_codebooks(backend):
    draft = make_dflash2(make_target("qwen3"))
    wider = make_target("qwen3", vocab=VOCAB + 16)  # candidates past the codebooks' rows
    with pytest.raises(ValueError, match=f"DFlash2 draft vocab_size {VOCAB} != the target LM head's {VOCAB + 16}"):
        generate(wider, draft, torch.tensor([[1, 2, 3]]), 8, backend=backend)


needs_smollm2 = pytest.mark.skipif(not smollm2.is_available(), reason=smollm2.unavailable_reason() or "")


@pytest.fixture
def smollm2_dflash2(tmp_path):
    """The folder of a random DFlash2 draft for the embedded SmolLM2 target (its DFlash draft's shapes)."""
    base = DFlashConfig.from_json_file(zlab_cli.EMBEDDED_DRAFT)
    config = dataclasses.replace(base, draft_vocab_size=None, dflash2=DFlash2Settings(2, 16, 8, 8))
    DFlash2DraftModel(config).save_pretrained(tmp_path)
    return tmp_path


@needs_smollm2
@pytest.mark.parametrize("runtime", ["fast", "reference"])
def test_cli_generate_runs_a_dflash2_draft(smollm2_dflash2, capsys, runtime):
    """``dflash generate transformers --model smollm2 --draft D`` with a DFlash2 draft D for SmolLM2 prints the
    target's greedy continuation (what any lossless draft gives)."""
    prompt = "What is 2 + 3?"
    code = cli.main(["generate", "transformers", "--model", "smollm2", "--draft", str(smollm2_dflash2),
                     "--max-new-tokens", "10", "--backend", runtime, prompt])
    out, _ = capsys.readouterr()
    target, tok, draft, _ = zlab_cli._load(zlab_cli.EMBEDDED, str(smollm2_dflash2), "cpu", system=None)
    assert type(draft) is DFlash2DraftModel
    ids = zlab_cli._encode(tok, [{"role": "user", "content": prompt}], torch.device("cpu"))
    greedy = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False,
                             eos_token_id=zlab_cli._stop_ids(target, tok))
    text = tok.decode(greedy[0, ids.shape[1]:], skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert code == 0 and out == text + "\n"


@needs_smollm2
@pytest.mark.parametrize("temperature", ["0", "0.8"])
def test_cli_benchmark_runs_a_dflash2_draft(smollm2_dflash2, tmp_path, capsys, temperature):
    """``dflash benchmark transformers --model smollm2 --draft D``, D a DFlash2 draft, greedy and sampled (the
    engine either way): the report, and per request DFlash rounds that account for every token after the first;
    greedy, as many tokens as the autoregressive baseline (both are the target's greedy output)."""
    rows_file = tmp_path / "rows.jsonl"
    code = cli.main(["benchmark", "transformers", "--model", "smollm2", "--draft", str(smollm2_dflash2), "--dataset",
                     "gsm8k", "--max-samples", "2", "--max-new-tokens", "8", "--temperature", temperature,
                     "--output", str(rows_file)])
    out, _ = capsys.readouterr()
    assert code == 0 and "DFlash throughput" in out and "Average acceptance length (tau)" in out
    rows = [json.loads(line) for line in rows_file.read_text().splitlines()]
    assert len(rows) == 2
    for row in rows:
        assert 1 <= row["dflash"]["tokens"] <= 8
        assert sum(row["dflash"]["acceptance_lengths"]) == row["dflash"]["tokens"] - 1
        if temperature == "0":
            assert row["dflash"]["tokens"] == row["baseline"]["tokens"]
