"""V-shaped schedules: two stages per rank, rank r holding stage r (going down) and stage 2p-1-r
(coming back up), so the forward runs down the ranks and back up, and the backward the reverse.

Why a V: the last stage sits on rank 0, next to the first, and the turn at the bottom (stages p-1
and p on rank p-1) needs no transfer. Each rank's two stages see the forward at both ends of the
pipe, so a rank always has work of one of its chunks while the other waits: with the B/W split
(ZB-V) the bubble tends to zero at equal F, B and W times while every rank holds about as many
activations as 1F1B's first rank; DualPipeV pairs the forward of one chunk with the backward of the
other, so that the transfers of one run while the other computes.

Both orders follow the published algorithms (Zero Bubble, Qi et al. 2024, section 6; DeepSeek's
DualPipeV, the single-copy V form of DualPipe), written here as meshkit data and proved by
`simulate.check` like every other schedule.
"""

from __future__ import annotations

from collections import deque

from meshkit.pipeline.actions import Action, ActionKind, Schedule, schedule_sizes, with_communication

V_SCHEDULES = ("zb_v", "dualpipe_v")
F, B, W, BW = ActionKind.F, ActionKind.B, ActionKind.W, ActionKind.BW


def v_placement(pp: int) -> tuple[int, ...]:
    """The rank of each of the 2p stages: stage s on rank s going down, stage 2p-1-s coming back up."""
    return tuple(s if s < pp else 2 * pp - 1 - s for s in range(2 * pp))


class _Order:
    """One rank's action list under construction, with the next microbatch of each (stage, pass)."""

    def __init__(self) -> None:
        self.actions: list[Action] = []
        self.count: dict[tuple[ActionKind, int], int] = {}
        self.pending_w: deque[Action] = deque()  # Ws owed by split backwards, oldest first

    def next(self, kind: ActionKind, stage: int) -> Action:
        key = (B if kind is BW else kind, stage)  # B and BW share the backward counter
        mb = self.count.get(key, 0)
        self.count[key] = mb + 1
        return Action(kind, stage, mb)

    def add(self, kind: ActionKind, stage: int) -> None:
        self.actions.append(self.next(kind, stage))

    def backward(self, stage: int, split: bool) -> None:
        """A full backward, or its B with the W queued for `weight`."""
        action = self.next(B if split else BW, stage)
        self.actions.append(action)
        if split:
            self.pending_w.append(Action(W, stage, action.microbatch))

    def weight(self) -> None:
        """The oldest queued W, if any (DualPipeV's cooldown runs them as gaps allow)."""
        if self.pending_w:
            self.actions.append(self.pending_w.popleft())


def zb_v(pp: int, microbatches: int) -> Schedule:
    """ZB-V: the V placement with every backward split into B and W, Ws filling the gaps.

    Rank r warms up with 2(p-r)-1 forwards of its down stage, then r forward pairs of both stages,
    then p-r rounds of (F, B, W) of its up stage; the steady phase repeats (F, B, W) of the down stage
    and then of the up stage; the cooldown runs the remaining Bs first and the deferred Ws last. The
    order is defined for at least 2p-1 microbatches; with fewer, the actions of the missing ones are
    dropped (what remains is still a valid order, `check` proves it).
    """
    pp, m = schedule_sizes(pp, microbatches)
    n = max(m, 2 * pp - 1)

    def order(r: int) -> list[Action]:
        down, up, o = r, 2 * pp - 1 - r, _Order()
        for _ in range(2 * (pp - r) - 1):
            o.add(F, down)
        for _ in range(r):
            o.add(F, up)
            o.add(F, down)
        for _ in range(pp - r):
            for kind in (F, B, W):
                o.add(kind, up)
        while o.count.get((F, up), 0) < o.count[(F, down)] or o.count[(F, down)] < n:
            if o.count[(F, down)] < n:
                o.add(F, down)
            for stage, kinds in ((down, (B, W)), (up, (F, B, W))):
                for kind in kinds:
                    o.add(kind, stage)
        for _ in range(r):
            o.add(B, down)
            o.add(B, up)
        for _ in range(pp - r):
            o.add(B, down)
            o.add(W, down)
        for stage in (up, down):  # the deferred Ws, up stage first (its inputs were pinned longer)
            while o.count.get((W, stage), 0) < o.count.get((B, stage), 0):
                o.add(W, stage)
        return [a for a in o.actions if a.microbatch < m]

    return _v_schedule("zb_v", pp, m, order)


def dualpipe_v(pp: int, microbatches: int) -> Schedule:
    """DualPipeV: the V placement where, in the steady phase, every forward of one stage is paired
    with a full backward of the other stage's microbatch (F then BW, adjacent), so each one's
    transfers are posted while the other computes; the cooldown splits backwards into B and W again
    to fill the gaps. Needs at least 2p microbatches (the steady phase pairs 2p - 1 - r deep).

    Phases on rank r (down stage r, up stage 2p-1-r): 2(p-1-r) forwards down; r+1 forward pairs
    down/up; p-1-r rounds of (B up, a queued W, F up); m-2p+r+1 rounds of two pairs (F down + BW up,
    F up + BW down); p-1-r rounds of (BW up, F up + BW down); r+1 backward pairs up/down, switching
    to B/W halfway; p-1-r rounds of (W, backward down); then the Ws still queued.
    """
    pp, m = schedule_sizes(pp, microbatches)
    if m < 2 * pp:
        raise ValueError(
            f"microbatches={m!r} with pp={pp}: DualPipeV pairs forwards and backwards of 2p stages and needs "
            f"at least 2*pp={2 * pp} microbatches; use microbatches >= {2 * pp} or pp_schedule='zb_v'"
        )
    return _v_schedule("dualpipe_v", pp, m, lambda r: dualpipe_v_order(pp, m, r))


def dualpipe_v_order(pp: int, m: int, r: int) -> list[Action]:
    """Rank r's compute order of DualPipeV (see `dualpipe_v`), unchecked: valid from m = 2p-1 on
    (`simulate.check` proves it); DualPipe (`bidirectional`) runs it on both halves of its ranks."""
    down, up, o = r, 2 * pp - 1 - r, _Order()
    for _ in range(2 * (pp - 1 - r)):
        o.add(F, down)
    for _ in range(r + 1):
        o.add(F, down)
        o.add(F, up)
    for _ in range(pp - 1 - r):
        o.backward(up, split=True)
        o.weight()
        o.add(F, up)
    for _ in range(m - 2 * pp + r + 1):
        o.add(F, down)
        o.backward(up, split=False)
        o.add(F, up)
        o.backward(down, split=False)
    for _ in range(pp - 1 - r):
        o.backward(up, split=False)
        o.add(F, up)
        o.backward(down, split=False)
    split = False
    for i in range(r + 1):  # odd ranks start splitting one backward earlier than even ones
        split = split or (i == (r + 1) // 2 and r % 2 == 1)
        o.backward(up, split)
        split = split or (i == (r + 1) // 2 and r % 2 == 0)
        o.backward(down, split)
    for _ in range(pp - 1 - r):
        o.weight()
        o.backward(down, split)
    while o.pending_w:
        o.weight()
    return o.actions


def _v_schedule(name: str, pp: int, m: int, order) -> Schedule:
    compute = Schedule(tuple(tuple(order(r)) for r in range(pp)), 2 * pp, m, name)
    return with_communication(compute)


__all__ = ["V_SCHEDULES", "dualpipe_v", "dualpipe_v_order", "v_placement", "zb_v"]
