"""Step 10 with --ep: step 12's experts on the mesh (experts_on_mesh.py, mesh.py's rule 6).

The expert-parallel groups are D consecutive ranks of each dp x cp plane: slices of one rank array,
PyTorch's ``init_device_mesh`` groups, step 12's at tp = pp = cp = 1. Where no other axis changes a
sum the run is step 12's, bit for bit: ep alone at 2 ranks and dp 2 x ep 2 at 4 (float32), ep x pp
(each stage's routers given the aux loss's gradient, zero bubble's split backward at ep 1). tp sums
each layer's partial products in another order and cp merges the ring's softmax blocks in another:
those runs are bounded by the same reorderings' drift on the dense model, measured in this run. All
five axes at 8 ranks are the 4-rank cp x tp x ep run, bitwise. Checkpoints resume across step 10's
meshes and step 12; a frozen rank ends the job; what does not compose is one line, exit 2.
"""

import sys

import pytest
import torch

from conftest import (
    MOE,
    REPO,
    TINY,
    assert_bitwise_same_run,
    launch,
    metrics,
    other_order,
    parity,
    spawn,
    train,
    weights,
)

STEP10 = REPO / "step10_3d_parallel"
H, E = 32, 4  # TINY's --n-embd; MOE's experts
ONE = (
    *MOE,
    "--micro-batch-size",
    "1",
)  # one sequence a micro-batch, capacity factor 1 (choices dropped)
DROPLESS = (*ONE, "--moe-capacity-factor", "0")  # for cp: capacity is refused there
ACCUM = ("--grad-accum", "1")
TWO = ("--grad-accum", "2")  # two micro-batches a step: the pipeline's schedule has something to do
SPARSE = ("--n-layer", "4", "--moe-every", "2")

# name: (step, ranks, flags); each run's global batch
# is 2 sequences a step (4 at 4 data-parallel ranks)
RUNS = {
    "step12": ("step12", 2, [*ONE, *ACCUM, "--ep", "2", "--save-every", "2"]),
    "dp2ep2": ("step10", 2, [*ONE, *ACCUM, "--dp", "2", "--ep", "2"]),
    # zero_stages.py's other stages, each kind of parameter over its own group
    "dp2ep2z0": ("step10", 2, [*ONE, *ACCUM, "--dp", "2", "--ep", "2", "--zero", "0"]),
    "dp2ep2z2": ("step10", 2, [*ONE, *ACCUM, "--dp", "2", "--ep", "2", "--zero", "2"]),
    "step12_4": ("step12", 4, [*ONE, *ACCUM, "--ep", "2"]),
    "dp4ep2": ("step10", 4, [*ONE, *ACCUM, "--dp", "4", "--ep", "2"]),
    "dp2pp2ep2": (
        "step10",
        4,
        [*ONE, *ACCUM, "--dp", "2", "--pp", "2", "--ep", "2", "--save-every", "2"],
    ),
    "step0_x2": ("step0", 1, [*ONE, *TWO]),
    # 4 blocks, MoE in blocks 0 and 2: interleaved, pp rank 0 holds both MoE layers, pp rank 1 none
    "step12_sparse": ("step12", 2, [*ONE, *TWO, *SPARSE, "--ep", "2"]),
    "interleaved": (
        "step10",
        4,
        [
            *ONE,
            *TWO,
            *SPARSE,
            "--dp",
            "2",
            "--pp",
            "2",
            "--ep",
            "2",
            "--schedule",
            "interleaved-1f1b",
        ],
    ),
    "pp2zb": ("step10", 2, [*ONE, *TWO, "--pp", "2", "--schedule", "zero-bubble"]),
    "dp2tp2ep2": ("step10", 4, [*ONE, *ACCUM, "--dp", "2", "--tp", "2", "--ep", "2"]),
    "step0_dropless": ("step0", 1, [*DROPLESS, *TWO]),
    "cp2ep2": ("step10", 2, [*DROPLESS, *TWO, "--cp", "2", "--ep", "2"]),
    "cp2tp2ep2": ("step10", 4, [*DROPLESS, *TWO, "--cp", "2", "--tp", "2", "--ep", "2"]),
    "5d": (
        "step10",
        8,
        [*DROPLESS, *TWO, "--pp", "2", "--cp", "2", "--tp", "2", "--ep", "2", "--save-every", "2"],
    ),
    # the reorderings tp and cp bring, on the dense model:
    # the bound's reference (compare/other_order.py)
    "dense_step0": ("step0", 1, ["--micro-batch-size", "1", *TWO]),
    "dense_tp2": ("step10", 2, ["--micro-batch-size", "1", *TWO, "--tp", "2"]),
    "dense_cp2": ("step10", 2, ["--micro-batch-size", "1", *TWO, "--cp", "2"]),
}
SHORT = {"cp2tp2ep2", "5d"}  # 2 steps: the 8-rank run kept short, and the run it is compared with


@pytest.fixture(scope="module")
def ep_runs(tmp_path_factory, small_corpus):
    """``ep_runs(name)``: ``RUNS[name]`` trained once on TINY (4 steps, or 2), its run folder."""
    done, top = {}, tmp_path_factory.mktemp("experts_on_mesh")

    def run(name):
        if name not in done:
            step, nproc, flags = RUNS[name]
            steps = ("--steps", "2") if name in SHORT else ()
            done[name] = train(step, top / name, small_corpus, *flags, *steps, nproc=nproc)
        return done[name]

    run.top, run.corpus = top, small_corpus
    return run


def drift_of(run, reference):
    return other_order.drift(metrics(run), weights(run), metrics(reference), weights(reference))


@pytest.fixture(scope="module")
def dense_reference(ep_runs):
    """How far step 10's tp 2 and cp 2 drift from step 0 on the dense model, the same samples: the
    reorderings of a row-parallel layer's partial sums and of the ring's softmax blocks, on
    this machine."""
    return other_order.largest(
        *(drift_of(ep_runs(name), ep_runs("dense_step0")) for name in ("dense_tp2", "dense_cp2"))
    )


# ---- the groups ----------------------------------------------------------------------------------


def _groups_worker(rank, world_size, port, queue, shapes):
    from conftest import init_gloo, shutdown

    init_gloo(rank, world_size, port)
    sys.path.insert(0, str(STEP10))
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from expert_parallel import Groups
    from mesh import build_mesh

    result = []
    for pp, dp, cp, tp, ep in shapes:
        ours = build_mesh(dp, tp, pp, cp=cp, ep=ep).experts
        theirs = init_device_mesh(
            "cpu", (pp, dp * cp // ep, ep, tp), mesh_dim_names=("pp", "replicas", "ep", "tp")
        )
        for name in ("ep", "replicas"):
            mine = dist.get_process_group_ranks(getattr(ours, name))
            their = dist.get_process_group_ranks(theirs.get_group(name))
            result.append((name, (pp, dp, cp, tp, ep), mine, their))
        result.append(("ep_rank", (pp, dp, cp, tp, ep), ours.ep_rank, theirs.get_local_rank("ep")))
        if (pp, cp, tp) == (1, 1, 1):  # step 12's own groups, on the whole world
            step12 = Groups(ep)
            for name in ("ep", "replicas"):
                result.append(
                    (
                        f"step 12's {name}",
                        (pp, dp, cp, tp, ep),
                        dist.get_process_group_ranks(getattr(ours, name)),
                        dist.get_process_group_ranks(getattr(step12, name)),
                    )
                )
    queue.put((rank, result))
    shutdown()


def test_the_expert_groups_are_the_rank_arrays_slices_init_device_meshs_and_step12s():
    """4 ranks as (pp, dp, cp, tp) with ep: each rank's ep group and its experts' copies are the
    lines of ``arange(4).view(pp, dp * cp // ep, ep, tp)`` through it, the groups
    ``init_device_mesh`` builds on that shape, and step 12's ``Groups(ep)`` where the plane is the
    world; at cp = ep the ep group is the ring."""
    shapes = [(1, 2, 1, 2, 2), (1, 1, 2, 2, 2), (2, 2, 1, 1, 2), (1, 2, 2, 1, 2), (1, 2, 2, 1, 4)]
    shapes += [(1, 4, 1, 1, 2), (1, 4, 1, 1, 4)]
    results = spawn(_groups_worker, 4, shapes, timeout=240)
    for rank, result in results.items():
        assert len(result) == 3 * len(shapes) + 4
        for name, (pp, dp, cp, tp, ep), ours, theirs in result:
            assert ours == theirs, (rank, name, (pp, dp, cp, tp, ep), ours, theirs)
            array = torch.arange(4).view(pp, dp * cp // ep, ep, tp)
            line = (array == rank).nonzero()[0].tolist()
            if name == "ep":
                assert ours == array[line[0], line[1], :, line[3]].tolist()
            if name == "replicas":
                assert ours == array[line[0], :, line[2], line[3]].tolist()
    ring = [r for n, s, r, _ in results[1] if n == "ep" and s == (1, 1, 2, 2, 2)]
    assert ring == [[1, 3]]  # rank 1 = (dp 0, cp 0, tp 1): the ring of tp rank 1


def test_the_rings_aux_losses_average_to_one_processs_and_so_do_their_gradients():
    """moe.py's rule 4 on a sequence cut in two (zig-zag chunks, as step 11 cuts it),
    ``whole_sequence`` adding the other half's counts: each half's loss is E sum_i f_i P_i with the
    whole sequence's f_i (by hand) and its own P_i; the halves' mean is one process's loss, and so
    is the mean of their gradients, to float32 rounding."""
    import moe  # common/moe.py

    torch.manual_seed(0)
    logits = torch.randn(64, E, requires_grad=True)
    whole = moe.route(logits, 2)
    halves = [torch.cat([logits[:16], logits[48:]]), logits[16:48]]
    total = sum(torch.bincount(moe.route(h, 2).experts.flatten(), minlength=E) for h in halves)
    parts = [moe.route(h, 2, whole_sequence=lambda c, t: (total, 2 * t)).aux_loss for h in halves]
    for half, part in zip(halves, parts):
        by_hand = E * (total / (64 * 2) * torch.softmax(half.detach(), -1).mean(0)).sum()
        assert torch.allclose(part.detach(), by_hand, rtol=1e-6), (part, by_hand)
    assert torch.allclose((parts[0] + parts[1]) / 2, whole.aux_loss, rtol=1e-6)
    assert not torch.allclose(parts[0], whole.aux_loss, rtol=1e-3)  # a half alone is not the whole
    (ours,) = torch.autograd.grad((parts[0] + parts[1]) / 2, logits)
    (theirs,) = torch.autograd.grad(whole.aux_loss, logits)
    assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-9)


# ---- bitwise where no other axis changes a sum ---------------------------------------------------


def assert_step12s_run(ours, theirs):
    """``ours`` is ``theirs`` bit for bit: weights, losses,
    norms, loads and dropped fractions; parity.py agrees."""
    assert_bitwise_same_run(theirs, ours)
    for a, b in zip(metrics(ours)["records"], metrics(theirs)["records"]):
        assert a["moe"]["tokens_per_expert"] == b["moe"]["tokens_per_expert"]
        assert a["moe"]["dropped_fraction"] == pytest.approx(
            b["moe"]["dropped_fraction"], abs=1e-12
        )
    assert any(r["grad_norm"] > 0.3 for r in metrics(ours)["records"])  # --grad-clip 0.3 clips
    shown = parity(ours, theirs)
    assert shown.returncode == 0 and "PASS (bitwise identical)" in shown.stdout, shown.stdout


@pytest.mark.parametrize("ours, theirs", [("dp2ep2", "step12"), ("dp4ep2", "step12_4")])
def test_ep_alone_is_step12_bitwise(ep_runs, ours, theirs):
    """--ep 2 on 2 ranks, and --dp 4 --ep 2 on 4 (float32:
    the same flat all-reduces over the same ranks)."""
    run = ep_runs(ours)
    assert metrics(run)["env"]["expert_parallel_size"] == 2
    dropped = [d for r in metrics(run)["records"] for d in r["moe"]["dropped_fraction"]]
    assert any(d > 0 for d in dropped)  # capacity drops choices
    assert_step12s_run(run, ep_runs(theirs))


@pytest.mark.parametrize("zero", [0, 2])
def test_every_zero_stage_with_experts_is_zero1s_run_and_the_planners_bytes(ep_runs, zero):
    """--dp 2 --ep 2 at --zero 0 (AdamW whole, step 12's all-reduces) and --zero 2 (the dense
    gradients reduce-scattered over the plane, an expert's over its copies, here one: kept whole and
    divided by W, step 12's rule 7): the --zero 1 run bitwise (2 ranks: the same sums; the norm's
    slices over the plane count every dense and expert element once). Every rank's params and grads
    are the planner's per kind (``mesh_moe_state`` at its stage) to the byte; AdamW's state up to
    its step counts."""
    import estimate
    import plan

    run = ep_runs(f"dp2ep2z{zero}")
    assert_bitwise_same_run(run, ep_runs("dp2ep2"))
    record = metrics(run)
    rows = plan.measured_rows(record, estimate.vocabulary_size(record["config"]["tokenizer"]))
    for row in rows:
        assert row["zero"] == zero
        assert {k: row["measured"][k] for k in ("params", "grads")} == {
            k: row["estimated"][k] for k in ("params", "grads")
        }, row
        assert (
            0 <= row["measured"]["optimizer_state"] - row["estimated"]["optimizer_state"] <= 4 * 64
        )
    grads, params = rows[0]["measured"]["grads"], rows[0]["measured"]["params"]
    assert grads < params if zero == 2 else grads == params  # the dense half a rank's slice


@pytest.mark.parametrize(
    "ours, theirs",
    [("dp2pp2ep2", "step12"), ("interleaved", "step12_sparse"), ("pp2zb", "step0_x2")],
)
def test_ep_with_pp_is_step12_bitwise(ep_runs, ours, theirs):
    """dp 2 x pp 2 x ep 2: the first stage's routers get the load-balancing loss's gradient through
    the layers' outputs (rule 2), not from a loss they cannot see; one process's bits. Interleaved
    1F1B over 4 blocks, MoE in blocks 0 and 2 (both on pp rank 0; the record's layers in model
    order); zero bubble's B/W split at ep 1."""
    assert_step12s_run(ep_runs(ours), ep_runs(theirs))


def test_ep_with_tp_and_cp_drift_as_those_axes_do_on_the_dense_model(ep_runs, dense_reference):
    """dp 2 x tp 2 x ep 2 from step 12's ep 2, cp 2 x ep 2 (dropless) from step 0: the first loss to
    float32's rounding, the routing of the first step the same, the rest within
    compare/other_order.py's factor of the dense model's tp and cp drift from step 0."""
    for ours, theirs in (("dp2tp2ep2", "step12"), ("cp2ep2", "step0_dropless")):
        run, reference = ep_runs(ours), ep_runs(theirs)
        drift = drift_of(run, reference)
        print(f"{ours} from {theirs}: {drift}; dense tp 2 and cp 2 from step 0: {dense_reference}")
        limit = other_order.bound(dense_reference, metrics(run), weights(run))
        assert not other_order.beyond(drift, limit), (ours, drift, dense_reference)
        assert drift.weights > 0  # 0 would mean neither tp nor cp happened
        first = [metrics(r)["records"][0]["moe"]["tokens_per_expert"] for r in (run, reference)]
        assert first[0] == first[1]


def test_all_five_axes_at_8_ranks_are_the_4_rank_cp_x_tp_x_ep_run(ep_runs):
    """pp 2 x dp 1 x cp 2 x tp 2, ep 2 over each ring:
    the pipeline adds no sum to cp x tp x ep's (4 ranks)."""
    run = ep_runs("5d")
    assert metrics(run)["env"]["mesh"] == {
        "pp": 2,
        "dp": 1,
        "cp": 2,
        "tp": 2,
        "order": "pp, dp, cp, tp (tp innermost)",
        "ep": 2,
        "experts": "D consecutive ranks of dp x cp",
    }
    assert_bitwise_same_run(ep_runs("cp2tp2ep2"), run)


@pytest.mark.parametrize("name, ep, tp, pp_ranks", [("dp4ep2", 2, 1, 4), ("5d", 2, 2, 4)])
def test_each_ranks_all_to_all_bytes_are_what_its_ep_group_sent(ep_runs, name, ep, tp, pp_ranks):
    """Per MoE layer and micro-batch, on every rank: what it received is what the ranks of its ep
    group (the same stage and tp rank, its block of the dp x cp plane) sent to its experts; 8 E + 4
    H * 2 * (sent + received) bytes, all of them on the record's ``ep`` axis."""
    for record in metrics(ep_runs(name))["records"]:
        notes = record["all_to_all"]
        for rank, mine in enumerate(notes):
            stage, plane = divmod(rank // tp, pp_ranks // tp)  # pp_ranks: the ranks of one stage
            group = [
                (stage * (pp_ranks // tp) + plane // ep * ep + e) * tp + rank % tp
                for e in range(ep)
            ]
            local = range(plane % ep * E // ep, (plane % ep + 1) * E // ep)
            for i, note in enumerate(mine):
                received = sum(notes[s][i]["sent_per_expert"][e] for s in group for e in local)
                assert note["received"] == received, (name, rank, i)
                assert note["bytes"] == 8 * E + 4 * H * 2 * (
                    sum(note["sent_per_expert"]) + received
                )
            assert sum(n["bytes"] for n in mine) == record["comm"][rank]["ep"]["all_to_all"]


def test_the_planner_holds_every_ranks_model_state_with_experts(ep_runs):
    """``compare/plan.py --measured`` on the 8-rank run, the interleaved one (a pp rank without
    experts) and step 12's: every rank's parameters, gradients and AdamW state within the planner's
    tolerance of its estimate (the dense part's ZeRO-1 over dp x cp, an expert's over its copies;
    step 12's ZeRO-0), each MoE block's MLP share replaced by its router and E/ep whole experts."""
    from conftest import run_forked

    names = ("5d", "interleaved", "step12")
    command = [sys.executable, str(REPO / "compare" / "plan.py"), "--measured"]
    result = run_forked([*command, *(str(ep_runs(n)) for n in names)], timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.rstrip().endswith("within 5% of the estimate: yes"), result.stdout
    assert result.stdout.count(" 2 x 2 x 2, ZeRO-1 ") == 8, result.stdout
    assert result.stdout.count(" 1.000 ") == 8 + 4 + 2, result.stdout  # AdamW's step counts aside


# ---- checkpoints ---------------------------------------------------------------------------------


def resume(ep_runs, step, nproc, name, checkpoint, *flags):
    out = ep_runs.top / name
    result = launch(
        step,
        [*TINY, *flags, "--data", str(ep_runs.corpus), "--out", str(out), "--resume", checkpoint],
        nproc=nproc,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def test_checkpoints_resume_across_meshes_and_step12_bitwise(ep_runs):
    """dp 2 x pp 2 x ep 2's step 2 resumed by step 10 at dp 2 with every expert on both ranks (--ep
    1), and step 12's by step 10 at dp 2 x pp 2 x ep 2: the same sums, so the uninterrupted runs'
    bits. The 8-rank run's last checkpoint read by step 12 at ep 2 (2 ranks): its weights, whoever
    wrote each expert."""
    checkpoint = str(ep_runs("dp2pp2ep2") / "checkpoints" / "step_2")
    into_1d = resume(ep_runs, "step10", 2, "into_1d", checkpoint, *ONE, *ACCUM, "--dp", "2")
    assert_bitwise_same_run(ep_runs("step12"), into_1d)
    checkpoint = str(ep_runs("step12") / "checkpoints" / "step_2")
    flags = ("--dp", "2", "--pp", "2", "--ep", "2")
    into_3d = resume(ep_runs, "step10", 4, "into_3d", checkpoint, *ONE, *ACCUM, *flags)
    assert_bitwise_same_run(ep_runs("dp2pp2ep2"), into_3d)
    checkpoint = str(ep_runs("5d") / "checkpoints" / "step_2")
    into12 = resume(ep_runs, "step12", 2, "into12", checkpoint, *DROPLESS, *ACCUM, "--steps", "2")
    assert all(torch.equal(t, weights(into12)[n]) for n, t in weights(ep_runs("5d")).items())


# ---- what an outsider lifts, failures, refusals --------------------------------------------------

OUTSIDER = """
import sys, torch, torch.nn as nn, torch.nn.functional as F
sys.path.insert(0, sys.argv[1])
from experts_on_mesh import AuxLossToRouters

torch.set_num_threads(1)
torch.manual_seed(0)
router, head = nn.Linear(8, 4, bias=False), nn.Linear(8, 3)
x, y, a, accum = torch.randn(16, 8), torch.randint(3, (16,)), 0.1, 2

def first_stage(x):  # their own router and balance loss
    probs = F.softmax(router(x), dim=-1)
    return x * probs.max(-1, keepdim=True).values, 4 * (probs.mean(0) ** 2).sum()

out, aux = first_stage(x)  # one process: (loss + a aux) / accum
((F.cross_entropy(head(out), y) + a * aux) / accum).backward()
whole = router.weight.grad.clone()
results = []
# two stages by hand: the loss on the second, its input's gradient sent back
for carried in (True, False):
    router.weight.grad = None
    out, aux = first_stage(x)
    if carried:
        out = AuxLossToRouters.apply(out, aux, torch.ones(()) / accum * a)
    received = out.detach().requires_grad_()
    (F.cross_entropy(head(received), y) / accum).backward()
    out.backward(received.grad)
    results.append(torch.equal(router.weight.grad, whole))
print(results)
"""


def test_the_aux_loss_carrier_in_an_outsiders_two_stage_loop_gives_one_processs_router_gradient():
    """An outsider's router and balance loss on the first of two stages they run by hand, the loss
    on the second: with ``AuxLossToRouters`` the router's gradient is one process's ``(loss + a aux)
    / accum`` to the bit; without it, not (the balance loss never reaches the router)."""
    from conftest import run_forked

    result = run_forked([sys.executable, "-c", OUTSIDER, str(STEP10)], timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "[True, False]", result.stdout


def test_a_frozen_rank_in_the_all_to_all_ends_the_job_within_the_timeout(
    tmp_path, small_corpus, monkeypatch
):
    """tests/test_dead_rank.py's check on step 10 at --dp 2 --ep 2 (real torchrun, rank 0 stopped):
    its peer, waiting in an MoE layer's all-to-all (step 12's rule 8) or the collective after,
    prints one line naming it and the job ends within --timeout-s plus the roll call."""
    import test_dead_rank

    monkeypatch.setitem(test_dead_rank.EXTRA, "step10", ["--moe-experts", "4", "--ep", "2"])
    test_dead_rank.test_a_frozen_rank_ends_the_job_with_one_line_within_the_timeout(
        "step10", 0, tmp_path, small_corpus
    )


REFUSED = {
    "ep-not-dividing": (
        ["--moe-experts", "4", "--ep", "4"],
        "error: --ep 4 must divide --dp x --cp = 2: the experts are split over ranks "
        "of the data and "
        "context axes (mesh.py's rule 6); change --ep, --dp or --cp",
    ),
    "ep-dense": (
        ["--ep", "2"],
        "error: --ep 2 splits the experts of a mixture of experts: give --moe-experts "
        "E (a multiple of 2), "
        "or drop --ep",
    ),
    "ep-below-1": (
        ["--moe-experts", "4", "--ep", "0"],
        "error: --ep 0: the expert-parallel degree must be at least 1",
    ),
    "experts": (
        ["--moe-experts", "3", "--ep", "2"],
        "error: --moe-experts 3 is not divisible by --ep 2: each rank holds E/D "
        "experts; choose E a "
        "multiple of 2",
    ),
    "capacity-cp": (
        ["--moe-experts", "4", "--moe-capacity-factor", "1", "--cp", "2"],
        "error: --moe-capacity-factor with --cp: capacity drops slots by position "
        "among a micro-batch's "
        "tokens, and a cp rank holds S/C of them; use --moe-capacity-factor 0 (dropless) with --cp",
    ),
    "dropout": (
        ["--moe-experts", "4", "--pp", "2", "--dropout", "0.1"],
        "error: --dropout with --moe-experts and --ep, --cp or --pp above 1: an expert "
        "draws its mask over "
        "the slots it receives, known once routed, on the rank that owns it, so no "
        "rank can draw one "
        "process's masks; use --dropout 0",
    ),
    "sequence-parallel": (
        ["--moe-experts", "4", "--tp", "2", "--sequence-parallel"],
        "error: --sequence-parallel with --moe-experts: each tp rank would route its "
        "S/T tokens and the "
        "experts' gradients would need adding over tp; use one of the two",
    ),
    "full-recomputation": (
        ["--moe-experts", "4", "--activation-checkpointing", "full"],
        "error: --activation-checkpointing full with --moe-experts: recomputing a "
        "block would run its "
        "experts' all-to-alls and count its tokens again; use selective, or none",
    ),
}


@pytest.mark.quick
@pytest.mark.parametrize("case", REFUSED)  # the rows of docs/bad_input.md: tests/test_bad_input.py
def test_what_experts_on_the_mesh_cannot_do_is_one_line_exit_2(case, tmp_path, small_corpus):
    flags, line = REFUSED[case]
    result = launch(
        "step10", [*TINY, *flags, "--data", str(small_corpus), "--out", str(tmp_path)], nproc=2
    )
    assert "ranks' exit codes: [2, 2]" in result.stderr, result.stderr[-2000:]
    assert line in result.stderr.splitlines(), result.stderr[-2000:]
    assert not any(tmp_path.iterdir())  # nothing written
