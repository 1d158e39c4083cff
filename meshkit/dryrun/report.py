"""The dry run's report: each simulated rank's peak by part beside the estimate, its collectives."""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshkit.dryrun.memory import PARTS
from meshkit.estimate.spec import GiB

if TYPE_CHECKING:
    from meshkit.dryrun import DryRun

_LABELS = {"parameters": "parameters (sharded, fp32 master)", "gradients": "gradients (sharded)",
           "optimizer": "optimizer state", "activations": "activations (saved by forwards)",
           "fsdp_buffers": "FSDP buffers (gathered units, grads)", "temporaries": "temporaries (backward, loss)"}


_UNITS = (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10))


def render(result: DryRun) -> str:
    """The text report `python -m meshkit.dryrun` prints."""
    w, p = result.workload, result.plan
    lines = [f"dry run: {p.describe()} | world {result.world} | seq {w.seq}, mbs {w.mbs}, {w.microbatches} "
             f"microbatch(es) per data rank | AC {p.activation_checkpointing}, {p.param_dtype} compute | "
             f"{result.seconds:.0f} s"]
    largest = max((r.run.measured.peak.bytes for r in result.ranks), default=0)
    unit, size = next(((u, n) for u, n in _UNITS if largest >= n), _UNITS[-1])

    def amount(n: float) -> str:
        return f"{n / size:10.3f}"

    for r in result.ranks:
        run, est, peak = r.run, r.estimate, r.run.measured.peak
        where = ", ".join(f"{k} {v}" for k, v in run.coords.items() if k == "pp" or v)
        ratio = est.peak_bytes / peak.bytes if peak.bytes else float("nan")
        lines.append(f"\nrank {run.rank} ({where}), {run.seconds:.0f} s; peak in {peak.phase}"
                     f"{'' if est.in_flight == 1 else f', {est.in_flight} microbatches in flight (simulator)'}")
        lines.append(f"  {unit:<40}{'measured':>10}{'estimate':>10}")
        for part in PARTS:
            lines.append(f"  {_LABELS[part]:<40}{amount(peak.parts[part])}{amount(est.parts[part])}")
        lines.append(f"  {'peak':<40}{amount(peak.bytes)}{amount(est.peak_bytes)}   estimate/measured {ratio:.3f}")
        lines.append(f"  {'collectives per step (bytes)':<40}{'measured':>16}{'estimate':>16}")
        measured, estimated = run.measured.collectives(), est.collectives
        for axis_name in sorted(set(measured) | set(estimated)):
            for kind in sorted(set(measured.get(axis_name, {})) | set(estimated.get(axis_name, {}))):
                m, e = measured.get(axis_name, {}).get(kind), estimated.get(axis_name, {}).get(kind)
                lines.append(f"  {kind + ' @ ' + axis_name:<40}{_count(m):>16}{_count(e):>16}")
        diffs = r.collective_differences
        lines.append("  collectives equal the estimate byte for byte (single scalars aside)" if not diffs
                     else "  DIFFER: " + "; ".join(diffs))
        if run.unknown_reads:
            lines.append(f"  {run.unknown_reads} host read(s) of values computed from fake weights (the gradient "
                         "norm) answered 0.0")
    checkpoint = result.extra.get("checkpoint")
    if checkpoint:
        lines.append(f"\ncheckpoint plan: {checkpoint['items']:,} items in {checkpoint['tensors']:,} tensors, "
                     f"metadata {checkpoint['metadata_bytes'] / 2**20:.1f} MiB (.metadata, written by rank 0)")
    return "\n".join(lines)


def _count(n: int | None) -> str:
    return "-" if n is None else f"{n:,}"
