"""Train the project's fixed tokenizer once and commit the result (data/tokenizer.json).

Every step loads this one file, so every run sees exactly the same token ids. Re-running the
script reproduces the committed file bit for bit (BPE training here is deterministic); the test
suite checks that, so the committed file can always be traced back to this script.

    python data/train_tokenizer.py            # rewrites data/tokenizer.json
    python data/train_tokenizer.py --check    # exit 1 if the committed file differs
"""

import argparse
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

HERE = Path(__file__).resolve().parent
CORPUS = HERE / "tinyshakespeare.txt"
OUTPUT = HERE / "tokenizer.json"
VOCAB_SIZE = 2048  # small vocabulary: a small embedding table keeps the CPU runs fast
EOS = "<|endoftext|>"


def train(corpus: Path = CORPUS) -> Tokenizer:
    """Byte-level BPE, as GPT-2 uses: any byte sequence can be encoded, no unknown tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train([str(corpus)], trainer)
    return tokenizer


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--check", action="store_true", help="compare with the committed file instead of writing it"
    )
    args = parser.parse_args()
    text = train().to_str(pretty=True) + "\n"
    if args.check:
        same = OUTPUT.exists() and OUTPUT.read_text() == text
        print(
            "tokenizer.json is up to date"
            if same
            else "tokenizer.json differs from what train_tokenizer.py builds"
        )
        return 0 if same else 1
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT} ({VOCAB_SIZE} tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
