"""common/data.py reads the corpus itself (Python's text mode, line by line, newlines kept) instead
of through datasets, whose import (with pyarrow) cost every rank about 1.5 CPU seconds. Checked
against the reader it replaces, datasets' ``Dataset.from_text(keep_linebreaks=True)``, on the
shipped corpus and on text whose line ends are awkward, line for line and block for block."""

import subprocess
import sys

import datasets
import pytest
import torch

import data  # common/, on the path through conftest
from conftest import REPO

TOKENIZER = REPO / "data" / "tokenizer.json"
AWKWARD = (
    "First line\nWindows\r\nold Mac\rform\x0cfeed and\u2028separator\n\n\nno newline at the end: "
    "\u00e9\u00e8 \u4e2d\u6587"
).encode("utf-8")


def from_text(path) -> list[str]:
    datasets.disable_progress_bars()
    return datasets.Dataset.from_text(str(path), keep_linebreaks=True, keep_in_memory=True)[:][
        "text"
    ]


@pytest.mark.quick
@pytest.mark.parametrize("text", ["corpus", "awkward"])
def test_the_corpus_is_read_as_datasets_reads_it(text, tmp_path):
    path = REPO / "data" / "tinyshakespeare.txt"
    if text == "awkward":
        path = tmp_path / "awkward.txt"
        path.write_bytes(AWKWARD)
    with open(path, encoding="utf-8") as f:
        ours = f.readlines()  # what load_corpus tokenizes
    assert ours == from_text(path)
    seq_len = 8 if text == "awkward" else 64
    tokenizer = data.load_tokenizer(TOKENIZER)
    ids = [t for encoding in tokenizer.encode_batch(from_text(path)) for t in encoding.ids]
    n = len(ids) // (seq_len + 1)
    expected = torch.tensor(ids[: n * (seq_len + 1)]).view(n, seq_len + 1)
    assert torch.equal(data.load_corpus(str(path), str(TOKENIZER), seq_len).blocks, expected)


@pytest.mark.quick
def test_the_trainers_do_not_import_datasets():
    code = (
        "import sys; sys.path.insert(0, 'common'); import data, model, training; "
        "print(sorted(m for m in ('datasets', 'pyarrow') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stdout + result.stderr
