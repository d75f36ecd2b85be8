"""The RoPE tables of the CPU wing: cos and a signed sin for the rows of every request of a call, built once and
shared by the layers of a forward (the attention bodies, the context rows' K/V write, the native forward)."""
from __future__ import annotations

import torch

from dflash_kernels._triton_utils import rope_cos_sin_reference

# The last ROPE_MEMO_SIZE rope_tables_cpu results, newest first, as (key, inv_freq, its values for an inference
# tensor, cos, signed sin); the tuple is replaced whole (thread-safe reads).
ROPE_MEMO_SIZE = 4
_rope_memo: list = [()]


def rope_tables_cpu(lens, b, inv_freq, attention_scaling, dtype, depths=None):
    """cos and ``sin_signed`` ([rows, D], the rows of every request in turn) of the rows' positions, with the
    first half of sin negated so that ``rotate_half(x) * sin == x.roll(D/2, -1) * sin_signed`` exactly (a sign
    flip rounds nothing). Request n's rows sit at ``lens[n] + 0, 1, ...`` (host ints: the lengths the caller
    checked): ``b`` of them (an int), or
    ``b[n]`` (a list: context rows, as ``inject_context_kv`` gets them). The layers of one forward share their
    positions: the last few tables are kept (the draft step alternates its context and block rows) and reused
    while the positions, inv_freq's values, the scaling and the dtype are the same. A tree (``depths`` [N, B])
    puts block row i at ``lens + depths[:, i]`` instead of ``lens + i``."""
    tree = None if depths is None else tuple(depths.reshape(-1).tolist())
    # inv_freq by identity (the memo holds the tensor, so its identity cannot pass to another) and its version
    # counter, which an in-place change bumps; an inference tensor has none: its values are compared instead.
    version = None if inv_freq.is_inference() else inv_freq._version
    key = (tuple(lens), b if isinstance(b, int) else tuple(b), tree, float(attention_scaling), dtype, version)
    memo = _rope_memo[0]
    for entry in memo:
        if (entry[0] == key and entry[1] is inv_freq
                and (version is not None or torch.equal(entry[2], inv_freq))):
            return entry[3], entry[4]
    start = torch.tensor(lens, dtype=torch.int64)  # the host values the caller checked and indexes with
    if isinstance(b, int):
        rows = torch.arange(b) if depths is None else depths.to(torch.int64)
        positions = (start[:, None] + rows).view(-1)
    else:
        positions = torch.cat([torch.arange(c) + start[n] for n, c in enumerate(b)])
    cos, sin = rope_cos_sin_reference(positions, inv_freq, attention_scaling, dtype)
    half = sin.shape[-1] // 2
    sin = torch.cat([-sin[..., :half], sin[..., half:]], -1)
    snapshot = None if version is not None else inv_freq.clone()
    _rope_memo[0] = ((key, inv_freq, snapshot, cos, sin),) + memo[:ROPE_MEMO_SIZE - 1]
    return cos, sin


