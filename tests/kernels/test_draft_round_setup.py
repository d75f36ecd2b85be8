import pytest
import torch

from dflash_kernels import draft_round_setup
from dflash_kernels.commit import draft_round_setup_reference

BACKENDS = ["torch", "triton"]


def _state(n, b, seed):
    g = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, 5000, (n,), generator=g)
    return dict(anchor=torch.randint(0, 150000, (n,), generator=g), positions=positions,
                num_new=torch.randint(0, b + 1, (n,), generator=g).clamp(max=positions),
                # around the positions: finished (<= position), inside the last block, far away
                max_lengths=positions + torch.randint(-3, 2 * b, (n,), generator=g))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n,b", [(0, 4), (1, 16), (37, 5), (1500, 16)])
def test_matches_definition(backend, n, b, seed):
    s = _state(n, b, seed)
    padded = torch.full((n, b + 2), -7, dtype=torch.long)
    block = padded[:, 1:-1]  # strided rows, sentinel columns around
    start = torch.full((n,), -9, dtype=torch.long)
    lens = torch.full((n,), -9, dtype=torch.long)
    draft_round_setup(**s, block=block, context_start=start, block_lens=lens, backend=backend)
    assert torch.equal(block[:, 0], s["anchor"])
    assert (padded[:, 0] == -7).all() and (block[:, 1:] == -7).all() and (padded[:, -1] == -7).all()
    assert torch.equal(start, s["positions"] - s["num_new"])
    room = s["max_lengths"] - s["positions"]
    assert torch.equal(lens, torch.where(room < 1, 1, torch.where(room > b, b, room)))


def test_reference_is_the_definition_a_wrong_rule_fails(seed):
    """The check above can fail: a clamp to [0, B] (not [1, B]) differs on finished requests."""
    s = _state(64, 8, seed)
    lens = torch.empty(64, dtype=torch.long)
    draft_round_setup_reference(**s, block=torch.zeros(64, 8, dtype=torch.long), context_start=torch.empty_like(lens),
                                block_lens=lens)
    assert not torch.equal(lens, (s["max_lengths"] - s["positions"]).clamp(0, 8))


def test_bad_inputs(seed):
    s = _state(4, 8, seed)
    out = dict(block=torch.zeros(4, 8, dtype=torch.long), context_start=torch.zeros(4, dtype=torch.long),
               block_lens=torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="positions must be a contiguous \\[N=4\\]"):
        draft_round_setup(**{**s, "positions": s["positions"][:3]}, **out)
    with pytest.raises(TypeError, match="num_new has dtype"):
        draft_round_setup(**{**s, "num_new": s["num_new"].int()}, **out)
    with pytest.raises(ValueError, match="block must be \\[N, B\\] with B >= 1"):
        draft_round_setup(**s, **{**out, "block": torch.zeros(4, 0, dtype=torch.long)})
    with pytest.raises(ValueError, match="block_lens must be a contiguous"):
        draft_round_setup(**s, **{**out, "block_lens": torch.zeros(8, dtype=torch.long)[::2]})
