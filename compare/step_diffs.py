"""How big is each new idea? For every step folder against the one it grew from (the step before it,
unless its train.py says "Grown from step N's train.py": steps 8 and 9 grow from a data-parallel
step, not from step 7): the files added and removed, how many lines of train.py changed, and how
many lines a learner reads in the folder on a first pass (``learner_facing``), beside all its
Python lines.

    python compare/step_diffs.py           # print the table; exit 1 if README.md's copy is stale
    python compare/step_diffs.py --write   # rewrite the table in README.md

The table lives in README.md between the markers <!-- step-diffs:start --> and <!-- step-diffs:end
-->. Changed lines are the '+' and '-' lines of a unified diff (difflib), headers not counted; a
train.py that one folder lacks counts as empty. Lines of a file are its lines of text, blank ones
and comments included.
"""

import argparse
import difflib
import json
import re
import sys
from pathlib import Path

# config.py, as every step has it
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "common"))
from config import OneLineParser, UserError, exit_on_user_error  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
START, END = "<!-- step-diffs:start -->", "<!-- step-diffs:end -->"

# The rule for learner-facing lines: what a learner reads on a first pass through a step folder, the
# files that say what the step does. That is train.py; the idea files, i.e. every Python file that
# is not a copy of a common/ module (new in this step, or copied from the step that introduced it),
# less the trace modules (*_trace.py: a timeline for a figure); and, of common/'s copies,
# LESSON_COPIES: the model, the data, the process group (what steps 1 and up are about) and the
# checkpoint basics (and LESSON_COPIES_IN's). Every other copy is skipped on a first read, and each
# step README says so in a paragraph that starts with SKIP_LINE: plumbing train.py calls by name
# (flags, seeds, optimiser helpers, records, bytes per collective) and operations code (failures.py,
# memory_budget.py, collective_failures.py). Lines are counted as they are, blank ones and
# comments included.
LESSON_COPIES = {"model.py", "data.py", "distributed.py", "checkpoint.py"}
# And where a shared module is the step's lesson: the norms over slices in step 5 (reused as
# plumbing after it), the MoE layer in step 12 (in step 0 it is a flag's plumbing).
LESSON_COPIES_IN = {"step5_zero1": {"sharded_norms.py"}, "step12_expert_parallel": {"moe.py"}}
SKIP_LINE = "**Skip on a first read:**"


def step_folders() -> list[Path]:
    """Every step folder that holds at least one file, in step order (step10 after step9)."""
    return sorted(
        (
            p
            for p in REPO_ROOT.glob("step*_*")
            if re.fullmatch(r"step\d+_\w+", p.name) and p.is_dir() and files_of(p)
        ),
        key=lambda p: int(p.name[4:].split("_")[0]),
    )


def base_of(folder: Path, folders: list[Path]) -> Path:
    """The folder ``folder`` grew from: the one its train.py names ("Grown from step 3's train.py"),
    else the step before it."""
    train = folder / "train.py"
    named = (
        re.search(r"[Gg]rown from step (\d+)'s train\.py", train.read_text())
        if train.is_file()
        else None
    )
    if named:
        return next(f for f in folders if f.name.startswith(f"step{named.group(1)}_"))
    return folders[folders.index(folder) - 1]


def files_of(folder: Path) -> set[str]:
    return {
        p.relative_to(folder).as_posix()
        for p in folder.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and not p.name.startswith(".")
    }


def common_copies(folder: Path) -> set[str]:
    """The files ``folder`` holds as copies of a common/ module (common/copies.json)."""
    manifest = json.loads((REPO_ROOT / "common" / "copies.json").read_text())
    return {
        Path(origin).name
        for origin in manifest.get(folder.name, [])
        if origin.startswith("common/")
    }


def learner_facing(folder: Path) -> set[str]:
    """The Python files of ``folder`` a learner reads on a first pass
    (the rule above LESSON_COPIES)."""
    copies = common_copies(folder)
    return {
        f
        for f in files_of(folder)
        if f.endswith(".py")
        and (
            f in LESSON_COPIES | LESSON_COPIES_IN.get(folder.name, set())
            or (f not in copies and not f.endswith("_trace.py"))
        )
    }


def skipped_on_first_read(folder: Path) -> set[str]:
    """The Python files of ``folder`` its README tells a learner to skip on a first read."""
    return {f for f in files_of(folder) if f.endswith(".py")} - learner_facing(folder)


def line_count(folder: Path, files) -> int:
    return sum(len((folder / f).read_text().splitlines()) for f in files)


def changed_lines(a: Path, b: Path) -> tuple[int, int]:
    """(lines added, lines removed) from ``a`` to ``b``; a missing file counts as empty."""
    lines = [p.read_text().splitlines() if p.is_file() else [] for p in (a, b)]
    diff = list(difflib.unified_diff(*lines, lineterm=""))
    added = sum(1 for line in diff if line.startswith("+") and not line.startswith("+++"))
    removed = sum(1 for line in diff if line.startswith("-") and not line.startswith("---"))
    return added, removed


def table() -> str:
    def names(files):
        return ", ".join(f"`{f}`" for f in sorted(files)) or "-"

    def lines(folder):
        python = [f for f in files_of(folder) if f.endswith(".py")]
        return f"{line_count(folder, learner_facing(folder)):,} ({line_count(folder, python):,})"

    # learner-facing lines beyond step 0's and this step's idea files (distributed.py one)
    def beyond(folder):
        ideas = learner_facing(folder) - {"train.py"} - (LESSON_COPIES - {"distributed.py"})
        extra = (
            line_count(folder, learner_facing(folder))
            - line_count(folders[0], learner_facing(folders[0]))
            - line_count(folder, ideas)
        )
        return f"{extra:+d}"

    rows = [
        "| from -> to | files added | files removed | `train.py` lines changed (+ / -) "
        "| learner-facing lines of *to* (all Python lines) | beyond step 0's + *to*'s idea files |",
        "|---|---|---|---|---|---|",
    ]
    folders = step_folders()
    rows.append(
        f"| - -> `{folders[0].name}` | (the starting point) | - | - | {lines(folders[0])} | - |"
    )
    for b in folders[1:]:
        a = base_of(b, folders)
        fa, fb = files_of(a), files_of(b)
        added, removed = changed_lines(a / "train.py", b / "train.py")
        rows.append(
            f"| `{a.name}` -> `{b.name}` | {names(fb - fa)} | {names(fa - fb)} | "
            f"{added + removed} (+{added} / -{removed}) | {lines(b)} | {beyond(b)} |"
        )
    return "\n".join(rows)


def split_readme(text: str, readme: Path) -> tuple[str, str, str]:
    """(before the start marker, the table between the markers, from the end marker on)."""
    if text.count(START) != 1 or text.count(END) != 1 or text.index(START) > text.index(END):
        raise UserError(
            f"{readme} needs one {START} line and, after it, one {END} line around the table"
        )
    before, rest = text.split(START)
    between, after = rest.split(END)
    return before + START, between.strip("\n"), END + after


def main() -> int:
    parser = OneLineParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--write", action="store_true", help="rewrite the table in the README")
    parser.add_argument("--readme", type=Path, default=REPO_ROOT / "README.md")
    args = parser.parse_args()
    if not args.readme.is_file():
        raise UserError(f"{args.readme} does not exist")
    text = args.readme.read_text()
    before, current, after = split_readme(text, args.readme)
    fresh = table()
    if args.write:
        args.readme.write_text(f"{before}\n{fresh}\n{after}")
        print(f"wrote the step-diffs table into {args.readme}")
        return 0
    print(fresh)
    if current != fresh:
        print(
            f"{args.readme}: the step-diffs table is stale; run python "
            "compare/step_diffs.py --write"
        )
        return 1
    print(f"{args.readme}: the step-diffs table is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main))
