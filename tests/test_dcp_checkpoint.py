"""common/dcp_checkpoint.py: a rank's pieces as a torch.distributed.checkpoint state dict, and back.

The independent answers: the whole tensors themselves (a piece's boxes must tile exactly its
elements), and torch's own DCP readers, which know none of this file: ``dcp_to_torch_save`` and
``dcp.load`` with its default planner into plain tensors. Two ranks save a toy at one layout (ZeRO's
flat slices, or tensor-parallel blocks with ZeRO slices of them); every other layout reads it back,
bit for bit.
"""

import math
import sys

import pytest
import torch

from conftest import REPO, init_gloo, shutdown, spawn

sys.path.insert(0, str(REPO / "common"))
from dcp_checkpoint import Boxes, Place, boxes, model_state, optimizer_state, read  # noqa: E402

SHAPES = {"a": (5, 7), "b": (3, 4, 5), "c": (11,)}  # sizes no rank count divides evenly


def whole(name: str) -> torch.Tensor:
    """Every element its own value, so a misplaced one is seen."""
    offset = sum(math.prod(s) for n, s in SHAPES.items() if n < name)
    return (torch.arange(math.prod(SHAPES[name]), dtype=torch.float64) + offset).view(SHAPES[name])


def pieces(layout: str, rank: int, ranks: int) -> list:
    """``(name, tensor, place)`` of rank ``rank`` of ``ranks``,
    each tensor a copy of what the whole holds there:
    ``zero`` (flat slices), ``tp`` (blocks of rows), ``tp+zero`` (tp 2: each block cut into flat
    slices over the ranks / 2 of its dp group)."""
    tp = {"zero": 1, "tp": ranks, "tp+zero": 2}[layout]
    tp_rank, dp, dp_rank = rank % tp, ranks // tp, rank // tp
    out = []
    for name, shape in SHAPES.items():
        rows = [r * shape[0] // tp for r in range(tp + 1)]
        local = whole(name)[rows[tp_rank] : rows[tp_rank + 1]]
        start, end = dp_rank * local.numel() // dp, (dp_rank + 1) * local.numel() // dp
        offsets = (rows[tp_rank],) + (0,) * (len(shape) - 1)
        place = Place(shape, offsets, tuple(local.shape), start)
        out.append((name, local.reshape(-1)[start:end].clone(), place))
    return out


def test_a_flat_range_is_a_few_contiguous_boxes_that_tile_it_exactly():
    """Every [start, end) of tensors of 1 to 3 dimensions: at most 2 ndim - 1 boxes, each a
    contiguous run of the flattened tensor beginning where it says, together the range in order."""
    for shape in [(6,), (3, 4), (2, 3, 4), (4, 1, 3), (1, 1)]:
        numbered = torch.arange(math.prod(shape)).view(shape)
        for start in range(math.prod(shape) + 1):
            for end in range(start, math.prod(shape) + 1):
                found = boxes(start, end, shape)
                assert len(found) <= 2 * len(shape) - 1
                runs = []
                for offsets, sizes, first in found:
                    box = numbered[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
                    run = box.reshape(-1)
                    assert torch.equal(run, torch.arange(first, first + run.numel())), (
                        shape,
                        start,
                    )
                    runs.append(run)
                joined = torch.cat(runs) if runs else torch.arange(0)
                assert torch.equal(joined, torch.arange(start, end)), (shape, start, end)


def test_a_box_is_a_view_of_the_piece_so_a_load_lands_in_it():
    piece = torch.zeros(9)
    held = Boxes(piece, Place((3, 5), start=4))
    for view in held.views.values():
        view.fill_(1)
    assert torch.equal(piece, torch.ones(9))
    assert [tuple(v.shape) for v in held.views.values()] == [(1, 1), (1, 5), (1, 3)]


def save_worker(rank, world_size, port, queue, folder, layout):
    """Rank ``rank`` gives DCP its pieces of the model
    and of an optimiser's state over them, and saves."""
    init_gloo(rank, world_size, port)
    from dcp_checkpoint import save

    mine = pieces(layout, rank, world_size)
    params = [torch.nn.Parameter(t.clone()) for _, t, _ in mine]
    optimizer = torch.optim.AdamW(params, lr=0.1)
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()
    with torch.no_grad():  # the weights saved: the whole model's values, not the stepped ones
        for p, (_, t, _) in zip(params, mine):
            p.copy_(t)
    state = model_state([(n, p, place) for p, (n, _, place) in zip(params, mine)])
    state |= optimizer_state(optimizer, [(n, place) for n, _, place in mine])
    save(state, folder)
    queue.put((rank, True))
    shutdown()


@pytest.mark.parametrize("layout", ["zero", "tp"])
def test_pieces_saved_at_one_layout_read_back_bitwise_at_any_other(layout, tmp_path):
    spawn(save_worker, 2, tmp_path, layout)
    # every other layout, each of its ranks reading alone (no process group: a read needs none)
    for other, ranks in [
        ("zero", 1),
        ("zero", 3),
        ("tp", 2),
        ("tp", 3),
        ("tp+zero", 4),
        ("tp+zero", 6),
    ]:
        for rank in range(ranks):
            wanted = pieces(other, rank, ranks)
            targets = [(n, torch.full_like(t, -1.0), place) for n, t, place in wanted]
            read(model_state(targets), tmp_path)
            for (name, got, _), (_, expected, _) in zip(targets, wanted):
                assert torch.equal(got, expected), (layout, other, ranks, rank, name)


def test_torchs_own_readers_get_whole_tensors_of_the_models_shapes(tmp_path):
    """What a DCP reader that knows nothing of boxes gets: ``dcp_to_torch_save``'s one file holds
    ``model.<name>`` whole, the optimiser's moments whole under the parameter's name; ``dcp.load``
    with its default planner fills plain tensors the same."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    spawn(save_worker, 2, tmp_path / "saved", "zero")
    dcp_to_torch_save(tmp_path / "saved", tmp_path / "whole.pt")
    loaded = torch.load(tmp_path / "whole.pt", weights_only=False)
    for name, shape in SHAPES.items():
        assert torch.equal(loaded[f"model.{name}"], whole(name)), name
        # AdamW's first moment after one step of gradient 1 from 0: (1 - beta1) everywhere
        assert torch.equal(
            loaded[f"optim.state.{name}.exp_avg"], torch.full(shape, 1 - 0.9, dtype=torch.float64)
        )
        assert loaded[f"optim.param_groups.{name}"]["lr"] == 0.1
    plain = {
        f"model.{name}": torch.zeros(shape, dtype=torch.float64) for name, shape in SHAPES.items()
    }
    dcp.load(plain, checkpoint_id=tmp_path / "saved")
    assert all(torch.equal(plain[f"model.{n}"], whole(n)) for n in SHAPES)
