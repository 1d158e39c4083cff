"""What a checkpoint must remember about the run that wrote it: global batch, sequence length, plan.

A checkpoint resumes under any plan and world size, which makes it easy to change the global batch
without noticing: fewer data ranks with the same `local_batch` quietly halve it, and with it the
meaning of the learning rate, the schedule and the data order. So the run's shape travels in the
checkpoint's metadata (`extra["run"]`, written once by rank 0 with the step) and a resume compares
it with the new run's before training, refusing a different global batch or sequence length with
both values named unless the user says the change is deliberate.

Kept apart from `checkpoint.py` on purpose: it only builds and compares a small dict, so the
checkpoint format can evolve without touching it.
"""

from __future__ import annotations

from typing import Any

RUN_KEY = "run"


def run_record(plan: Any, dp_size: int, local_batch: int, grad_accum: int, seq_len: int) -> dict[str, Any]:
    """The run's shape as plain data: global batch = dp x local batch x accumulation, in sequences."""
    return {
        "global_batch": int(dp_size * local_batch * grad_accum),
        "dp": int(dp_size),
        "local_batch": int(local_batch),
        "grad_accum": int(grad_accum),
        "seq_len": int(seq_len),
        "plan": plan.to_dict(),
    }


def with_run_record(extra: Any, record: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's `extra` with the run record added under `"run"` (other entries kept)."""
    merged = dict(extra) if isinstance(extra, dict) else ({} if extra is None else {"user": extra})
    merged[RUN_KEY] = record
    return merged


def _describe(record: dict[str, Any]) -> str:
    return (f"global batch {record['global_batch']} sequences (dp {record['dp']} x local_batch "
            f"{record['local_batch']} x grad_accum {record['grad_accum']}) of {record['seq_len']} tokens")


def resume_problem(extra: Any, current: dict[str, Any], allow_change: bool = False) -> str | None:
    """Why resuming a checkpoint whose `extra` came from another run shape is refused, or None.

    None too when the checkpoint carries no record (written before records existed, or by code that
    does not record one): there is nothing to compare.
    """
    saved = extra.get(RUN_KEY) if isinstance(extra, dict) else None
    if not isinstance(saved, dict) or allow_change:
        return None
    changed = [k for k in ("global_batch", "seq_len") if saved.get(k) != current[k]]
    if not changed:
        return None
    return (f"the checkpoint was trained with a {_describe(saved)}; this run has a {_describe(current)}. "
            f"Changing the {' and the '.join(k.replace('_', ' ') for k in changed)} changes what the learning "
            f"rate and schedule mean and which data each step sees; fix: keep dp x local_batch x grad_accum = "
            f"{saved['global_batch']} and seq_len = {saved['seq_len']} (e.g. raise local_batch or grad_accum "
            f"when dp shrinks), or pass allow_batch_change (--allow-batch-change) to change it deliberately")
