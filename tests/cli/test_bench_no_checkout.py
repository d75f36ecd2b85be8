"""``dflash bench`` from an installed package (no bench/ beside it) says plainly that it needs a source
checkout, exits 2 and prints nothing on stdout. The real non-editable install is checked by hand (README)."""
from __future__ import annotations

import pytest

from dflash_apps import cli


@pytest.mark.parametrize("name", sorted(cli.BENCHMARKS))
def test_bench_without_a_checkout(name, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli, "bench_dir", lambda: tmp_path / "site-packages-has-no-bench")
    assert cli.main(["bench", name, "--device", "cpu"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert f"dflash bench {name}: the benchmark scripts live in bench/ of the source repository" in err
    assert "pip install -e ." in err and "dflash benchmark" in err
