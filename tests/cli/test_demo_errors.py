"""``dflash demo`` with a bad --draft: exit 2, the error on one line of stderr, no traceback, before the
target is loaded."""
from __future__ import annotations

from dflash_apps import cli, zlab_cli


def test_demo_refuses_a_missing_or_corrupt_draft(capsys, tmp_path):
    assert cli.main(["demo", "--draft", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.endswith(f"dflash demo: --draft: no draft at {tmp_path} (expected config.json + "
                                      "model.safetensors)\n")
    (tmp_path / "config.json").write_bytes((zlab_cli.EMBEDDED_DRAFT / "config.json").read_bytes())
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 1000)  # a header length of 2**64 - 1 bytes
    assert cli.main(["demo", "--draft", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err and "SmolLM2" not in err
    assert err.endswith(f"dflash demo: --draft {str(tmp_path)!r}: {tmp_path / 'model.safetensors'}: not a readable "
                        "safetensors file (Error while deserializing header: header too large); the download is "
                        "likely truncated or corrupt: fetch this file again\n")
