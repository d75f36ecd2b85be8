"""bench/cpu_peers.py's pure parts: argument checks, the commands it runs, the parsing of llama.cpp's output, the
identity rule and the table row. Nothing is built or downloaded here (the llama.cpp build is the script's own run)."""
from __future__ import annotations

from pathlib import Path

import pytest

from helpers.bench import bench_module

peers = bench_module("cpu_peers")


def test_defaults_run_every_configuration_in_table_order():
    args = peers.parse_args([])
    assert (args.prompts, args.reps, args.max_new_tokens, args.threads, args.tree_budget) == (8, 2, 96, 2, 7)
    keys = [c.key for c in args.chosen]
    assert keys == ["llama-q4_1", "llama-bf16", "llama-f32", "llama-dflash-bf16", "llama-dflash-f32",
                    "llama-ngram-bf16", "ours-tree-lookup", "ours-tree", "ours-chain", "ours-ar", "hf"]
    assert [c.label for c in args.chosen if c.engine == "ours"][:2] == ["DFlash, trees of 7 + lookup 4 (fp32)",
                                                                       "DFlash, trees of 7 (fp32)"]


def test_a_subset_keeps_hf_the_reference():
    args = peers.parse_args(["--configs", "ours-ar, llama-f32", "--tree-budget", "5"])
    assert [c.key for c in args.chosen] == ["llama-f32", "ours-ar", "hf"]


@pytest.mark.parametrize("argv, needle", [
    (["--configs", "llama-f16"], "unknown ['llama-f16']"),
    (["--reps", "0"], "--reps must be >= 1"),
    (["--prompts", "-3"], "--prompts must be >= 1"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--threads", "0"], "--threads must be >= 1"),
])
def test_bad_arguments_name_the_option(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        peers.parse_args(argv)
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


def test_build_commands():
    src, build = Path("/c/tree/llama.cpp"), Path("/c/tree/build")
    conf = peers.configure_command(src, build, ninja=True)
    assert conf[:7] == ["cmake", "-S", str(src), "-B", str(build), "-G", "Ninja"]
    assert "-DLLAMA_OPENSSL=OFF" in conf and "-DLLAMA_USE_PREBUILT_UI=OFF" in conf  # nothing fetched at build time
    assert conf[-1] == "-DLLAMA_BUILD_NUMBER=11434"
    assert "-G" not in peers.configure_command(src, build, ninja=False)
    assert peers.build_command(build, 2) == ["nice", "cmake", "--build", str(build), "--target", "llama-completion",
                                             "llama-speculative-simple", "-j", "2"]


def test_convert_commands():
    llama = Path("/c/llama.cpp")
    target = peers.convert_command("py", llama, Path("/m"), "f32", Path("/o.gguf"))
    assert target == ["py", "-c", peers.CONVERTER, "/c/llama.cpp", "/m", "--outtype", "f32", "--outfile", "/o.gguf"]
    draft = peers.convert_command("py", llama, Path("/d"), "bf16", Path("/d.gguf"), target_dir=Path("/m"))
    assert draft[:4] == ["py", "-c", peers.CONVERTER, "/c/llama.cpp"]
    assert draft[4:] == ["/d", "--outtype", "bf16", "--outfile", "/d.gguf", "--target-model-dir", "/m"]
    compile(peers.CONVERTER, "CONVERTER", "exec")  # the shim is valid Python


def _flag(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


def test_llama_commands():
    prompt = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"  # ends in a newline: passed as is, not by -f
    ar = peers.llama_command(Path("/b"), Path("/m.gguf"), prompt, 96, 2, 2048)
    assert ar[0] == "/b/llama-completion" and _flag(ar, "-p") == prompt and "-f" not in ar
    for flag, value in (("-m", "/m.gguf"), ("-n", "96"), ("--temp", "0"), ("--top-k", "1"), ("-t", "2"),
                        ("-tb", "2"), ("-c", "2048")):
        assert _flag(ar, flag) == value, flag
    assert {"-no-cnv", "--no-display-prompt", "--verbose-prompt"} <= set(ar) and "-md" not in ar
    spec = peers.llama_command(Path("/b"), Path("/m.gguf"), prompt, 64, 3, 1024, Path("/d.gguf"), 7)
    assert spec[0] == "/b/llama-speculative-simple"
    for flag, value in (("-md", "/d.gguf"), ("--spec-type", "draft-dflash"), ("--spec-draft-n-max", "7"),
                        ("-td", "3"), ("-tbd", "3"), ("-t", "3"), ("-n", "64")):
        assert _flag(spec, flag) == value, flag


COMPLETION_ERR = """0.00.575.496 I llama_completion: prompt: '<|im_start|>user
Hi'
0.00.575.534 I llama_completion: number of tokens in prompt = 3
0.00.575.569 I      1 -> '<|im_start|>'
0.00.575.633 I    198 -> '
'
0.00.575.664 I  17830 -> 'Hi'
0.00.577.127 I generate: n_ctx = 2048, n_batch = 2048, n_predict = 96, n_keep = 0
0.01.150.921 I common_perf_print:    sampling time =       5.50 ms
0.01.150.923 I common_perf_print:    samplers time =       0.26 ms /    55 tokens
0.01.150.930 I common_perf_print:        load time =     310.00 ms
0.01.150.932 I common_perf_print: prompt eval time =      44.50 ms /     3 tokens (   14.83 ms per token,    67.42 tokens per second)
0.01.150.933 I common_perf_print:        eval time =    1000.00 ms /    95 runs   (   10.53 ms per token,    95.00 tokens per second)
0.01.150.933 I common_perf_print:       total time =    1400.00 ms /    98 tokens
"""


def test_parse_completion():
    run = peers.parse_completion("Hello there!\n\nBye\n\n", COMPLETION_ERR)
    assert run.prompt_ids == [1, 198, 17830]  # a piece holding a newline does not hide the next id
    assert run.text == "Hello there!\n\nBye" and not run.stopped
    assert run.tokens == 96 and run.forwards == 0
    assert run.seconds == pytest.approx((44.5 + 1000.0 + 5.5) / 1e3)  # load and total time left out
    stopped = peers.parse_completion("Done.\n" + peers.END_OF_TEXT + "\n\n", COMPLETION_ERR)
    assert stopped.text == "Done.\n" and stopped.stopped
    plain = COMPLETION_ERR.replace("0.00.575.569 I ", "").replace("0.00.575.664 I ", "")  # a tty: no prefixes
    assert peers.parse_completion("x\n\n", plain).prompt_ids == [1, 198, 17830]
    with pytest.raises(ValueError, match="lacks"):
        peers.parse_completion("x\n\n", "no perf lines")
    with pytest.raises(ValueError, match="does not end"):
        peers.parse_completion("cut off", COMPLETION_ERR)


SPEC_ERR = """0.01.593.249 I encoded   30 tokens in    0.120 seconds, speed:  250.000 t/s
0.01.593.250 I decoded   97 tokens in    1.500 seconds, speed:   64.667 t/s
0.01.593.251 I n_draft   = 7
0.01.593.251 I n_predict = 97
0.01.593.251 I n_drafted = 140
0.01.593.251 I n_accept  = 57
"""


def test_parse_speculative():
    prompt = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    out = "\n\n" + prompt + "Hello!\n\n" + "\n\n\n\n"
    run = peers.parse_speculative(out, SPEC_ERR, prompt)
    assert run.text == "Hello!\n\n"  # the generated text's own trailing newlines kept
    assert (run.tokens, run.forwards, run.prompt_ids, run.stopped) == (97, 40, None, False)
    assert run.seconds == pytest.approx(1.62)
    with pytest.raises(ValueError, match="not the prompt"):
        peers.parse_speculative(out, SPEC_ERR, "another prompt")


def test_same_output():
    def run(text, stopped):
        return peers.LlamaRun(text, None, 1, 1.0, 0, stopped)
    assert peers.same_output(run("abc", True), "abc", hf_stopped=True)
    assert not peers.same_output(run("abcd", False), "abc", hf_stopped=True)  # ran past HF's stop token
    assert peers.same_output(run("abc de", False), "abc", hf_stopped=False)  # a token past the limit
    assert not peers.same_output(run("ab", True), "abc", hf_stopped=False)  # stopped early
    assert not peers.same_output(run("abX", False), "abc", hf_stopped=False)


def test_until_stop():
    assert peers.until_stop([4, 9, 2, 7, 2], {1, 2}) == [4, 9]
    assert peers.until_stop([4, 9], {1, 2}) == [4, 9]
    assert peers.until_stop([1], {1, 2}) == []
    assert peers.until_stop([], {1}) == []


def test_amx_state_reads_the_flags():
    amd = "processor : 0\nflags\t\t: fpu sse2 avx2 fma avx512f avx512bw\nmodel name : AMD EPYC\n"
    assert peers.amx_state(amd) == "no AMX, AVX-512"
    assert peers.amx_state("flags : avx2 avx512f amx_bf16 amx_tile amx_int8\n") == "AMX, AVX-512"
    assert peers.amx_state("flags : sse2 avx2 fma\n") == "no AMX, AVX2"
    assert peers.amx_state("flags : sse2\n") == "no AMX, no AVX2"


def test_summarize_rows():
    cfgs = {c.key: c for c in peers.configs(7)}
    reps = [{"tokens": 200, "seconds": 4.0, "forwards": 80}, {"tokens": 200, "seconds": 5.0, "forwards": 80},
            {"tokens": 200, "seconds": 2.0, "forwards": 80}]
    row = peers.summarize(cfgs["llama-dflash-f32"], reps, 7, 8, 8)
    assert row == {"engine": "llama.cpp", "configuration": "DFlash, our draft, f32", "tok/s": "50.0 (40.0-100.0)",
                   "identical to HF greedy": "7/8", "τ": "2.50", "prompt ids as ours": "8/8"}
    ar = peers.summarize(cfgs["ours-ar"], reps, 8, 8, None)
    assert ar["τ"] == "" and ar["prompt ids as ours"] == "" and ar["identical to HF greedy"] == "8/8"
    assert peers.summarize(cfgs["ours-chain"], reps, 8, 8, None)["τ"] == "2.50"
    assert peers.summarize(cfgs["hf"], reps, 8, 8, None)["identical to HF greedy"] == "reference"
    assert list(row) == peers.COLUMNS


def test_draft_gguf_name_follows_the_draft_content(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"weights-1")
    first = peers.draft_gguf_name("bf16", tmp_path)
    assert first.startswith("smollm2-135m-draft-bf16-") and first.endswith(".gguf")
    assert peers.draft_gguf_name("f32", tmp_path) != first
    (tmp_path / "model.safetensors").write_bytes(b"weights-2")  # a retrained draft: a new conversion, not the old file
    assert peers.draft_gguf_name("bf16", tmp_path) != first


def test_no_repack_reaches_every_llama_command():
    assert peers.parse_args([]).no_repack is False and peers.parse_args(["--no-repack"]).no_repack is True
    for draft in (None, Path("/d.gguf")):
        assert "--no-repack" not in peers.llama_command(Path("/b"), Path("/m.gguf"), "p", 8, 2, 512, draft)
        assert "--no-repack" in peers.llama_command(Path("/b"), Path("/m.gguf"), "p", 8, 2, 512, draft, repack=False)


def test_ngram_peer_runs_llama_cpps_own_lookup():
    cmd = peers.llama_command(Path("/b"), Path("/m.gguf"), "p", 8, 2, 512, ngram=(3, 5))
    assert Path(cmd[0]).name == peers.SPEC_TOOL and "-md" not in cmd
    assert cmd[cmd.index("--spec-type") + 1] == "ngram-simple"
    assert cmd[cmd.index("--spec-ngram-simple-size-n") + 1] == "3"
    assert cmd[cmd.index("--spec-ngram-simple-size-m") + 1] == "5"
    cfgs = {c.key: c for c in peers.configs(7, 4, (2, 7))}
    assert cfgs["llama-ngram-bf16"].ngram == (2, 7) and cfgs["ours-tree-lookup"].lookup == 4
    assert peers.parse_args(["--ngram", "4,9"]).ngram == (4, 9)
    for bad in ("3", "a,b", "0,5"):
        with pytest.raises(SystemExit):
            peers.parse_args(["--ngram", bad])

