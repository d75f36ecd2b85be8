"""Seeds derived from a test's pytest node id (tests/conftest.py seeds every test with one)."""
from __future__ import annotations

import hashlib


def node_seed(nodeid: str) -> int:
    """The seed of the test ``nodeid``: a hash of the id (not Python's ``hash``, which is salted per process), so it
    is the same on every run and every machine, and differs between tests and between the parameter sets of one
    test."""
    return int.from_bytes(hashlib.sha256(nodeid.encode()).digest()[:4], "little") & 0x7FFFFFFF
