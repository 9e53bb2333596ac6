"""Step 9's activation memory in flight, in bytes: compare/pipeline_memory.py's count of what
autograd holds for backward, on a toy two-stage pipeline whose saved tensors have a closed form, for
both schedules and several M: the peak is (micro-batches held) x (one micro-batch's bytes), GPipe
holding M and 1F1B min(P - s, M)."""

import sys

import torch

from conftest import REPO, STEPS, init_gloo, shutdown, spawn

B, H = 3, 16  # rows of a micro-batch, width
FLOAT = 4
# Saved for backward per micro-batch, parameters left out, each storage once:
# stage 0: Linear keeps its input (B x H), tanh its output (B x H);
# stage 1: Linear keeps its input (the received activation), tanh its output (which mse_loss keeps
# too: the same storage), mse_loss the target (B x H).
ONE_MICRO_BATCH = {0: 2 * B * H * FLOAT, 1: 3 * B * H * FLOAT}
CASES = [(schedule, m) for schedule in ("gpipe", "1f1b") for m in (1, 2, 4)]


def toy_worker(rank, world_size, port, queue):
    init_gloo(rank, world_size, port)
    sys.path.insert(0, str(REPO / STEPS["step9"]))
    from pipeline import Pipeline
    from pipeline_memory import SavedBytesInFlight

    results = {}
    for schedule, m in CASES:
        torch.manual_seed(rank)
        stage = torch.nn.Sequential(torch.nn.Linear(H, H), torch.nn.Tanh())
        pipe = Pipeline(
            stage, rank, 2, (B, H), loss_fn=torch.nn.functional.mse_loss, schedule=schedule
        )
        data = [torch.randn(B, H) for _ in range(m)]
        counter = SavedBytesInFlight(stage.parameters())
        with torch.autograd.graph.saved_tensors_hooks(*counter.hooks):
            pipe.run(
                m,
                inputs=data if rank == 0 else None,
                targets=data if rank == 1 else None,
                loss_scale=m,
            )
        pipe.finish_gradient_synchronization()
        results[schedule, m] = (
            counter.peak,
            counter.saved,
            counter.live,
            pipe.take_peak_in_flight(),
        )
    queue.put((rank, results))
    shutdown()


def test_activation_bytes_in_flight_are_the_closed_form():
    results = spawn(toy_worker, 2, timeout=300)
    for stage in (0, 1):
        for schedule, m in CASES:
            peak, saved, live, held = results[stage][schedule, m]
            assert held == (m if schedule == "gpipe" else min(2 - stage, m))
            assert saved == m * ONE_MICRO_BATCH[stage], (stage, schedule, m, saved)
            assert peak == held * ONE_MICRO_BATCH[stage], (stage, schedule, m, peak)
            assert live == 0  # every saved tensor let go after its backward
    # stage 0 of 2, M = 4: 4 held against 2
    assert results[0]["gpipe", 4][0] == 2 * results[0]["1f1b", 4][0]


def test_the_counter_follows_one_process_saving_and_freeing():
    """Outside any pipeline: a storage saved twice counts once, parameters not at all, and the bytes
    leave when backward is done with them."""
    from pipeline_memory import SavedBytesInFlight

    layer = torch.nn.Linear(H, H)
    counter = SavedBytesInFlight(layer.parameters())
    x = torch.randn(B, H)
    with torch.autograd.graph.saved_tensors_hooks(*counter.hooks):
        y = torch.tanh(layer(x))  # saves x (Linear) and y (tanh)
        loss = (y * y).sum()  # saves y twice more: the same storage
        assert counter.live == counter.peak == counter.saved == 2 * B * H * FLOAT
    loss.backward()
    assert counter.live == 0 and counter.peak == 2 * B * H * FLOAT
