"""Known target responses, small enough to keep in the repository: the greedy response token ids of
SmolLM2-135M-Instruct (fp32) to the offline prompts, keyed by the prompt text.

Generating responses is the slow part of ``dflash train data``; with a responses file, a later run
hands the known responses to :func:`dflash_apps.train.data.generate_batch_known`, so a prompt already
answered costs one teacher-forced pass (which also recomputes the features and checks every stored
token against the target's own greedy choice: a stale or wrong response is corrected, never trusted).
``dflash train data --responses FILE`` reads the file and adds every new shard's responses to it.

File format (lzma-compressed): one JSON header line ``{"format": "dflash-responses-v1", "count": N,
"tokens": T}``, then N 8-byte prompt keys (first 8 bytes of the SHA-1 of the user prompt text), N
little-endian uint16 response lengths, T little-endian uint16 token ids (SmolLM2's vocabulary has
49,152 ids), responses concatenated in key order.
"""
from __future__ import annotations

import hashlib
import json
import lzma
import os
import struct

FORMAT = "dflash-responses-v1"
_U16_MAX = 0xFFFF
# Loading limits (the shipped SmolLM2 file: 4,160 responses of at most 128 ids, 0.9 MB decompressed), so a
# corrupt or hostile file fails with a clear error instead of exhausting memory.
MAX_BYTES = 64 << 20  # decompressed
MAX_RESPONSES = 1 << 20
MAX_RESPONSE_TOKENS = 8192


def prompt_key(text: str) -> bytes:
    """The 8-byte key of a user prompt text."""
    return hashlib.sha1(text.encode("utf-8")).digest()[:8]


def load_responses(path: str) -> dict[bytes, list[int]]:
    """Prompt key -> response token ids; empty when ``path`` does not exist. Files past the loading limits
    (``MAX_BYTES`` decompressed, ``MAX_RESPONSES`` responses of at most ``MAX_RESPONSE_TOKENS`` ids) or not in
    the format raise ValueError."""
    if not os.path.exists(path):
        return {}
    try:
        with lzma.open(path, "rb") as f:
            raw = f.read(MAX_BYTES + 1)
    except lzma.LZMAError as exc:
        raise ValueError(f"{path}: not a responses file (not lzma-compressed: {exc})") from None
    if len(raw) > MAX_BYTES:
        raise ValueError(f"{path}: more than {MAX_BYTES} bytes decompressed, the responses file limit")
    nl = raw.find(b"\n")
    try:
        head = json.loads(raw[:nl]) if nl >= 0 else None
    except ValueError:
        head = None
    if not isinstance(head, dict) or head.get("format") != FORMAT:
        found = head.get("format") if isinstance(head, dict) else None
        raise ValueError(f"{path}: not a responses file (format {found!r}, expected {FORMAT!r})")
    n, t = head.get("count"), head.get("tokens")
    if not (isinstance(n, int) and isinstance(t, int) and 0 <= n <= MAX_RESPONSES and t >= 0):
        raise ValueError(f"{path}: header count {n!r} / tokens {t!r} must be integers, count at most "
                         f"{MAX_RESPONSES} (the responses file limit)")
    body = raw[nl + 1:]
    if len(body) != 8 * n + 2 * n + 2 * t:
        raise ValueError(f"{path}: truncated or corrupt ({len(body)} bytes after the header, "
                         f"expected {8 * n + 2 * n + 2 * t})")
    keys = [body[8 * i: 8 * i + 8] for i in range(n)]
    lengths = struct.unpack(f"<{n}H", body[8 * n: 10 * n])
    if n and max(lengths) > MAX_RESPONSE_TOKENS:
        raise ValueError(f"{path}: a response of {max(lengths)} ids; the limit is {MAX_RESPONSE_TOKENS}")
    if sum(lengths) != t:
        raise ValueError(f"{path}: response lengths add up to {sum(lengths)} ids, the header says {t}")
    tokens = struct.unpack(f"<{t}H", body[10 * n:])
    out, pos = {}, 0
    for k, length in zip(keys, lengths):
        out[k] = list(tokens[pos:pos + length])
        pos += length
    return out


def save_responses(path: str, responses: dict[bytes, list[int]]) -> None:
    """Write ``responses`` (prompt key -> token ids) atomically, keys sorted (same content, same bytes)."""
    keys = sorted(responses)
    for k in keys:
        r = responses[k]
        if len(k) != 8 or len(r) > MAX_RESPONSE_TOKENS or any(not 0 <= t <= _U16_MAX for t in r):
            raise ValueError(f"response for key {k.hex()}: keys are 8 bytes, responses at most "
                             f"{MAX_RESPONSE_TOKENS} ids in [0, {_U16_MAX}]")
    if len(keys) > MAX_RESPONSES:
        raise ValueError(f"{len(keys)} responses; a responses file holds at most {MAX_RESPONSES}")
    tokens = [t for k in keys for t in responses[k]]
    head = json.dumps({"format": FORMAT, "count": len(keys), "tokens": len(tokens)}).encode() + b"\n"
    body = b"".join(keys) + struct.pack(f"<{len(keys)}H", *(len(responses[k]) for k in keys)) \
        + struct.pack(f"<{len(tokens)}H", *tokens)
    tmp = path + ".tmp"
    with lzma.open(tmp, "wb", preset=9 | lzma.PRESET_EXTREME) as f:
        f.write(head + body)
    os.replace(tmp, path)
