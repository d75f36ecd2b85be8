"""Shared helpers of the benchmarks: device choice, timing, measured ceilings, tables, CSV.

Method (bench/README.md): warm up, then the median of many timed repetitions; on CUDA each
repetition is timed with CUDA events (graph replays where a graph exists); the floors we divide by
are measured in the same run (a large device copy for bandwidth, a large matrix product for the
arithmetic rate), never taken from a datasheet; inputs are random, never zeros.
"""
from __future__ import annotations

import contextlib
import csv
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a plain script (python bench/x.py) from anywhere
    sys.path.insert(0, str(ROOT))


# ---------------------------------------------------------------------------------------- device
@contextlib.contextmanager
def cpu_kernels(*, native: bool = True, amx: bool = True, native_forward: bool = True, argmax_screen: bool = True,
                bf16: bool = True, int8_screen: bool = True):
    """For the calls inside: the "cpu" backend's native kernels (``DFLASH_CPU_NATIVE``), ``cpu_linear``'s AMX path,
    its bf16-packed weights (``cpu_linear.set_bf16``; off: bf16-exact weights stream as fp32), the lean target's
    native forward (``dflash_kernels.cpu.forward``; off: its op path), ``cpu_linear.linear_argmax``'s screen (off: a
    greedy verify's whole LM head, then its argmax) and its int8 screens (``cpu_linear.set_int8_screen``; off: the
    AMX route's hi-part screen, the bf16-packed route's whole head) on or off (A/B runs in one process); the
    settings restored after."""
    from dflash_kernels.cpu import linear as cpu_linear
    from dflash_kernels.cpu import forward as nf
    from dflash_kernels.cpu import native as cpu_native

    before = os.environ.get(cpu_native.ENV)
    os.environ[cpu_native.ENV] = "1" if native else "0"
    amx_before = cpu_linear.set_amx(amx)
    bf16_before = cpu_linear.set_bf16(bf16)
    nf_before = nf.set_enabled(native_forward)
    screen_before = cpu_linear.set_argmax_screen(argmax_screen)
    int8_before = cpu_linear.set_int8_screen(int8_screen)
    try:
        yield
    finally:
        cpu_linear.set_int8_screen(int8_before)
        cpu_linear.set_argmax_screen(screen_before)
        nf.set_enabled(nf_before)
        cpu_linear.set_bf16(bf16_before)
        cpu_linear.set_amx(amx_before)
        if before is None:
            del os.environ[cpu_native.ENV]
        else:
            os.environ[cpu_native.ENV] = before


def report(head: str, rows: list[dict], columns: list[str], out: str | None) -> None:
    """Print a run's header line and its markdown table; also write both to ``out`` when given."""
    text = table(rows, columns, markdown=True)
    print(head)
    print(text)
    if out:
        Path(out).write_text(head + "\n\n" + text + "\n", encoding="utf-8")


def smollm2_unavailable(script: str) -> bool:
    """Whether the SmolLM2 demo pair cannot load here (offline, from the installed GGUF); says why on stderr."""
    from dflash_apps import smollm2

    reason = smollm2.unavailable_reason()
    if reason:
        print(f"bench/{script}: {reason}", file=sys.stderr)
    return reason is not None


def pick_device(name: str | None) -> torch.device:
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {name}: no CUDA device is visible to torch {torch.__version__}")
    return dev


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def out_dir(explicit: str | None, default_sub: str = "bench/results") -> Path:
    """Where CSV/PNG go: --out, else $OUT (device machines), else bench/results/ of the checkout."""
    path = Path(explicit or os.environ.get("OUT") or (ROOT / default_sub))
    path.mkdir(parents=True, exist_ok=True)
    return path


def parse_ints(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        mult = 1
        if part.endswith("k"):
            part, mult = part[:-1], 1024
        out.append(int(float(part) * mult))
    return out


# ---------------------------------------------------------------------------------------- timing
def time_fn(fn: Callable[[], object], device: torch.device, *, warmup: int = 3, reps: int = 30,
            min_reps: int = 5, budget_s: float = 2.0, before: Callable[[], object] | None = None) -> dict:
    """Median over repetitions of ``fn()``, each timed alone (CUDA events on GPU, perf_counter +
    no sync needed on CPU). Runs at least ``min_reps``, at most ``reps``, stopping once ``budget_s``
    of timed work has accumulated. ``before`` runs untimed ahead of each repetition (input rotation)."""
    for _ in range(warmup):
        if before:
            before()
        fn()
    sync(device)
    times: list[float] = []
    if device.type == "cuda":
        events = []
        t_host = time.perf_counter()
        for i in range(reps):
            if before:
                before()
            a = torch.cuda.Event(enable_timing=True)
            b = torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            events.append((a, b))
            if (i + 1) % 8 == 0:  # bound the queue, so the budget below measures device time
                torch.cuda.synchronize(device)
            if i + 1 >= min_reps and time.perf_counter() - t_host > budget_s:
                break
        torch.cuda.synchronize(device)
        times = [a.elapsed_time(b) for a, b in events]
    else:
        spent = 0.0
        for i in range(reps):
            if before:
                before()
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            times.append(dt * 1e3)
            spent += dt
            if i + 1 >= min_reps and spent > budget_s:
                break
    times.sort()
    n = len(times)
    return {"median_ms": statistics.median(times), "p10_ms": times[max(0, n // 10)],
            "p90_ms": times[min(n - 1, (9 * n) // 10)], "reps": n}


def instantiate_random(target_config, draft_config, device: torch.device, dtype: torch.dtype,
                       norm_range: tuple[float, float] = (0.5, 1.5)):
    """A random HF Qwen3 target and DFlash draft created in ``dtype`` directly on ``device``, with
    every matrix ~N(0, 0.02) and every norm weight uniform in ``norm_range`` (HF may skip init under
    a device context, so nothing is left zero or uninitialised)."""
    from transformers import Qwen3ForCausalLM

    from dflash import DFlashDraftModel

    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            target = Qwen3ForCausalLM(target_config).eval()
            draft = DFlashDraftModel(draft_config).eval()
    finally:
        torch.set_default_dtype(old)
    return randomize_(target, draft, norm_range=norm_range)


def randomize_(*modules, norm_range: tuple[float, float] = (0.5, 1.5)):
    """Every matrix of ``modules`` ~N(0, 0.02) and every vector (norm weights) uniform in ``norm_range``,
    in place, on the parameters' device; returns ``modules``."""
    with torch.no_grad():
        for module in modules:
            for p in module.parameters():
                if p.dim() >= 2:
                    p.normal_(0, 0.02)
                else:
                    p.uniform_(*norm_range)
    return modules


# ---------------------------------------------------------------------------------------- ceilings
_CEILINGS: dict[str, dict] = {}


def copy_bandwidth(device: torch.device, nbytes: int | None = None) -> dict:
    """Bytes read + written per second of a large device copy of random bf16 data (GB/s)."""
    key = f"bw:{device}"
    if key in _CEILINGS:
        return _CEILINGS[key]
    if nbytes is None:
        nbytes = 2 * 2**30 if device.type == "cuda" else 128 * 2**20
    n = nbytes // 2
    src = torch.randn(n, device=device).to(torch.bfloat16)  # random, not zeros
    dst = torch.empty_like(src)
    r = time_fn(lambda: dst.copy_(src), device, warmup=3, reps=30, min_reps=8, budget_s=2.0)
    gbs = 2 * nbytes / (r["median_ms"] * 1e-3) / 1e9
    out = {"copy_GBps": gbs, "copy_bytes": nbytes, "copy_ms": r["median_ms"]}
    del src, dst
    _CEILINGS[key] = out
    return out


def matmul_rate(device: torch.device, dtype: torch.dtype = torch.bfloat16, n: int | None = None) -> dict:
    """FLOP/s of a square matrix product on random data (TFLOP/s)."""
    key = f"mm:{device}:{dtype}"
    if key in _CEILINGS:
        return _CEILINGS[key]
    if n is None:
        n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    r = time_fn(lambda: a @ b, device, warmup=2, reps=15, min_reps=3, budget_s=2.0)
    out = {"mm_TFLOPs": 2 * n**3 / (r["median_ms"] * 1e-3) / 1e12, "mm_n": n, "mm_dtype": str(dtype)[6:]}
    _CEILINGS[key] = out
    return out


def l2_bytes(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    return getattr(props, "L2_cache_size", None) or getattr(props, "l2_cache_size", None)


# ---------------------------------------------------------------------------------------- baselines
def hf_greedy(target, input_ids: torch.Tensor, max_new_tokens: int, stops: Sequence[int], temperature: float = 0.0,
              top_p: float = 1.0) -> tuple[torch.Tensor, float]:
    """The target's own ``generate`` (what users run without speculation) on ``input_ids`` [1, P], greedy unless
    ``temperature`` > 0 (then sampled with nucleus ``top_p``, from torch's global generator): (sequences [1, P + n],
    wall seconds)."""
    from dflash_apps.demo import hf_generate_kwargs

    kwargs = hf_generate_kwargs(input_ids, max_new_tokens, list(stops), temperature, top_p)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = target.generate(input_ids, **kwargs)
    return out, time.perf_counter() - t0


# ---------------------------------------------------------------------------------------- environment
def git_commit() -> str:
    """``DFLASH_COMMIT`` when set (a copy without ``.git``, as on the GPU machine), else the checkout's HEAD."""
    if os.environ.get("DFLASH_COMMIT"):
        return os.environ["DFLASH_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "bench", "dflash", "dflash_apps",
                                "dflash_kernels", "csrc"], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        head = out.stdout.strip() or "unknown (no git checkout and no DFLASH_COMMIT)"
        return head + ("+dirty" if dirty and out.stdout.strip() else "")
    except Exception:  # pragma: no cover
        return "unknown"


def environment(device: torch.device) -> dict:
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:  # pragma: no cover
        triton_version = "absent"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        hw = f"{props.name}, {props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB"
    else:
        hw = f"CPU {platform.processor() or platform.machine()}, {os.cpu_count()} cores visible, " \
             f"torch threads {torch.get_num_threads()}, no GPU"
    return {"hardware": hw, "torch": torch.__version__, "triton": triton_version, "python": platform.python_version(),
            "commit": git_commit(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def print_header(title: str, device: torch.device, extra: dict | None = None) -> dict:
    env = environment(device)
    print(f"# {title}")
    print(f"# {env['hardware']} | torch {env['torch']} | triton {env['triton']} | commit {env['commit']} | {env['date']}")
    for k, v in (extra or {}).items():
        print(f"# {k}: {v}")
    return env


# ---------------------------------------------------------------------------------------- output
def fmt(v) -> str:
    if isinstance(v, float):
        if v != v:
            return "n/a"
        if abs(v) >= 100:
            return f"{v:.0f}"
        if abs(v) >= 10:
            return f"{v:.1f}"
        if abs(v) >= 0.1:
            return f"{v:.2f}"
        return f"{v:.3g}"
    return "" if v is None else str(v)


def table(rows: Sequence[dict], columns: Sequence[str], markdown: bool = False) -> str:
    cells = [[fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(columns)]
    if markdown:
        lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(columns, widths)) + " |",
                 "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
        lines += ["| " + " | ".join(x.rjust(w) for x, w in zip(row, widths)) + " |" for row in cells]
    else:
        lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths))]
        lines += ["  ".join(x.rjust(w) for x, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


class RowLog(list):
    """Result rows that reach the disk as they come: every ``append``/``extend`` rewrites ``path`` (the run's
    ``<stem>.partial.csv``) with all rows so far, replaced atomically, so a run killed at its timeout still
    leaves each finished row. :meth:`finish` writes the final CSV and removes the partial file. With
    ``DFLASH_ROWS_JOURNAL`` set (bench/gpu_check.sh sets it), each write also appends ``<file name>\t<rows>`` to
    that file: how many rows each step had on disk while it ran, whether it finished or not."""

    def __init__(self, path: Path, env: dict | None = None):
        super().__init__()
        self.path = path
        self.env = env or {}

    def append(self, row: dict) -> None:
        super().append(row)
        self.flush()

    def extend(self, rows: Iterable[dict]) -> None:
        super().extend(rows)
        self.flush()

    def __iadd__(self, rows: Iterable[dict]) -> "RowLog":
        self.extend(rows)
        return self

    def flush(self) -> None:
        """Rewrite the partial file: rows already added may have been completed in place since."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        write_csv(tmp, self.public(), self.env)
        os.replace(tmp, self.path)
        journal = os.environ.get("DFLASH_ROWS_JOURNAL")
        if journal:
            with open(journal, "a") as f:
                f.write(f"{self.path.name}\t{len(self)}\n")

    def public(self) -> list[dict]:
        """The rows without their private (``_``-prefixed) fields, such as a kept output sequence."""
        return [{k: v for k, v in r.items() if not k.startswith("_")} for r in self]

    def finish(self, path: Path, env: dict | None = None) -> Path:
        """Write the rows to the final ``path`` (``env``: the columns every row shares, default the partial
        file's); the partial file goes."""
        written = write_csv(path, self.public(), self.env if env is None else env)
        self.path.unlink(missing_ok=True)
        return written


def write_csv(path: Path, rows: Iterable[dict], env: dict | None = None) -> Path:
    rows = list(rows)
    keys: list[str] = []
    for r in rows:
        for k in r:
            if k not in keys:
                keys.append(k)
    env_keys = [k for k in (env or {}) if k not in keys]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys + env_keys)
        w.writeheader()
        for r in rows:
            w.writerow({**{k: (env or {})[k] for k in env_keys}, **r})
    return path


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
        return True
    except ImportError:
        return False
