"""The bytes a rank of step 10's mesh hands to collectives in a step,
by the axis they serve: a record's ``comm``.

comm_accounting.py counts bytes by kind of collective (all_reduce, all_gather, ...); on a mesh the
same kind serves several axes (an all-reduce over tp inside a layer, over dp x cp for the
gradients), so train.py says, at each phase of a step, which axis what was counted since belongs to:
``take("dp")`` after the gradients' sync, ``take("norms")`` after the clip. Accounting, apart from
the composition (composition.py).
"""

from comm_accounting import take_comm_bytes


class BytesByAxis:
    """The bytes this rank hands to collectives in one step (comm_accounting.py), by what they are
    for: ``tp`` (activations inside a stage), ``cp`` (the ring's key/value blocks and their
    gradients), ``pp`` (point-to-point between stages), ``dp`` (the gradients' all-reduce, ZeRO-1's
    all-gather, over dp x cp) and ``norms`` (sums of squares, over tp then pp). Starts with what was
    counted so far, added to ``axis``. ``data_kinds``: kinds that are the data axis's whenever they
    are counted (--zero 3: its all-gathers and reduce-scatters, inside the flushes).
    """

    def __init__(self, axis: str, data_kinds=()):
        self.counts = {"tp": {}, "cp": {}, "pp": {}, "dp": {}, "norms": {}}
        self.data_kinds = tuple(data_kinds)
        self.take(axis)

    def take(self, axis: str) -> dict:
        """What was counted since the last take, added to ``axis`` (the pipeline's point-to-point to
        ``pp``, the ring's sends and routing counts to ``cp``, the experts' all-to-alls to ``ep``,
        whatever ``axis``); returns the counts so far, by axis (plain dicts: a record's)."""
        for kind, count in take_comm_bytes().items():
            to = (
                "pp"
                if kind.startswith("p2p")
                else "cp"
                if kind in ("send", "routing counts")
                else "dp"
                if kind in self.data_kinds
                else axis
            )
            counts = self.counts.setdefault("ep" if kind == "all_to_all" else to, {})
            counts[kind] = counts.get(kind, 0) + count
        return self.counts
