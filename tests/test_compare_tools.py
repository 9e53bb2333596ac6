"""compare/sample.py on the tour's step-1 run,
and compare/step_diffs.py on this repository's README."""

import subprocess
import sys

import pytest
import torch

from conftest import REPO, STEPS, TIMEOUT, metrics, run_forked, train, weights


def tool(name, *args):
    return run_forked([sys.executable, str(REPO / "compare" / name), *map(str, args)], timeout=120)


def samples(*runs):
    """compare/sample.py once per argument list, all started together (most of each is imports)."""
    procs = [
        subprocess.Popen(
            [sys.executable, str(REPO / "compare" / "sample.py"), *map(str, args)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for args in runs
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=180)
        results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return results


def test_sampling_is_seeded_and_greedy_ignores_the_seed(step1_ws2):
    """The command line once; the seeds compared in this process with the function it calls (each
    command line is mostly imports)."""
    import sample  # compare/ is on sys.path (conftest)

    (first,) = samples([step1_ws2, "--tokens", "20", "--seed", "3"])
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("ROMEO:") and len(first.stdout) > len("ROMEO:\n")
    model, tokenizer, config = sample.load_trained_model(str(step1_ws2))

    def text(prompt, tokens, temperature, seed):
        ids = tokenizer.encode(prompt).ids
        return (
            tokenizer.decode(
                sample.generate(model, ids, tokens, temperature, 40, seed, config["seq_len"])
            )
            + "\n"
        )

    assert text("ROMEO:", 20, 0.8, 3) == first.stdout, "same seed, different text"
    assert text("ROMEO:", 20, 0.8, 4) != first.stdout, "the seed does not reach the sampler"
    greedy = text("JULIET:", 10, 0.0, 1)
    assert greedy.startswith("JULIET:") and greedy == text("JULIET:", 10, 0.0, 2)


def test_sample_loads_the_runs_final_weights(step1_ws2):
    import sample  # compare/ is on sys.path (conftest)

    model, tokenizer, config = sample.load_trained_model(str(step1_ws2))
    params = dict(model.named_parameters())
    assert not model.training, "dropout would be on while generating"
    for name, tensor in weights(step1_ws2).items():
        assert torch.equal(params[name], tensor), name
    # tied: named_parameters() lists the shared tensor once, as transformer.wte.weight
    assert (
        model.lm_head.weight is model.transformer.wte.weight
        and tokenizer.get_vocab_size() == model.lm_head.weight.shape[0]
    )


@pytest.mark.quick
def test_readme_step_diffs_table_is_up_to_date():
    result = tool("step_diffs.py")
    assert result.returncode == 0, (
        f"{result.stdout}\nregenerate it: python compare/step_diffs.py --write"
    )


@pytest.mark.quick
def test_step_diffs_counts_changed_lines_and_files(tmp_path):
    import step_diffs

    (tmp_path / "a.py").write_text("1\n2\n3\n")
    (tmp_path / "b.py").write_text("1\nX\n3\n4\n")
    assert step_diffs.changed_lines(tmp_path / "a.py", tmp_path / "b.py") == (2, 1)  # +X +4, -2
    assert step_diffs.changed_lines(tmp_path / "a.py", tmp_path / "a.py") == (0, 0)
    assert step_diffs.changed_lines(tmp_path / "a.py", tmp_path / "none.py") == (0, 3)
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / "a.pyc").write_bytes(b"")
    assert step_diffs.files_of(tmp_path) == {"a.py", "b.py"}


@pytest.mark.quick
def test_step_diffs_detects_and_rewrites_a_stale_table(tmp_path):
    readme = tmp_path / "README.md"
    text = (REPO / "README.md").read_text()
    stale = text.replace(
        "| `step0_single_gpu` -> `step1_torch_ddp` |", "| `step0_single_gpu` -> `stepX` |"
    )
    assert stale != text
    readme.write_text(stale)
    assert tool("step_diffs.py", "--readme", readme).returncode == 1
    assert tool("step_diffs.py", "--readme", readme, "--write").returncode == 0
    assert readme.read_text() == text
    readme.write_text("no markers here\n")
    result = tool("step_diffs.py", "--readme", readme)
    assert result.returncode == 2 and result.stderr.startswith("error: ")


@pytest.mark.quick
def test_learner_facing_lines_follow_the_rule(tmp_path):
    """train.py, the idea files (not a copy of common/, not a *_trace.py) and the copies in
    LESSON_COPIES count; the other copies of common/ do not. Counted against files written here, not
    against the repository."""
    import step_diffs

    # named in common/copies.json: its copies are the manifest's
    folder = tmp_path / "step0_single_gpu"
    folder.mkdir()
    for name, lines in {
        "train.py": 3,
        "model.py": 2,
        "checkpoint.py": 4,
        "config.py": 5,
        "failures.py": 7,
        "idea.py": 6,
        "idea_trace.py": 8,
        "README.md": 9,
    }.items():
        (folder / name).write_text("x\n" * lines)
    assert step_diffs.learner_facing(folder) == {"train.py", "model.py", "checkpoint.py", "idea.py"}
    assert step_diffs.skipped_on_first_read(folder) == {"config.py", "failures.py", "idea_trace.py"}
    assert step_diffs.line_count(folder, step_diffs.learner_facing(folder)) == 3 + 2 + 4 + 6


@pytest.mark.quick
def test_every_step_readme_names_the_files_to_skip_on_a_first_read():
    """Each step README has one paragraph starting with step_diffs.SKIP_LINE, and the files it names
    are exactly the ones the learner-facing count leaves out: a module added to a step, or moved,
    keeps the two true."""
    import re

    import step_diffs

    for folder in step_diffs.step_folders():
        paragraphs = (folder / "README.md").read_text().split("\n\n")
        skip = [p for p in paragraphs if p.startswith(step_diffs.SKIP_LINE)]
        assert len(skip) == 1, (
            f"{folder.name}/README.md: one paragraph starting with {step_diffs.SKIP_LINE}"
        )
        named = set(re.findall(r"`([\w.]+\.py)`", skip[0])) - {"train.py"}
        assert named == step_diffs.skipped_on_first_read(folder), folder.name


@pytest.mark.quick
def test_compare_readme_names_every_tool():
    """compare/README.md lists every script in compare/, once, with a line of what it does (a new
    tool that nobody can find is not there for a learner), and the front page's Layout points
    to it."""
    import re

    rows = re.findall(
        r"^\| `(\w+\.py)` \| (.+) \|$",
        (REPO / "compare" / "README.md").read_text(),
        flags=re.MULTILINE,
    )
    listed = [name for name, _ in rows]
    tools = {p.name for p in (REPO / "compare").glob("*.py")}
    assert len(listed) == len(set(listed)) and all(len(what) > 10 for _, what in rows)
    assert tools - set(listed) == set(), "compare/ tools missing from compare/README.md"
    assert set(listed) - tools == set(), "compare/README.md names tools that compare/ does not have"
    readme = (REPO / "README.md").read_text()
    assert "compare/README.md" in readme[readme.index("## Layout") :]


def test_every_run_records_what_it_cost_every_launch_included(tour, tmp_path, small_corpus):
    """Each record's device_s is the job's devices x the wall time since the record before it, so
    over a launch they add up to devices x its last since_start_s; metrics.json's cost sums them and
    counts the tokens the tour's global batch gives (4 steps x 8 samples x 32 tokens, at every
    layout). A run resumed from step 2 keeps the first launch's two records and their cost.
    compare/cost.py puts runs side by side."""
    runs, _ = tour
    for name in ("step0", "step1", "step7", "step9"):
        m = metrics(runs / STEPS[name])
        records, cost, world = m["records"], m["cost"], m["env"]["world_size"]
        assert cost["devices"] == world and cost["steps_timed"] == 4
        assert cost["tokens"] == 4 * 8 * 32, name
        assert cost["device_s"] == pytest.approx(sum(r["device_s"] for r in records), abs=1e-3)
        assert cost["device_s"] == pytest.approx(
            world * records[-1]["since_start_s"], abs=4 * world * 1e-4
        ), name
        assert cost["tokens_per_device_hour"] == pytest.approx(
            cost["tokens"] / (cost["device_s"] / 3600)
        )
        # one node holding every rank: the whole step per its slowest rank's second
        for r in records:
            wall, busy = (
                max(t["wall_s"] for t in r["step_time"]),
                max(t["cpu_s"] for t in r["step_time"]),
            )
            assert r["per_node"] == [
                {
                    "node": 0,
                    "ranks": world,
                    "samples_per_s": pytest.approx(8 / wall),
                    "tokens_per_s": pytest.approx(8 * 32 / wall),
                    "busy_tokens_per_s": pytest.approx(8 * 32 / busy),
                }
            ], name
        medians = sorted(r["per_node"][0]["samples_per_s"] for r in records)[2]
        assert [n["node"] for n in cost["per_node"]] == [0] and cost["per_node"][0][
            "samples_per_s"
        ] == medians
    first = metrics(runs / STEPS["step1"])
    resumed = train(
        "step1",
        tmp_path / "resumed",
        small_corpus,
        "--resume",
        str(runs / STEPS["step1"] / "checkpoints" / "step_2"),
        *TIMEOUT,
    )
    later = metrics(resumed)
    assert [r["device_s"] for r in later["records"][:2]] == [
        r["device_s"] for r in first["records"][:2]
    ]
    assert later["cost"]["device_s"] == pytest.approx(
        sum(r["device_s"] for r in later["records"]), abs=1e-3
    )
    assert later["cost"]["tokens"] == 4 * 8 * 32
    shown = tool("cost.py", runs / STEPS["step0"], resumed)
    assert shown.returncode == 0, shown.stderr
    rows = shown.stdout.splitlines()
    assert rows[2].split()[:4] == ["resumed", "2", "4", "1,024"], shown.stdout
