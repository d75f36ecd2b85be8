"""The crash-isolated fuzz worker: its start (imports of torch, Triton and the ops, minutes on a loaded machine) is
not charged to the first case's time limit, and a worker that never gets ready fails under the start limit."""
from __future__ import annotations

import pytest

from helpers.fuzz import runner

# A stand-in worker: slow to get ready (sleep S), then answers every case at once.
FAKE = """
import json, os, sys, time
results = os.fdopen(int(os.environ["DFLASH_FUZZ_RESULT_FD"]), "w")
time.sleep({start_s})
results.write(json.dumps({{"ready": True}}) + "\\n")
results.flush()
for line in sys.stdin:
    results.write(json.dumps({{"ok": True, "detail": json.loads(line)["name"]}}) + "\\n")
    results.flush()
"""


def _worker(tmp_path, monkeypatch, start_s: float) -> runner.Worker:
    (tmp_path / "slow_start_worker.py").write_text(FAKE.format(start_s=start_s))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    return runner.Worker(module="slow_start_worker")


def test_first_case_limit_excludes_the_workers_start(tmp_path, monkeypatch):
    """A start of 3 s and a case limit of 2 s: the case passes (the limit used to count the start too)."""
    monkeypatch.setattr(runner, "CASE_TIMEOUT_S", 2.0)
    worker = _worker(tmp_path, monkeypatch, start_s=3)
    try:
        assert worker.run({"name": "first"}) == {"ok": True, "detail": "first"}
        assert worker.run({"name": "second"}) == {"ok": True, "detail": "second"}
    finally:
        worker.close()


def test_a_worker_that_never_gets_ready_fails_under_the_start_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "STARTUP_TIMEOUT_S", 1.0)
    worker = _worker(tmp_path, monkeypatch, start_s=600)
    try:
        with pytest.raises(runner.WorkerDied, match="worker hung for 1 s while starting"):
            worker.run({"name": "never"})
    finally:
        worker.close()
