"""bench/vllm_peers.py's pure parts, in this project's venv (no vLLM): its arguments, the interleaving, and the
table it builds from the workers' replies. The run itself needs .venv-vllm (make install-vllm)."""
from __future__ import annotations

import argparse

import pytest

from helpers.bench import bench_module

peers = bench_module("vllm_peers")


def reply(tokens: list[list[int]], seconds: float, committed: int = 0, rounds: int = 0, calls=None) -> dict:
    return {"tokens": tokens, "seconds": seconds, "committed": committed, "rounds": rounds, "calls": calls or {}}


def test_batches_and_counts_are_positive_integers():
    assert peers.parse_batches("1,8") == [1, 8]
    assert peers.positive_int("3") == 3
    for bad in ("0", "-2", "x", "1,,8", "1.5"):
        with pytest.raises(argparse.ArgumentTypeError, match="positive integer"):
            peers.parse_batches(bad)


@pytest.mark.parametrize("argv", [["--reps", "0"], ["--batches", "8,0"], ["--prompts", "-1"], ["--threads", "two"]])
def test_bad_arguments_stop_before_any_work(argv, capsys):
    with pytest.raises(SystemExit) as stop:
        peers.main(argv)
    assert stop.value.code == 2
    assert f"argument {argv[0]}: expected a positive integer" in capsys.readouterr().err


def test_unknown_configuration_is_named(capsys):
    with pytest.raises(SystemExit):
        peers.main(["--configs", "vLLM AR,vLLM fast"])
    assert "unknown ['vLLM fast']" in capsys.readouterr().err


def test_without_vllm_it_says_how_to_get_it(monkeypatch):
    monkeypatch.setattr(peers, "dist_version", lambda dist: None)
    with pytest.raises(SystemExit, match="make install-vllm"):
        peers.main(["--prompts", "1"])


def test_groups_cover_every_prompt_once_in_order():
    assert peers.groups(19, 8) == [range(0, 8), range(8, 16), range(16, 19)]
    assert peers.groups(3, 1) == [range(0, 1), range(1, 2), range(2, 3)]
    assert [i for g in peers.groups(19, 8) for i in g] == list(range(19))


def test_each_group_rotates_the_configurations():
    names = tuple(c.name for c in peers.CONFIGS)
    orders = [peers.rotated(names, shift) for shift in range(len(names))]
    assert [o[0] for o in orders] == list(names)  # every configuration goes first once
    assert all(sorted(o) == sorted(names) for o in orders)
    assert peers.rotated(names, len(names) + 2) == orders[2]


def test_the_table_from_replies():
    """Two reps, batch 2, three prompts: tok/s per rep with its median and range, the ratio to vLLM AR, τ pooled
    over reps, identity counts against the references, the plugin's call counts, and prompts that changed."""
    t = {(name, 2): peers.Tally(2) for name in ("vLLM AR", "vLLM DFlash", "vLLM DFlash + plugin", "ours chain")}
    same = [[1, 2, 3], [4, 5], [6]]
    for rep, scale in ((0, 1.0), (1, 2.0)):  # rep 1 takes twice as long
        t[("vLLM AR", 2)].add(rep, range(0, 2), reply(same[:2], 2.5 * scale))
        t[("vLLM AR", 2)].add(rep, range(2, 3), reply(same[2:], 0.5 * scale))
        t[("vLLM DFlash", 2)].add(rep, range(0, 2), reply(same[:2], 1.0 * scale, committed=5, rounds=2))
        t[("vLLM DFlash", 2)].add(rep, range(2, 3), reply(same[2:], 0.5 * scale, committed=1, rounds=1))
        plugin_tokens = [[1, 2, 3], [4, 9]] if rep == 0 else [[1, 2, 3], [4, 5]]
        t[("vLLM DFlash + plugin", 2)].add(rep, range(0, 2), reply(plugin_tokens, 1.0 * scale, committed=5, rounds=2,
                                                                   calls={"add_rms_norm": 2, "inject_context_kv": 4}))
        t[("vLLM DFlash + plugin", 2)].add(rep, range(2, 3), reply([[7]], 0.5 * scale, committed=1, rounds=1,
                                                                   calls={"add_rms_norm": 1, "inject_context_kv": 2}))
        t[("ours chain", 2)].add(rep, range(0, 3), reply(same, 3.0 * scale, committed=6, rounds=4))
    rows = {r["configuration"]: r for r in peers.table_rows(t, [2])}
    assert list(rows) == ["vLLM AR", "vLLM DFlash", "vLLM DFlash + plugin", "ours chain"]  # CONFIGS order
    ar, dflash, plugged, ours = (rows[n] for n in rows)
    assert ar["tokens"] == 6 and ar["tok/s"] == "1.5 (1.0-2.0)" and ar["vs vLLM AR"] == "1.00x" and ar["τ"] == ""
    assert dflash["tok/s"] == "3.0 (2.0-4.0)" and dflash["vs vLLM AR"] == "2.00x" and dflash["τ"] == "2.00"
    assert ours["τ"] == "1.50" and ours["= vLLM DFlash"] == "3/3" and dflash["= ours chain"] == "3/3"
    assert plugged["= vLLM DFlash"] == "1/3" and plugged["= ours chain"] == "1/3"  # first rep's tokens
    assert plugged["ours ran"] == "add_rms_norm 6, inject_context_kv 12" and dflash["ours ran"] == ""
    assert plugged["same every rep"] == "no: prompts [1]" and dflash["same every rep"] == "yes"
    text = peers.markdown(peers.table_rows(t, [2]))
    assert text.splitlines()[0].startswith("| configuration | batch | tokens | tok/s |")
    assert len(text.splitlines()) == 2 + 4
