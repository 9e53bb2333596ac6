"""Every Python file in the repository passes ruff's check as pyproject.toml configures it
(pyflakes, bugbear's likely bugs, import order, 100 columns for comments and docstrings too) and is
as ruff's formatter writes it, so CI enforces both."""

import subprocess
import sys

import pytest

from conftest import REPO


def ruff(*args: str) -> subprocess.CompletedProcess:
    """ruff as requirements.txt pins it, on the whole repository."""
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args], cwd=REPO, capture_output=True, text=True, timeout=120
    )


@pytest.mark.quick
def test_ruff_check_passes():
    result = ruff("check", ".")
    assert result.returncode == 0, (
        f"{result.stdout[-3000:]}{result.stderr[-1000:]}\nfix: ruff check --fix ."
    )


@pytest.mark.quick
def test_ruff_format_leaves_every_file_as_it_is():
    result = ruff("format", "--check", ".")
    assert result.returncode == 0, (
        f"{result.stdout[-3000:]}{result.stderr[-1000:]}\nfix: ruff format ."
    )
