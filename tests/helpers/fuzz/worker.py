"""The fuzz worker (``python -m helpers.fuzz.worker`` with tests/ on the path): reads one JSON case a line on stdin,
runs it (``cases.run_case``), writes one JSON verdict a line on the fd named by ``DFLASH_FUZZ_RESULT_FD``. Its own
fd 1 goes to stderr (see ``runner``). Its first line, once its imports are done, says it is ready.

The address space is capped (``DFLASH_FUZZ_MEMORY_GB``, default 6; 0 = no cap, for AddressSanitizer runs, which
cap allocations with ASAN_OPTIONS instead) so that an unbounded allocation becomes a Python MemoryError /
RuntimeError in the worker instead of the machine's OOM killer.
"""
from __future__ import annotations

import faulthandler
import json
import os
import resource
import sys


def main() -> None:
    results = os.fdopen(int(os.environ["DFLASH_FUZZ_RESULT_FD"]), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    faulthandler.enable()  # a fatal signal prints the Python stack to stderr, which the failure report shows
    limit = int(float(os.environ.get("DFLASH_FUZZ_MEMORY_GB", "6")) * 2**30)
    if limit:  # 0: no cap (AddressSanitizer reserves terabytes of address space for its shadow memory)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    # Triton's interpreter must be chosen before dflash_kernels is imported (as tests/conftest.py does).
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    torch.set_num_threads(1)
    from helpers.fuzz import cases

    results.write(json.dumps({"ready": True}) + "\n")  # imports done: the parent's per-case clock starts now
    results.flush()
    for line in sys.stdin:
        verdict = cases.run_case(json.loads(line))
        results.write(json.dumps(verdict) + "\n")
        results.flush()


if __name__ == "__main__":
    main()
