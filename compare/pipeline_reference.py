"""Our pipeline (step9_pipeline_parallel/pipeline.py) against PyTorch's own,
``torch.distributed.pipelining``, on the same stages: are the gradients and the weights the
same bits?

    python compare/pipeline_reference.py          # 2 stages, gpipe and 1f1b, M = 3
    python compare/pipeline_reference.py --stages 4 --micro-batches 8 --steps 3
    python compare/pipeline_reference.py --schedules interleaved-1f1b --micro-batches 4   # 2 chunks
    # and the times of each
    python compare/pipeline_reference.py --steps 20 --n-embd 128 --seq-len 64 --micro-batch-size 8

It starts ``--stages`` processes (gloo, CPU, one thread each), builds our GPT-2 in each (the same
weights: every parameter is a function of its name), cuts it into the same stages with
``GPT2Stage``, and trains ``--steps`` AdamW steps from the same weights on the same micro-batches
twice per schedule: with PyTorch's ``PipelineStage`` and ``ScheduleGPipe`` / ``Schedule1F1B`` /
``ScheduleInterleaved1F1B`` (``--virtual-stages`` chunks per process, the model cut into P x V) /
``ScheduleInterleavedZeroBubble`` (one stage per process), and with our ``Pipeline``. After every
step it asserts that every gradient and every weight of every stage is ``torch.equal`` in the two;
exit 0 when all are, 1 otherwise.

Two things PyTorch's schedules do not do as one process accumulating M micro-batches does, and what
the reference does instead (each printed with what it would cost):

- ``scale_grads=True`` (their default) sums the M micro-batches' gradients, then divides the sum by
  M. One process divides each micro-batch's loss by M before its backward. Dividing by a power of
  two is exact, so the two agree when M is one; otherwise they differ in the last bits. The
  reference uses ``scale_grads=False`` and a loss function that returns ``loss / M``.
- GPT-2's tied embedding lives on the first and the last stage, and PyTorch's stages know nothing of
  it: each accumulates its own half. Adding the two accumulated halves once per step adds in another
  order than one process (which adds the two halves of each micro-batch, then accumulates). The
  reference records each micro-batch's halves with gradient hooks and adds them in one process's
  order after the schedule.
Dropout is off here: PyTorch's stages draw their masks from their own generators (our pipeline
replays the other stages' draws to draw one process's masks; step 9's tests check that against
step 0).
"""

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
STEP9 = REPO_ROOT / "step9_pipeline_parallel"
sys.path.insert(0, str(REPO_ROOT / "common"))
from config import OneLineParser, UserError, build_parser, exit_on_user_error  # noqa: E402
from launch import spawn_ranks  # noqa: E402

VOCAB = 2048  # data/tokenizer.json's


def loss_of(logits, targets):
    # language_model_loss's
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def worker(rank: int, world_size: int, port: int, args) -> list:
    sys.path.insert(0, str(STEP9))  # the step's own copies (common's, verbatim) and pipeline.py
    import torch.distributed as dist
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
    )

    from model import build_model
    from pipeline import Pipeline
    from pipeline_stages import GPT2Stage
    from training import make_optimizer

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(
        "gloo", rank=rank, world_size=args.stages, timeout=timedelta(seconds=args.timeout_s)
    )
    P, M, B = args.stages, args.micro_batches, args.micro_batch_size
    config = vars(
        build_parser("reference").parse_args(
            [
                "--n-layer",
                str(args.n_layer),
                "--n-embd",
                str(args.n_embd),
                "--n-head",
                str(args.n_head),
                "--seq-len",
                str(args.seq_len),
                "--lr",
                "1e-3",
            ]
        )
    )
    first, last = rank == 0, rank == P - 1
    data = torch.randint(
        0, VOCAB, (args.steps, M * B, args.seq_len + 1), generator=torch.Generator().manual_seed(0)
    )

    def fresh_stage(schedule):
        """This process's stage (a ``GPT2Stage``), or with the interleaved schedule its list of V
        chunks (the model's stages rank, rank + P, ...), with its tied parameter (or None), its
        parameters and optimiser."""
        V = args.virtual_stages if schedule == "interleaved-1f1b" else 1
        model = build_model(config, VOCAB, config["seed"])
        chunks = [GPT2Stage(model, v * P + rank, P * V) for v in range(V)]
        named = [
            ("transformer.wte.weight" if p is chunk.tied_parameter else n, p)
            for chunk in chunks
            for n, p in chunk.named_parameters()
        ]
        tied = (chunks[0] if first else chunks[-1]).tied_parameter
        return (chunks if V > 1 else chunks[0]), tied, named, make_optimizer(named, config)

    def their_schedule_of(schedule, module, **options):
        modules = module if isinstance(module, list) else [module]
        stages = [
            PipelineStage(chunk, chunk.stage, chunk.num_stages, torch.device("cpu"))
            for chunk in modules
        ]
        schedule_cls = {
            "gpipe": ScheduleGPipe,
            "1f1b": Schedule1F1B,
            "interleaved-1f1b": ScheduleInterleaved1F1B,
            # (one stage per process: ZB-H1's order)
            "zero-bubble": ScheduleInterleavedZeroBubble,
        }
        single = schedule in ("gpipe", "1f1b")  # the others take a list of this process's stages
        return schedule_cls[schedule](stages[0] if single else stages, M, **options)

    def step_builtin(schedule, inputs, targets):
        """PyTorch's schedules take the whole batch on
        the first stage and the targets on the last."""
        schedule.step(*([inputs] if first else []), **({"target": targets} if last else {}))

    report = {}
    for schedule in args.schedules:
        theirs, their_tied, their_named, their_optimizer = fresh_stage(schedule)
        ours, our_tied, our_named, our_optimizer = fresh_stage(schedule)
        halves = []  # the tied embedding's half of each micro-batch's gradient, in order
        if their_tied is not None:
            their_tied.register_hook(
                lambda grad, halves=halves: halves.append(grad.clone()) or grad
            )
        their_schedule = their_schedule_of(
            schedule, theirs, loss_fn=lambda out, y: loss_of(out, y) / M, scale_grads=False
        )
        pipe = Pipeline(
            ours,
            rank,
            P,
            (B, args.seq_len, args.n_embd),
            loss_fn=loss_of,
            tied_parameter=our_tied,
            schedule=schedule,
        )
        differing, tie_naive_diff, times = [], 0.0, {"theirs": [], "ours": []}
        for step in range(args.steps):
            inputs, targets = data[step, :, :-1].contiguous(), data[step, :, 1:].contiguous()
            # PyTorch's: the whole batch in, split into M micro-batches of B consecutive samples.
            halves.clear()
            dist.barrier()  # both timed from the same start on every stage
            started = time.perf_counter()
            step_builtin(their_schedule, inputs, targets)
            if their_tied is not None:  # one process's order: (a_i + b_i), accumulated in order
                mine = halves[:]
                other = [torch.empty_like(h) for h in mine]
                for h, o in zip(mine, other):  # first <-> last: each gets the other's halves
                    reqs = [
                        dist.isend(h, P - 1 if first else 0),
                        dist.irecv(o, P - 1 if first else 0),
                    ]
                    for r in reqs:
                        r.wait()
                # (embedding, output layer)
                pairs = list(zip(mine, other)) if first else list(zip(other, mine))
                combined = None
                for embedding_half, output_half in pairs:
                    contribution = embedding_half + output_half
                    combined = contribution if combined is None else combined + contribution
                naive = sum(e for e, _ in pairs) if len(pairs) > 1 else pairs[0][0]
                naive_output = sum(o for _, o in pairs) if len(pairs) > 1 else pairs[0][1]
                tie_naive_diff = max(
                    tie_naive_diff, (naive + naive_output - combined).abs().max().item()
                )
                their_tied.grad = combined
            times["theirs"].append(time.perf_counter() - started)
            dist.barrier()
            started = time.perf_counter()
            # Ours: the same micro-batches.
            pipe.run(M, list(inputs.split(B)), list(targets.split(B)), loss_scale=M)
            pipe.finish_gradient_synchronization()
            times["ours"].append(time.perf_counter() - started)
            differing += [
                f"step {step + 1} grad {n}"
                for (n, a), (_, b) in zip(their_named, our_named)
                if not torch.equal(a.grad, b.grad)
            ]
            their_optimizer.step()
            our_optimizer.step()
            their_optimizer.zero_grad(set_to_none=True)
            our_optimizer.zero_grad(set_to_none=True)
            differing += [
                f"step {step + 1} weight {n}"
                for (n, a), (_, b) in zip(their_named, our_named)
                if not torch.equal(a, b)
            ]
        report[schedule] = {
            "tensors": len(our_named),
            "differing": differing,
            "tie_naive_diff": tie_naive_diff,
            "times": times,
        }

        # The trap: PyTorch's default scale_grads=True
        # (sum, then divide by M), one step, against ours.
        default, _, default_named, _ = fresh_stage(schedule)
        # torch 2.11 checks strides
        inputs, targets = data[0, :, :-1].contiguous(), data[0, :, 1:].contiguous()
        step_builtin(their_schedule_of(schedule, default, loss_fn=loss_of), inputs, targets)
        ours2, _, our_named2, _ = fresh_stage(schedule)
        pipe2 = Pipeline(
            ours2, rank, P, (B, args.seq_len, args.n_embd), loss_fn=loss_of, schedule=schedule
        )
        # untied halves, as theirs
        pipe2.run(M, list(inputs.split(B)), list(targets.split(B)), loss_scale=M)
        pipe2.finish_gradient_synchronization()
        report[schedule]["scale_grads_diff"] = max(
            (a.grad - b.grad).abs().max().item()
            for (_, a), (_, b) in zip(default_named, our_named2)
        )
    everyone = [None] * P
    dist.all_gather_object(everyone, report)
    dist.barrier()
    dist.destroy_process_group()
    return everyone


def main() -> int:
    parser = OneLineParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--stages", type=int, default=2, help="pipeline stages (processes)")
    parser.add_argument("--micro-batches", type=int, default=3, help="micro-batches per step (M)")
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument(
        "--schedules",
        nargs="+",
        choices=["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble"],
        default=["gpipe", "1f1b"],
    )
    parser.add_argument(
        "--virtual-stages", type=int, default=2, help="chunks per stage, interleaved-1f1b"
    )
    parser.add_argument("--steps", type=int, default=2, help="AdamW steps")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=32)
    parser.add_argument("--n-head", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--timeout-s", type=float, default=60.0)
    args = parser.parse_args()
    if not 2 <= args.stages <= args.n_layer:
        raise UserError(
            f"--stages must be between 2 and --n-layer ({args.n_layer}), got {args.stages}"
        )
    if args.micro_batches < 1 or args.steps < 1 or args.micro_batch_size < 1:
        raise UserError("--micro-batches, --steps and --micro-batch-size must be at least 1")
    if "1f1b" in args.schedules and args.micro_batches < args.stages:
        raise UserError(
            "PyTorch's Schedule1F1B needs at least as many micro-batches as stages: "
            "--micro-batches "
            f">= {args.stages}, or --schedules gpipe"
        )
    if "interleaved-1f1b" in args.schedules and (
        args.micro_batches % args.stages
        or args.virtual_stages < 2
        or args.stages * args.virtual_stages > args.n_layer
    ):
        raise UserError(
            f"interleaved-1f1b: --micro-batches must be a multiple of --stages ({args.stages}), "
            "--virtual-stages at least 2, and --stages x --virtual-stages at most --n-layer"
        )
    reports = spawn_ranks(worker, args.stages, args, timeout=args.timeout_s * 10)[0]
    ok = True
    print(
        f"{args.stages} stages, {args.micro_batches} micro-batches of "
        f"{args.micro_batch_size}, {args.steps} AdamW "
        f"steps: our pipeline vs torch.distributed.pipelining (scale_grads=False, loss / M)"
    )
    for schedule in args.schedules:
        differing = [d for r in reports for d in r[schedule]["differing"]]
        tensors = sum(r[schedule]["tensors"] for r in reports)
        ok &= not differing
        verdict = "bitwise identical" if not differing else f"DIFFER: {differing[:4]}"
        scale = max(r[schedule]["scale_grads_diff"] for r in reports)
        tie = max(r[schedule]["tie_naive_diff"] for r in reports)
        print(
            f"  {schedule:<5} gradients and weights of {tensors} tensors after every "
            f"step: {verdict}"
        )
        print(
            f"        with their default scale_grads=True: max abs gradient diff {scale:.1e}"
            f"{' (M is a power of two: exact)' if scale == 0 else ''}; the tied "
            "embedding's two accumulated halves "
            f"added once per step: max abs diff {tie:.1e}"
        )
    # forward + backward of one step, every stage starting together (rank 0's clock)
    if args.steps >= 3:
        print(
            "time per step (forward and backward of all micro-batches, tie included; "
            "median, min-max over steps "
            "after the first):"
        )
        for schedule in args.schedules:
            t = {who: reports[0][schedule]["times"][who][1:] for who in ("theirs", "ours")}
            ratios = [o / b for o, b in zip(t["ours"], t["theirs"])]
            print(
                f"  {schedule:<5} ours {statistics.median(t['ours']) * 1e3:6.1f} ms, "
                "torch.distributed.pipelining "
                f"{statistics.median(t['theirs']) * 1e3:6.1f} ms: ours / theirs "
                f"{statistics.median(ratios):.2f} "
                f"({min(ratios):.2f}-{max(ratios):.2f})"
            )
        if len(args.schedules) == 2:
            g, f = (reports[0][s]["times"]["ours"][1:] for s in ("gpipe", "1f1b"))
            print(f"  ours: 1f1b / gpipe {statistics.median(f) / statistics.median(g):.2f}")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main))
