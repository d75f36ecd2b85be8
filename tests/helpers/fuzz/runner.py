"""Crash isolation for the fuzz tests: cases run in a worker process, never in pytest's.

The parent sends one case (a JSON object) at a time on the worker's stdin and reads one verdict line back on a
private pipe (the worker's fd 1 is pointed at its stderr, so that prints from native code or libraries cannot
corrupt the protocol). A worker that dies (a signal: SIGSEGV, SIGABRT from glibc's heap checks, SIGKILL from the
kernel's OOM killer) or that does not answer within the per-case time limit is replaced by a fresh one, and the
case is reported as failed with the signal and the worker's last stderr lines. One worker serves every test of a
session while it lives, so torch, Triton and the native library are imported and built once. A fresh worker says
it is ready (its imports done) before it gets a case, under a limit of its own: the per-case limit times the case
alone, also on a loaded machine where the imports take minutes.

A crash is charged to the case that was running; memory corrupted silently by an earlier case could in principle
surface later, so the failing case names its seed and the run can be repeated with that one case alone.
"""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from collections import deque

# The worker runs as ``python -m helpers.fuzz.worker`` with tests/ (the folder that holds ``helpers``) on its path.
TESTS = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER_MODULE = "helpers.fuzz.worker"
# A case that runs longer than this is a hang (an unbounded loop or allocation); the slowest CI case (a Triton
# kernel under the interpreter) takes a few seconds.
CASE_TIMEOUT_S = float(os.environ.get("DFLASH_FUZZ_CASE_TIMEOUT", "20"))
# A worker that is not ready (its imports done) within this is a hang at start.
STARTUP_TIMEOUT_S = float(os.environ.get("DFLASH_FUZZ_STARTUP_TIMEOUT", "600"))


class WorkerDied(AssertionError):
    """The worker ended (by a signal or an exit) or hung while starting or running a case."""


class Worker:
    def __init__(self, module: str = WORKER_MODULE) -> None:
        self.module = module  # run as ``python -m module``
        self.proc: subprocess.Popen | None = None
        self.stderr_tail: deque[str] = deque(maxlen=200)
        self.last_status = ""

    def _start(self) -> None:
        read_fd, write_fd = os.pipe()
        python_path = os.pathsep.join(filter(None, [TESTS, os.environ.get("PYTHONPATH")]))
        env = dict(os.environ, DFLASH_FUZZ_RESULT_FD=str(write_fd), PYTHONUNBUFFERED="1", PYTHONPATH=python_path)
        self.proc = subprocess.Popen([sys.executable, "-m", self.module], stdin=subprocess.PIPE,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, pass_fds=(write_fd,), env=env,
                                     text=True)
        os.close(write_fd)
        self.results = os.fdopen(read_fd, "r")
        os.set_blocking(self.proc.stderr.fileno(), False)
        self.stderr_tail.clear()

    def _drain_stderr(self) -> None:
        try:
            chunk = self.proc.stderr.read()
        except (OSError, ValueError):
            return
        if chunk:
            self.stderr_tail.extend(chunk.splitlines())

    def _stop(self) -> None:
        """End this worker (it is our own child: killed by its pid) and reap it."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        code = self.proc.wait()
        self.last_status = (f"signal {signal.Signals(-code).name}" if code < 0 else f"exit status {code}")
        self._drain_stderr()
        for f in (self.proc.stdin, self.proc.stderr, self.results):
            try:
                f.close()
            except OSError:
                pass
        self.proc = None

    def close(self) -> None:
        self._stop()

    def run(self, case: dict) -> dict:
        """The worker's verdict on ``case`` (a dict with ``ok`` and ``detail``); raises :class:`WorkerDied`."""
        if self.proc is None or self.proc.poll() is not None:
            self._stop()
            self._start()
            self._answer(STARTUP_TIMEOUT_S, "while starting")
        try:
            self.proc.stdin.write(json.dumps(case) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # reported below, from its exit status
        return self._answer(CASE_TIMEOUT_S, "on this case")

    def _answer(self, limit_s: float, what: str) -> dict:
        """The worker's next line (a JSON object) within ``limit_s``; else the worker is stopped and
        :class:`WorkerDied` says whether it hung or ended ``what`` (e.g. "on this case")."""
        deadline = time.monotonic() + limit_s
        watched = [self.results, self.proc.stderr]
        while (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select(watched, [], [], left)
            if self.proc.stderr in ready:
                self._drain_stderr()
                if self.proc.poll() is not None:
                    watched = [self.results]  # its stderr is at its end: stop polling it
            if self.results in ready:
                line = self.results.readline()
                if line:
                    return json.loads(line)
                break  # the pipe closed: the worker ended
        hung = time.monotonic() >= deadline
        self._stop()
        tail = "\n".join(list(self.stderr_tail)[-60:])
        if hung:
            raise WorkerDied(f"worker hung for {limit_s:.0f} s {what} (killed)\n--- worker stderr ---\n{tail}")
        raise WorkerDied(f"worker died {what}: {self.last_status}\n--- worker stderr ---\n{tail}")
