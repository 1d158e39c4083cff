"""Where a measured pipeline step's wall time goes: its critical path, rebuilt from every rank's trace.

`run_schedule(..., trace=...)` records each rank's computes, transfer posts and receive waits on
`time.perf_counter`, a clock the ranks of one machine share; the sleep stages record their sleeps.
The step's end is the rank that finished last; walking back from there, a wait on a receive whose
send was posted after the wait began means the rank was waiting for its peer, so the path jumps to
the sender at the moment its send was posted (the time in between is delivery: the transport and
the wake-ups of the receiving threads). Everything else on the path is the rank's own time, split
by what it was doing. The parts sum to the measured step exactly:

- sleeps: the stages' stand-in compute (what the simulator replays, at the measured durations);
- stage code: the rest of the model's own work (the stage module and loss around the sleeps, the
  autograd backward, the deferred weight-gradient matmuls): what torch's runtime runs as well;
- runtime in actions: a compute action's time outside its stage code and waits (the executor's
  bookkeeping: taking the received tensor, wiring gradients, storing outputs);
- P2P post, sends / receives: starting transfers (a batch holding a send counts as sends; on gloo
  each transfer is its own event); delivery: a message in flight while its receiver waited;
- loop: the executor between actions (and its checks on entry, its final waits on exit);
- start/end: the rank's start after the first rank started (barrier release skew) plus the
  harness's timing calls around `run_schedule`.

Nothing here measures; it only reads records (see `benchmarks.pipeline.ranks.record`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from meshkit.pipeline.actions import Schedule, parse_action

CATEGORIES = ("sleeps", "stage code", "runtime in actions", "P2P post: sends", "P2P post: receives", "delivery",
              "loop", "start/end")


def _overlap(a: float, b: float, start: float, end: float) -> float:
    return max(0.0, min(b, end) - max(a, start))


class _Rank:
    """One rank's step: its call span, computes, posts, waits and sleeps, as (start, end) intervals."""

    def __init__(self, rec: dict[str, Any]) -> None:
        self.t0, self.t1 = rec["t0"], rec["t1"]
        events = rec["trace"]
        call = [e for e in events if e[0] == "call"]
        self.call = (call[0][2], call[0][3]) if call else (self.t0, self.t1)
        self.computes = [(e[1], e[2], e[3]) for e in events if e[0] == "compute"]
        self.posts = [(e[1], e[2], e[3]) for e in events if e[0] == "post"]
        self.send_posts = [p for p in self.posts if any(text.startswith("SEND") for text in p[0])]
        self.receive_posts = [p for p in self.posts if not any(text.startswith("SEND") for text in p[0])]
        self.waits = [(e[1], e[2], e[3]) for e in events if e[0] == "wait"]
        self.stages = [(e[1], e[2], e[3]) for e in events if e[0] == "stage"]
        self.sleeps = [(s[1], s[2]) for s in rec["sleeps"]]
        self.send_posted = {text: end for texts, _, end in self.posts for text in texts if text.startswith("SEND")}

    def split(self, a: float, b: float, out: Counter) -> None:
        """Charge [a, b] of this rank to the categories."""
        if b <= a:
            return
        sleeps = _inside(a, b, self.sleeps)
        waits = _inside(a, b, self.waits)
        sends, receives = _inside(a, b, self.send_posts), _inside(a, b, self.receive_posts)
        posts = sends + receives
        stages = _inside(a, b, self.stages)
        computes = _inside(a, b, self.computes)
        in_call = _overlap(a, b, *self.call)
        out["sleeps"] += sleeps
        out["delivery"] += waits  # a wait for a send posted before it began: the message was in flight
        out["P2P post: sends"] += sends
        out["P2P post: receives"] += receives
        out["stage code"] += max(stages - sleeps, 0.0)  # sleeps run inside the stage code
        out["runtime in actions"] += max(computes - stages - waits, 0.0)
        out["loop"] += max(in_call - computes - posts, 0.0)
        out["start/end"] += (b - a) - in_call


def _inside(a: float, b: float, intervals: Sequence[tuple]) -> float:
    """Time of [a, b] covered by the intervals (each (..., start, end), disjoint within a kind)."""
    return sum(_overlap(a, b, i[-2], i[-1]) for i in intervals)


def _sender(schedule: Schedule, receive: str) -> tuple[int, str]:
    """The rank and the send action text that feed a receive (RECV_F s.mb <- SEND_F s-1.mb, etc.)."""
    action = parse_action(receive)
    owner = schedule.stage_to_rank()
    if action.kind.value == "RECV_F":
        return owner[action.stage - 1], f"SEND_F{action.stage - 1}.{action.microbatch}"
    return owner[action.stage + 1], f"SEND_B{action.stage + 1}.{action.microbatch}"


def critical_path(schedule: Schedule, recs: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Seconds of one measured step per category (they sum to the step), plus 'hops' and 'actions'."""
    ranks = [_Rank(r) for r in recs]
    first = min(r.t0 for r in ranks)
    r = max(range(len(ranks)), key=lambda i: ranks[i].t1)
    cur = ranks[r].t1
    out: Counter = Counter()
    hops = 0
    while True:
        rank = ranks[r]
        jump = None
        for wait in sorted(rank.waits, key=lambda w: -w[2]):
            text, start, end = wait
            if end > cur:
                continue
            peer, send = _sender(schedule, text)
            posted = ranks[peer].send_posted.get(send)
            if posted is not None and posted > start:
                jump = (wait, peer, min(posted, end))
                break
        if jump is None:
            rank.split(rank.t0, cur, out)
            out["start/end"] += rank.t0 - first
            break
        (text, start, end), peer, posted = jump
        rank.split(end, cur, out)
        out["delivery"] += end - posted
        hops += 1
        r, cur = peer, posted
    result = {c: out[c] for c in CATEGORIES}
    result["hops"] = hops
    return result


__all__ = ["CATEGORIES", "critical_path"]
