"""compare/plan.py's commands (issue 49): every layout it lists for the trainers' model comes with
the torchrun command that trains it, which the step's own parser accepts and which gives back the
layout, or with one line saying why no trainer runs it; and the top runnable layouts, trained, hold
the bytes the plan gave their rows."""

import contextlib
import functools
import importlib.util
import io
import json
import math
import re
import shlex
import sys
from pathlib import Path

import pytest

import estimate  # compare/, on the path through conftest
import plan
from conftest import REPO, TIMEOUT, assert_all_to_all_closed_form, metrics, run_forked, run_ranks

# At 4 ranks of the trainers' default model: budgets that list DDP, ZeRO-1/2/3, checkpointing, dp x
# pp and tp; 4 blocks for pp 4 (every layout fits in 1 GiB) and the interleaved schedule; 16-bit
# parameters; HSDP and offload at 8; a global batch too small for dp 4, so that context parallelism
# is listed.
PLANS = [
    ["--devices", "4", "--memory-gb", "0.03"],
    ["--devices", "4", "--memory-gb", "1", "--n-layer", "4"],
    ["--devices", "4", "--memory-gb", "0.02"],
    ["--devices", "4", "--memory-gb", "0.012", "--n-layer", "4", "--global-batch", "128"],
    [
        "--devices",
        "4",
        "--memory-gb",
        "0.02",
        "--n-layer",
        "4",
        "--schedule",
        "interleaved-1f1b",
        "--global-batch",
        "128",
        "--sequence-parallel",
    ],
    [
        "--devices",
        "4",
        "--memory-gb",
        "0.02",
        "--param-dtype",
        "bf16",
        "--reduce-every-micro-batch",
    ],
    [
        "--devices",
        "8",
        "--memory-gb",
        "0.02",
        "--hsdp",
        "--offload-optimizer",
        "--selective-recompute",
    ],
    ["--devices", "4", "--memory-gb", "0.03", "--global-batch", "8", "--schedule", "zero-bubble"],
]


def planned(argv: list[str], json_path: Path) -> tuple[list[dict], str]:
    """``compare/plan.py ARGV --top 1000 --json PATH`` in this process:
    every layout that fits, and the table."""
    saved, out = sys.argv, io.StringIO()
    sys.argv = ["compare/plan.py", *argv, "--top", "1000", "--json", str(json_path)]
    try:
        with contextlib.redirect_stdout(out):
            assert plan.main() == 0
    finally:
        sys.argv = saved
    return json.loads(json_path.read_text())["fit"], out.getvalue()


# Why a listed layout may have no command (issue 49: every other layout has one): what step 10
# refuses, what only steps 5-7, step 6 or step 7 have.
NO_COMMAND = [
    r"ZeRO-3 with (sequence parallelism|zero bubble): step 10 refuses it "
    r"\(zero3_on_mesh.py's rule 6\)",
    r"cp with (sequence parallelism|selective recomputation): step 10 refuses it .*",
    r"checkpointing with zero bubble: step 10 refuses it .*",
    r"(bf16|fp16) parameters with .*: steps 5-7 alone have --param-dtype",
    r"ZeRO-[23] reducing every micro-batch.*",
]


class Parsed(Exception):
    """Raised from a step's main() with the parser it built: nothing after parsing runs."""


@functools.cache
def trainer_parser(step: str):
    """(the parser ``python STEP/train.py`` builds, its ``parse_config``), in this process: the
    step's main() run up to its ``parse_config`` (its flags added as it adds them), from its own
    folder's modules, imported afresh and forgotten after."""

    def ours(module) -> bool:
        return Path(getattr(module, "__file__", None) or "/").resolve().parent.parent == REPO

    saved = {name: module for name, module in sys.modules.items() if ours(module)}
    for name in saved:
        del sys.modules[name]
    sys.path.insert(0, str(REPO / step))
    try:
        spec = importlib.util.spec_from_file_location(f"{step}_train", REPO / step / "train.py")
        train = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(train)
        parse_config = train.parse_config

        def stop(parser):
            raise Parsed(parser)

        train.parse_config = stop
        with pytest.raises(Parsed) as parsed:
            train.main()
        return parsed.value.args[0], parse_config
    finally:
        sys.path.remove(str(REPO / step))
        for name, module in list(sys.modules.items()):
            if ours(module):
                del sys.modules[name]
        sys.modules.update(saved)


def parse_as_trainer(step: str, argv: list[str]) -> dict:
    """The config ``python STEP/train.py ARGV`` parses:
    its own parser's, and the checks of its parse_config."""
    parser, parse_config = trainer_parser(step)
    return parse_config(parser, argv)


def split(command: str) -> tuple[int, str, list[str]]:
    """(ranks, step folder, flags) of ``torchrun --nproc-per-node N STEP/train.py FLAGS``."""
    words = shlex.split(command)
    assert words[:2] == ["torchrun", "--nproc-per-node"] and words[3].endswith("/train.py"), command
    return int(words[2]), words[3].split("/")[0], words[4:]


def layout_of_flags(step: str, nproc: int, config: dict) -> dict:
    """The layout a step trains with these flags, read back from its parsed config."""
    number = int(step[4:].split("_")[0])
    dp, cp, tp, pp = nproc, 1, 1, 1
    if number == 8:
        dp, tp = 1, nproc
    elif number == 9:
        dp, pp = 1, nproc
    elif number == 10:
        dp, cp, tp, pp = config["dp"], config["cp"], config["tp"], config["pp"]
        assert dp * cp * tp * pp == nproc
    elif number == 11:
        cp = config["cp"]
        dp = nproc // cp
    recompute = config.get("activation_checkpointing", "none")
    return {
        "dp": dp,
        "cp": cp,
        "tp": tp,
        "pp": pp,
        # step 10: its --zero (default 1)
        "zero": config.get("zero", plan.ZERO_OF_STEP.get(number, 0)) if dp * cp > 1 else 0,
        "replicate": config.get("replicate") or 1,
        "offload": config.get("offload_optimizer", False),
        "checkpointing": recompute == "full",
        "selective": recompute == "selective",
        "sequence_parallel": config.get("sequence_parallel", False),
        "micro_batches": config.get("micro_batches") or config["grad_accum"],
    }


@pytest.mark.quick
def test_every_listed_layout_has_a_command_its_trainer_parses_or_says_why_not(tmp_path):
    """For a few budgets and flags, every layout that fits: a command whose flags the step's own
    parser accepts and that gives back the layout (mesh, ZeRO stage, HSDP, offload, recomputation,
    SP, M, schedule, the model, the global batch), or one line saying why no trainer runs it; both
    in the table under the layout's row. Across them, every trainer of a layout (steps 1, 5-11) is
    chosen somewhere, step 10 with cp too."""
    chosen, parsed = set(), {}
    for i, argv in enumerate(PLANS):
        fit, table = planned(argv, tmp_path / f"plan{i}.json")
        global_batch = int(table.split("global batch ")[1].split()[0])
        assert fit, argv
        for c in fit:
            assert (c["command"] is None) != (c["no_command"] is None), c
            assert f"\n    {c['command'] or 'no command: ' + c['no_command']}\n" in table + "\n", c
            if c["no_command"]:
                assert "\n" not in c["no_command"] and any(
                    re.fullmatch(f"no trainer runs {why}", c["no_command"]) for why in NO_COMMAND
                ), c
                continue
            nproc, step, flags = split(c["command"])
            assert nproc == int(argv[1]), c["command"]
            if (step, *flags) not in parsed:
                parsed[step, *flags] = parse_as_trainer(step, flags)
            config = parsed[step, *flags]
            wanted = {
                k: c[k]
                for k in (
                    "dp",
                    "cp",
                    "tp",
                    "pp",
                    "zero",
                    "replicate",
                    "offload",
                    "checkpointing",
                    "selective",
                    "sequence_parallel",
                    "micro_batches",
                )
            }
            assert layout_of_flags(step, nproc, config) == wanted, c["command"]
            if c["pp"] > 1:
                assert config["schedule"] == c["schedule"], c["command"]
            assert (config["n_layer"], config["n_embd"], config["n_head"], config["seq_len"]) == (
                int(dict(zip(argv, argv[1:])).get("--n-layer", 2)),
                128,
                4,
                64,
            ), c["command"]
            assert config.get("param_dtype", "float32") == dict(zip(argv, argv[1:])).get(
                "--param-dtype", "float32"
            )
            assert config["micro_batch_size"] * config["grad_accum"] * c["dp"] == global_batch, c[
                "command"
            ]
            chosen.add(step)
            if (
                step == "step10_3d_parallel" and c["dp"] * c["cp"] > 1
            ):  # each --zero, with and without a model axis
                chosen.add(
                    f"step10 --zero {c['zero']}, "
                    f"{'mesh' if c['tp'] * c['pp'] * c['cp'] > 1 else 'dp'}"
                )
            if step == "step10_3d_parallel" and c["replicate"] > 1:  # HSDP beside a model axis
                chosen.add("step10 --zero 3 --replicate")
            if step == "step10_3d_parallel" and c["offload"]:  # ZeRO-Offload beside a model axis
                chosen.add("step10 --zero 3 --offload-optimizer")
            if step == "step10_3d_parallel" and c["cp"] > 1:
                chosen.add(
                    "step10 with cp and " + ("tp" if c["tp"] > 1 else "pp" if c["pp"] > 1 else "dp")
                )
    # the fourth axis on the mesh
    assert {s for s in chosen if s.startswith("step10 with cp")}, chosen
    # DDP, ZeRO-1 and ZeRO-2 on step 10, beside tp, pp or
    # cp and (with recomputation) alone; ZeRO-3 beside them
    assert {f"step10 --zero {z}, {at}" for z in range(3) for at in ("mesh", "dp")} <= chosen, chosen
    assert {
        "step10 --zero 3, mesh",
        "step10 --zero 3 --replicate",
        "step10 --zero 3 --offload-optimizer",
    } <= chosen, chosen
    chosen = {s for s in chosen if not s.startswith("step10 ")}
    assert chosen == {
        "step1_torch_ddp",
        "step5_zero1",
        "step6_zero2",
        "step7_zero3",
        "step8_tensor_parallel",
        "step9_pipeline_parallel",
        "step10_3d_parallel",
        "step11_context_parallel",
    }, chosen


@pytest.mark.quick
def test_a_model_no_trainer_builds_gets_one_line_and_no_commands(tmp_path):
    fit, table = planned(
        ["--devices", "8", "--memory-gb", "80", "--preset", "gpt2"], tmp_path / "plan.json"
    )
    assert all(c["command"] is None and "not the trainers' GPT-2" in c["no_command"] for c in fit)
    assert "no commands: not the trainers' GPT-2" in table and "\n    no command" not in table
    assert "torchrun" not in table


def test_the_top_runnable_layouts_train_and_hold_what_the_plan_says(small_corpus, tmp_path):
    """The trainers' default model at 4 ranks, 20 MiB each: the first 3 layouts that have a command
    (2026-12: DDP and ZeRO-2 with checkpointing at dp 4, DDP at dp 2 x pp 2, all three step 10 with
    --zero 0 or 2, which had no trainer before), and the first ZeRO-3 layout with tp (dp 2 x tp 2,
    step 10's --zero 3, which had none either), each trained 2 steps as its command says. Each run's
    mesh and ZeRO stage are its row's; ``compare/plan.py --measured`` passes them; every rank's
    recorded params + grads + AdamW state is within the same tolerance of its stage's row in the
    plan; the ZeRO-3 run's params, grads, gathered units and accumulated gradient are the row's to
    the byte."""
    fit, _ = planned(["--devices", "4", "--memory-gb", "0.02"], tmp_path / "plan.json")
    runnable = [c for c in fit if c["command"]][:3]
    assert (
        len({(c["dp"], c["tp"], c["pp"], c["zero"], c["checkpointing"]) for c in runnable}) == 3
    ), [c["command"] for c in runnable]
    # step 10's --zero 0 or 2 among them: what a run of its stage holds, measured
    assert any(" --zero " in c["command"] for c in runnable), [c["command"] for c in runnable]
    runnable.append(next(c for c in fit if c["command"] and c["zero"] == 3 and c["tp"] > 1))
    assert " --zero 3" in runnable[-1]["command"], runnable[-1]["command"]
    runs = []
    for i, c in enumerate(runnable):
        nproc, step, flags = split(c["command"])
        out = tmp_path / f"run{i}_{step}"
        result = run_ranks(
            REPO / step / "train.py",
            [
                *flags,
                "--steps",
                "2",
                "--save-every",
                "0",
                "--quiet",
                "--data",
                str(small_corpus),
                "--out",
                str(out),
                *TIMEOUT,
            ],
            nproc,
        )
        assert result.returncode == 0, (
            f"{c['command']} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        )
        run = metrics(out)
        mesh = plan.layout_of(run)
        assert (mesh["dp"], mesh["tp"], mesh["pp"], mesh["zero"]) == (
            c["dp"] * c["cp"],
            c["tp"],
            c["pp"],
            c["zero"],
        )
        for row in plan.measured_rows(run, estimate.vocabulary_size(run["config"]["tokenizer"])):
            stage = c["stages"][row["stage"]]
            planned_state = sum(stage[kind] for kind in estimate.KINDS)
            measured = sum(row["measured"].values())
            assert abs(measured / planned_state - 1) <= plan.MEASURED_TOLERANCE, (
                c["command"],
                row,
                stage,
            )
            assert math.isclose(sum(row["estimated"].values()), planned_state, rel_tol=1e-9), (
                c["command"],
                row,
            )
            if c["zero"] == 3:  # the pieces, their gradients, the units gathered, the gradient held
                memory = run["records"][-1]["memory"][row["rank"]]
                assert (
                    memory["params"],
                    memory["grads"],
                    memory["gathered_peak"],
                    memory["accumulated_grads"],
                ) == (stage["params"], stage["grads"], stage["gathered"], stage["accumulated"]), (
                    memory,
                    stage,
                )
        runs.append(str(out))
    result = run_forked(
        [sys.executable, str(REPO / "compare" / "plan.py"), "--measured", *runs], timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.rstrip().endswith("within 5% of the estimate: yes"), result.stdout


def test_the_ep_layouts_train_and_hold_and_send_what_the_plan_says(small_corpus, tmp_path):
    """``plan.py --moe-experts E``: step 12's layouts (every ep dividing E and the ranks), each with
    the command that trains it, in step 12 and on step 10's mesh (--dp N --ep D, ZeRO-1). Each
    command, trained one step at 2 ranks: every rank's parameters and gradients are the row's to the
    byte, its model state within the tolerance (AdamW's step counts), and the all-to-all bytes of
    the step, averaged over the ranks (over a group what is sent arrives), the row's dropless figure
    exactly, and each rank's the closed form (conftest.assert_all_to_all_closed_form: the tests'
    other step-12 runs drop slots)."""
    argv = [
        "--moe-experts",
        "4",
        "--devices",
        "2",
        "--memory-gb",
        "1",
        "--n-layer",
        "2",
        "--n-embd",
        "32",
        "--n-head",
        "2",
        "--seq-len",
        "32",
        "--micro-batch-size",
        "2",
        "--grad-accum",
        "2",
        "--json",
        str(tmp_path / "plan.json"),
    ]
    result = run_forked([sys.executable, str(REPO / "compare" / "plan.py"), *argv], timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    layouts = json.loads((tmp_path / "plan.json").read_text())["layouts"]
    assert [row["ep"] for row in layouts] == [1, 2] and all(
        row["fits"] and row["command"] for row in layouts
    )
    assert layouts[1]["params"] < layouts[0]["params"]  # half the experts a rank
    # ZeRO-1 on the mesh: less than step 12's ZeRO-0
    assert all(sum(r["mesh_state"].values()) < sum(r["state"].values()) for r in layouts)
    runs = [(row, row["command"], row["state"], row["all_to_all_handed"], "") for row in layouts]
    runs += [
        (row, row["mesh_command"], row["mesh_state"], row["mesh_all_to_all_handed"], ", step 10")
        for row in layouts
    ]
    for row, command, state, handed, on in runs:
        assert f"  ep {row['ep']}{on}: {command}" in result.stdout
        nproc, step, flags = split(command)
        assert (nproc, step) == (2, "step12_expert_parallel" if not on else "step10_3d_parallel")
        out = tmp_path / f"ep{row['ep']}{on.replace(', step ', '_')}"
        trained = run_ranks(
            REPO / step / "train.py",
            [
                *flags,
                "--steps",
                "1",
                "--save-every",
                "0",
                "--quiet",
                "--data",
                str(small_corpus),
                "--out",
                str(out),
                *TIMEOUT,
            ],
            nproc,
        )
        assert trained.returncode == 0, f"{command} failed:\n{trained.stderr[-3000:]}"
        record = metrics(out)["records"][-1]
        assert record["moe"]["dropped_fraction"] == [0.0, 0.0]  # dropless, as the plan assumes
        for memory in record["memory"]:
            assert (memory["params"], memory["grads"]) == (state["params"], state["grads"])
            measured = sum(memory[kind] for kind in estimate.KINDS)
            planned = sum(state.values())
            assert abs(measured / planned - 1) <= plan.MEASURED_TOLERANCE, (command, memory)
        sent = [sum(note["bytes"] for note in notes) for notes in record["all_to_all"]]
        assert sum(sent) / len(sent) == pytest.approx(handed, rel=1e-12), (command, sent)
        # and on every rank, layer and micro-batch, the closed form of a dropless run
        # ranks x layers x micro-batches; step 10 at ep 1 issues no all-to-all (every expert local)
        assert assert_all_to_all_closed_form(out) == (0 if on and row["ep"] == 1 else 2 * 2 * 2)
