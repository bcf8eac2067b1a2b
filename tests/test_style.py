"""Code fits a page: the module, the package, the tests and the benchmarks are formatted
by one formatter at 88 columns (ruff.toml), and no line of the module, the package or the
benchmarks is longer (tests may keep a long test name or assertion message)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ["the_annotated_transformer.py", "machinery", "tests", "benchmarks"]
RUFF = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which(
    "ruff"
)

pytestmark = pytest.mark.skipif(
    RUFF is None, reason="ruff is not installed (make install)"
)


def ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [RUFF, *args], cwd=ROOT, capture_output=True, text=True, check=False
    )


def test_the_formatter_has_nothing_to_change():
    result = ruff("format", "--check", *SOURCES)
    assert result.returncode == 0, result.stdout + result.stderr


def test_no_line_is_longer_than_88_columns_and_no_name_is_undefined():
    result = ruff("check", "--output-format", "concise", *SOURCES)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_check_catches_a_long_line(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("x = " + " + ".join(["1"] * 40) + "\n")
    result = ruff("check", "--config", str(ROOT / "ruff.toml"), str(bad))
    assert result.returncode != 0 and "E501" in result.stdout


def test_no_long_line_is_excused_by_a_pragma():
    excused = [
        f"{path.relative_to(ROOT)}:{n}"
        for source in ("the_annotated_transformer.py", "machinery", "benchmarks")
        for path in sorted((ROOT / source).glob("*.py")) or [ROOT / source]
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if "noqa: E501" in line
    ]
    assert excused == []
