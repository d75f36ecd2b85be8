"""``generate(on_tokens=...)`` reports every committed token once, in order, round by round."""
from __future__ import annotations

import io

import pytest
import torch

from dflash import generate
from dflash_apps.zlab_cli import TextStreamer
from helpers.tiny_models import make_draft, make_target


@pytest.mark.parametrize("backend", ["reference", "fast"])
def test_on_tokens_reports_each_round(backend):
    target = make_target("llama")
    draft = make_draft(target, layers=1, block_size=4)
    prompts = [torch.randint(0, 48, (n,)) for n in (5, 8)] if backend == "fast" else [torch.randint(0, 48, (5,))]
    seen: dict[int, list[list[int]]] = {}
    result = generate(target, draft, prompts if backend == "fast" else prompts[0], 13, stop_token_ids=[9],
                      backend=backend, on_tokens=lambda r, ids: seen.setdefault(r, []).append(ids))
    results = result.results if backend == "fast" else [result]
    assert sorted(seen) == list(range(len(prompts)))
    for r, res in enumerate(results):
        chunks = seen[r]
        assert [len(c) for c in chunks] == [1] + res.acceptance_lengths  # the first token, then each round
        assert sum(chunks, []) == res.sequences[0, res.num_prompt_tokens:].tolist()


class ByteTokenizer:
    """Token i is byte i: a multi-byte character spans tokens, as in byte-level BPE."""

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return bytes(ids).decode("utf-8", errors="replace")


def test_text_streamer_holds_back_incomplete_characters():
    out = io.StringIO()
    streamer = TextStreamer(ByteTokenizer(), out)
    data = "né→x".encode()
    pieces = []
    for b in data:
        streamer(0, [b])
        pieces.append(out.getvalue())
    streamer.finish()
    assert out.getvalue() == "né→x\n"
    assert all("\ufffd" not in p for p in pieces)
    assert pieces[0] == "n" and pieces[1] == "n"  # 'é' is two bytes: nothing printed after the first
