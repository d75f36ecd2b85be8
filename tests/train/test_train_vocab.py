"""dflash_apps.train.vocab: the draft vocabulary chosen from response-token frequencies."""
from __future__ import annotations

import pytest
import torch

from dflash.model import DFlashDraftModel
from dflash_apps.train import main as train_main
from dflash_apps.train.vocab import choose_subset, coverage_of, response_token_counts, with_draft_vocab
from helpers.tiny_models import make_draft, make_target


def _records():
    # prompt tokens (never counted) then responses: 7 x4, 3 x3, 9 x2, 1 x1, 2 x1 (ties 1/2 -> smaller id first)
    return [{"ids": torch.tensor([40, 41, 7, 7, 3, 9], dtype=torch.int32), "prompt_len": 2},
            {"ids": torch.tensor([42, 7, 7, 3, 3, 9, 1, 2], dtype=torch.int32), "prompt_len": 1}]


def test_counts_only_response_tokens():
    counts = response_token_counts(_records(), vocab=48)
    assert counts.sum() == 11 and counts[40] == counts[41] == counts[42] == 0
    assert (counts[7], counts[3], counts[9], counts[1], counts[2]) == (4, 3, 2, 1, 1)


@pytest.mark.parametrize("coverage, expected", [(0.3, [7]), (4 / 11, [7]), (0.5, [3, 7]), (9 / 11, [3, 7, 9]),
                                                 (10 / 11, [1, 3, 7, 9]), (1.0, [1, 2, 3, 7, 9])])
def test_fewest_most_frequent_ids_reaching_the_coverage(coverage, expected):
    counts = response_token_counts(_records(), vocab=48)
    ids = choose_subset(counts, coverage=coverage)
    assert ids.tolist() == expected
    assert coverage_of(ids, counts) >= coverage - 1e-12
    if len(expected) > 1:  # one id fewer would not reach it
        top = choose_subset(counts, size=len(expected) - 1)
        assert coverage_of(top, counts) < coverage


def test_size_and_tie_rule():
    counts = response_token_counts(_records(), vocab=48)
    assert choose_subset(counts, size=4).tolist() == [1, 3, 7, 9]  # 1 beats 2 on the tie
    assert choose_subset(counts, size=6).tolist() == [0, 1, 2, 3, 7, 9]  # then zero counts, smallest ids


@pytest.mark.parametrize("kwargs, needle", [({}, "exactly one"), ({"coverage": 0.5, "size": 2}, "exactly one"),
                                            ({"coverage": 0.0}, "coverage"), ({"coverage": 1.5}, "coverage"),
                                            ({"size": 0}, "size"), ({"size": 49}, "size")])
def test_bad_arguments(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        choose_subset(response_token_counts(_records(), vocab=48), **kwargs)


def test_out_of_range_ids_named():
    with pytest.raises(ValueError, match=r"\[0, 8\)"):
        response_token_counts(_records(), vocab=8)


def test_subset_draft_keeps_the_network_and_round_trips(tmp_path):
    target = make_target("qwen3")
    draft = make_draft(target, block_size=4)
    ids = torch.tensor([1, 3, 7, 9, 20])
    sub = with_draft_vocab(draft, ids)
    for name, p in draft.state_dict().items():
        assert torch.equal(sub.state_dict()[name], p), name
    hidden = torch.randn(2, 4, 32)
    proposals = sub.propose(hidden, target.lm_head)
    # the argmax over the subset's rows of the full logits, mapped back to target ids
    full = draft.compute_logits(hidden[:, 1:], target.lm_head)
    assert torch.equal(proposals, ids[full[..., ids].argmax(-1)])
    sub.save_pretrained(tmp_path)
    again = DFlashDraftModel.from_pretrained(tmp_path)
    assert torch.equal(again.draft_token_ids, ids) and again.config.draft_vocab_size == 5
    with pytest.raises(ValueError, match="already has a vocabulary subset"):
        with_draft_vocab(sub, ids)


def test_cli_writes_the_subset_draft(tmp_path, capsys):
    target = make_target("qwen3")
    make_draft(target, block_size=4).save_pretrained(tmp_path / "full")
    for name in ("train", "eval"):
        (tmp_path / name).mkdir()
        torch.save(_records(), tmp_path / name / "shard_00000.pt")
    assert train_main(["vocab", str(tmp_path / "full"), str(tmp_path / "sub"), "--data", str(tmp_path / "train"),
                       "--eval", str(tmp_path / "eval"), "--coverage", "0.5", "--vocab", "48"]) == 0
    out = capsys.readouterr().out
    assert "2 of 48 ids" in out and "held-out" in out
    assert DFlashDraftModel.from_pretrained(tmp_path / "sub").draft_token_ids.tolist() == [3, 7]


def test_cli_includes_another_drafts_vocabulary(tmp_path, capsys):
    target = make_target("qwen3")
    make_draft(target, block_size=4).save_pretrained(tmp_path / "full")
    with_draft_vocab(make_draft(target, block_size=4), torch.tensor([3, 20, 30])).save_pretrained(tmp_path / "old")
    (tmp_path / "train").mkdir()
    torch.save(_records(), tmp_path / "train" / "shard_00000.pt")
    args = ["vocab", str(tmp_path / "full"), str(tmp_path / "sub"), "--data", str(tmp_path / "train"), "--coverage",
            "0.5", "--vocab", "48"]
    assert train_main(args + ["--include", str(tmp_path / "old")]) == 0
    assert "4 of 48 ids (2 chosen from the data" in capsys.readouterr().out
    assert DFlashDraftModel.from_pretrained(tmp_path / "sub").draft_token_ids.tolist() == [3, 7, 20, 30]
    assert train_main(args + ["--include", str(tmp_path / "full")]) == 2  # no subset there: a one-line error
    assert "has no vocabulary subset" in capsys.readouterr().err
