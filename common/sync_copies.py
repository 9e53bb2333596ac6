"""Refresh the verbatim copies of shared files in the step folders, or check that none has drifted.

Each step folder is standalone (it imports nothing from outside itself), so shared modules are
copied into it rather than imported. ``common/copies.json`` lists, per step folder, the origin of
every copy. Fix a bug in the origin, then run this.

    python common/sync_copies.py           # copy every origin over its copies
    python common/sync_copies.py --check   # exit 1 and name the files that differ
"""

import argparse
import json
import shutil
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
MANIFEST = REPO_ROOT / "common" / "copies.json"


def copy_pairs() -> list[tuple[Path, Path]]:
    """(origin, copy) for every copy in the manifest."""
    manifest = json.loads(MANIFEST.read_text())
    return [
        (REPO_ROOT / origin, REPO_ROOT / folder / Path(origin).name)
        for folder, origins in manifest.items()
        if not folder.startswith("_")
        for origin in origins
    ]


def stale_copies() -> list[Path]:
    return [
        copy
        for origin, copy in copy_pairs()
        if not copy.exists() or copy.read_bytes() != origin.read_bytes()
    ]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--check", action="store_true", help="only report copies that differ from their origin"
    )
    args = parser.parse_args()
    missing = [origin for origin, _ in copy_pairs() if not origin.is_file()]
    if missing:
        print(
            "origin missing (fix common/copies.json): "
            f"{', '.join(str(m.relative_to(REPO_ROOT)) for m in missing)}"
        )
        return 1
    stale = stale_copies()
    if args.check:
        for copy in stale:
            print(f"differs from its origin: {copy.relative_to(REPO_ROOT)}")
        print(f"{len(copy_pairs()) - len(stale)} of {len(copy_pairs())} copies match their origin")
        return 1 if stale else 0
    for origin, copy in copy_pairs():
        if copy in stale:
            shutil.copyfile(origin, copy)
            print(f"copied {origin.relative_to(REPO_ROOT)} -> {copy.relative_to(REPO_ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
