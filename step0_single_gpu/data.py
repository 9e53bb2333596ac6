"""The corpus as equal-length token blocks, and a resumable stream of micro-batches over them.

Every sample holds exactly ``seq_len + 1`` tokens (``seq_len`` inputs, ``seq_len`` targets), so
every micro-batch has the same number of target tokens and the mean of per-micro-batch mean losses
equals the mean over the whole global batch. That is what lets one process with accumulation A*N and
N processes with accumulation A compute the same thing.
"""

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from config import UserError


def file_sha256(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@dataclass
class Corpus:
    blocks: torch.Tensor  # (n_samples, seq_len + 1) token ids
    vocab_size: int
    data_sha256: str
    tokenizer_sha256: str


def load_tokenizer(path) -> Tokenizer:
    """The tokenizer in ``path`` (a tokenizers JSON file, as data/train_tokenizer.py writes), or a
    ``UserError``. A local file, read by the ``tokenizers`` library itself: no network at run
    time, ever."""
    try:
        return Tokenizer.from_file(str(path))
    except Exception:  # noqa: BLE001 (not JSON, JSON of something else: the library's words would not help)
        raise UserError(
            f"--tokenizer {path} is not a tokenizer file (the JSON that data/train_tokenizer.py "
            "writes); pass data/tokenizer.json"
        ) from None


def check_text(path) -> None:
    """Refuse a --data file that is not UTF-8 text,
    or holds none, with one line instead of a traceback."""
    try:
        text = Path(path).read_bytes().decode("utf-8")
    except UnicodeDecodeError as error:
        raise UserError(
            f"--data {path} is not UTF-8 text (byte {error.start} cannot be decoded); "
            "pass a plain text file"
        ) from None
    if not text.strip():
        raise UserError(f"--data {path} holds no text; pass a plain text file")


def load_corpus(text_path: str, tokenizer_path: str, seq_len: int) -> Corpus:
    """Tokenize a local text file with the fixed
    tokenizer and pack it into blocks of ``seq_len + 1``.

    The tail that does not fill a whole block is dropped. Block ``i`` is the same on every rank and
    in every run: samplers hand out block indices, never text.
    """
    tokenizer = load_tokenizer(tokenizer_path)
    check_text(text_path)
    # Line by line, newlines kept: they are part of the text the model should learn to write. Text
    # mode reads "\r\n" and "\r" as "\n"; this is what datasets' text loader (Dataset.from_text,
    # keep_linebreaks=True) hands the tokenizer, without importing it and pyarrow into every rank
    # (tests/test_data.py compares the two).
    with open(text_path, encoding="utf-8") as f:
        lines = f.readlines()
    ids = [token for encoding in tokenizer.encode_batch(lines) for token in encoding.ids]
    block = seq_len + 1
    n_blocks = len(ids) // block
    if n_blocks == 0:
        raise UserError(
            f"--data {text_path} holds {len(ids)} tokens, fewer than one block of "
            f"--seq-len {seq_len} + 1; "
            "lower --seq-len or pass more text"
        )
    blocks = torch.tensor(ids[: n_blocks * block], dtype=torch.long).view(n_blocks, block)
    return Corpus(
        blocks, tokenizer.get_vocab_size(), file_sha256(text_path), file_sha256(tokenizer_path)
    )


def check_enough_data(
    n_samples: int, world_size: int, micro_batch_size: int, grad_accum: int
) -> None:
    """Refuse, before any collective, a world size the data cannot feed.

    A distributed sampler gives every rank ceil(n / world_size) samples (padding by repeating), so
    every rank runs the same number of steps by construction. Each rank needs at least one full
    optimiser step of samples per epoch; otherwise it would have nothing to train on.
    """
    if world_size > n_samples:
        raise UserError(
            f"world size {world_size} is larger than the {n_samples} samples in the data; "
            f"use at most {n_samples} ranks or more data"
        )
    per_rank = -(-n_samples // world_size)
    needed = micro_batch_size * grad_accum
    if per_rank < needed:
        raise UserError(
            f"world size {world_size} leaves {per_rank} samples per rank, fewer than one optimiser "
            f"step needs ({micro_batch_size} x {grad_accum} = {needed}); use fewer "
            "ranks or smaller batches"
        )


class MicroBatches:
    """Micro-batches of ``micro_batch_size`` samples
    drawn in the order a sampler gives, epoch after epoch.

    ``sampler`` is anything with ``set_epoch``, ``__iter__`` and ``__len__`` (PyTorch's
    ``DistributedSampler`` or a hand-written one). An epoch has ``len(sampler) // micro_batch_size``
    micro-batches; the short remainder is dropped so every micro-batch has the same size.
    The position (epoch, micro-batch index) is the whole state: ``state_dict`` / ``load_state_dict``
    let a resumed run continue with exactly the batch the original run would have drawn next.
    No DataLoader: its iterator draws from torch's global generator, which would make the RNG
    state depend on when an epoch started and break bitwise resume with dropout on.
    """

    def __init__(self, blocks: torch.Tensor, sampler, micro_batch_size: int):
        self.blocks, self.sampler, self.micro_batch_size = blocks, sampler, micro_batch_size
        self.per_epoch = len(sampler) // micro_batch_size
        self.epoch, self.index = 0, 0
        self._order = None
        self.epoch_started = None  # set to the epoch number when next() starts an epoch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index, self._order = state["epoch"], state["index"], None

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets of the next micro-batch:
        ``(B, seq_len)`` each, targets shifted by one."""
        self.epoch_started = None
        if self.index == self.per_epoch:
            self.epoch, self.index, self._order = self.epoch + 1, 0, None
        if self._order is None:
            self.sampler.set_epoch(self.epoch)  # a new shuffle each epoch, the same on every rank
            self._order = torch.tensor(list(self.sampler), dtype=torch.long)
            self.epoch_started = self.epoch if self.index == 0 else None
        start = self.index * self.micro_batch_size
        batch = self.blocks[self._order[start : start + self.micro_batch_size]]
        self.index += 1
        return batch[:, :-1], batch[:, 1:]
