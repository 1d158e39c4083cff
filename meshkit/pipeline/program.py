"""One rank's action list compiled once into the flat steps `run_schedule` executes every call.

Why: the runtime walks the same list at every training step, and whatever it does between one
compute and the next sits on the critical path whenever a peer waits for this rank. Resolving each
action once per (schedule, rank) - its peer, its message tag, whether its input arrives by a
receive, where each receive is posted - leaves the step itself only the work that depends on the
tensors: taking a buffer, posting, calling the stage.

Where receives are posted: `lookahead` computes before the compute that consumes them, which still
waits for them. gloo moves a message only once both ends have posted it (the receiver tells the
sender it is ready), so a receive posted just before its consumer costs a round trip between the two
ranks' transport threads on the critical path, while one posted a compute earlier is usually
complete when waited on. Sends stay right after their producer, and waits stay where the schedule
puts them, so the deadlock-freedom `simulate.check` proves still holds (see `p2p`). The last step
(compute None) posts the sends after the last compute.
"""

from __future__ import annotations

import functools
from fractions import Fraction
from typing import NamedTuple

from meshkit.pipeline.actions import Action, ActionKind, Schedule
from meshkit.pipeline.simulate import simulate

K = ActionKind
COMM = frozenset({K.SEND_F, K.RECV_F, K.SEND_B, K.RECV_B})


class Post(NamedTuple):
    """A send or receive to start. `boundary` names the stage boundary whose `TensorMeta` describes
    the tensor; a send's tensor is stage `stage`'s output (SEND_F) or input gradient (SEND_B)."""

    action: Action
    position: int
    send: bool
    forward: bool
    stage: int
    microbatch: int
    boundary: int
    peer: int
    tag: int


class Compute(NamedTuple):
    """An F, B, BW or W; `received` is the tag of the receive it consumes (`receive`), None if its
    input (F) or output gradient (B/BW) is local or absent."""

    action: Action
    position: int
    kind: ActionKind
    stage: int
    microbatch: int
    received: int | None
    receive: Action | None


Step = tuple[tuple[Post, ...], Compute | None]


def tag(boundary: int, mb: int, num_microbatches: int, backward: bool) -> int:
    """Unique per message of a step, so gloo matches receives by identity, not by posting order."""
    return 2 * (boundary * num_microbatches + mb) + int(backward)


@functools.lru_cache(maxsize=16)
def idle_before(schedule: Schedule) -> tuple[frozenset[int], ...]:
    """Per rank, the indices of the computes it starts after waiting, in the simulator at unit costs."""
    out = []
    for spans in simulate(schedule).timeline:
        waits, previous_end = set(), Fraction(0)
        for j, span in enumerate(spans):
            if span.start > previous_end:
                waits.add(j)
            previous_end = span.end
        out.append(frozenset(waits))
    return tuple(out)


@functools.lru_cache(maxsize=64)
def compile_rank(schedule: Schedule, rank: int, lookahead: int, window: int = 0) -> tuple[Step, ...]:
    """This rank's actions as steps: (transfers to post as one batch, then one compute).

    `window` > 0 (gloo, which matches by tag): a receive whose usual step is not one the rank starts
    waiting is posted instead in the latest of the `window` steps before it that is, so that posting
    it costs time the rank spends waiting anyway rather than time between two computes. Its buffer
    (one boundary activation or gradient) is then allocated that much earlier: on a rank that waits
    for its first input, the receives of its first `window` computes are all posted in that wait
    (the runtime's window covers a whole step at pp=4, m=8: see `runtime.RECEIVE_WINDOW`).
    """
    owner, m = schedule.stage_to_rank(), schedule.num_microbatches
    actions = schedule.ranks[rank]
    waits = idle_before(schedule)[rank] if window > 0 else frozenset()

    def receive_step(usual: int) -> int:
        for step in range(usual, max(usual - window, 0) - 1, -1):
            if step in waits:
                return step
        return usual

    def post(a: Action, i: int) -> Post:
        s, mb = a.stage, a.microbatch
        if a.kind is K.SEND_F:
            return Post(a, i, True, True, s, mb, s, owner[s + 1], tag(s, mb, m, False))
        if a.kind is K.SEND_B:
            return Post(a, i, True, False, s, mb, s - 1, owner[s - 1], tag(s - 1, mb, m, True))
        if a.kind is K.RECV_F:
            return Post(a, i, False, True, s, mb, s - 1, owner[s - 1], tag(s - 1, mb, m, False))
        return Post(a, i, False, False, s, mb, s, owner[s + 1], tag(s, mb, m, True))

    def compute(a: Action, i: int) -> Compute:
        s, mb = a.stage, a.microbatch
        up, down = schedule.upstream(s), schedule.downstream(s)
        if a.kind is K.F and up is not None and owner[up] != rank:
            return Compute(a, i, a.kind, s, mb, tag(s - 1, mb, m, False), Action(K.RECV_F, s, mb))
        if a.kind in (K.B, K.BW) and down is not None and owner[down] != rank:
            return Compute(a, i, a.kind, s, mb, tag(s, mb, m, True), Action(K.RECV_B, s, mb))
        return Compute(a, i, a.kind, s, mb, None, None)

    computes = [compute(a, i) for i, a in enumerate(actions) if a.kind not in COMM]
    posts: list[list[Post]] = [[] for _ in range(len(computes) + 1)]
    next_compute = 0
    for i, a in enumerate(actions):
        if a.kind not in COMM:
            next_compute += 1
        elif a.kind in (K.RECV_F, K.RECV_B):
            posts[receive_step(max(next_compute - lookahead, 0))].append(post(a, i))
        else:
            posts[next_compute].append(post(a, i))
    steps = [(tuple(posts[j]), computes[j] if j < len(computes) else None) for j in range(len(computes) + 1)]
    return tuple(step for step in steps if step[0] or step[1] is not None)


__all__ = ["COMM", "Compute", "Post", "Step", "compile_rank", "tag"]
