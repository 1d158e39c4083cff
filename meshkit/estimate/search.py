"""Plan search (`python -m meshkit.plan_search`): the Playbook's "best configuration" procedure, automated with meshkit's estimator.

1. Fit memory first. Every layout (pp, dp_replicate, dp_shard, cp, tp, and ep for MoE models) is tried with each
   activation-checkpointing mode and microbatch size; a plan is kept only if the peak memory of its
   worst rank fits the device's budget.
2. Then meet the global batch: microbatches per step = global tokens / (dp * mbs * seq).
3. Then scale: rank what fits by estimated step time (compute at an assumed efficiency, the pipeline
   bubble from meshkit's simulator, and the communication the overlap cannot hide).

A *family* is the set of parallelisms a plan uses ("fsdp", "tp+fsdp", "pp+tp+fsdp", ...). For every
family with no fitting plan the result says why: the smallest peak any of its plans reached, and
what dominated it, or that the global batch is too small for its data-parallel degree.
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
from dataclasses import dataclass, field
from typing import Any

from meshkit.estimate import moe
from meshkit.estimate.core import Estimate, estimate
from meshkit.estimate.report import build_parser, device_from_args, parse_tokens
from meshkit.estimate.spec import DEVICES, Device, GiB, Workload, load_config
from meshkit.plan import Plan, PlanError

AC_ORDER = ("none", "selective", "full")
MICROBATCH_SIZES = (1, 2, 4, 8)
SCHEDULES = (("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1))


def budget(device: Device, fraction: float = 0.9) -> float:
    """Bytes a plan may use: the rest is left to the CUDA context, NCCL buffers and fragmentation."""
    return device.memory_bytes * fraction


def check_structure(plan: Plan, config: Any, world: int, seq: int) -> None:
    """`plan.validate`: divisibility, heads, vocab and sequence length for this model and world."""
    plan.validate(config, world, seq)


@dataclass(frozen=True)
class Candidate:
    """A plan that fits, with the workload it was estimated for and its estimate."""
    plan: Plan
    workload: Workload
    estimate: Estimate

    @property
    def family(self) -> str:
        """The set of parallelisms the plan uses, e.g. 'tp+fsdp'."""
        return family(self.plan)

    def describe(self) -> str:
        """One line: the plan as `Plan.from_string` reads it (paste it into `--plan` or a recipe), then
        the microbatch size and count the estimate assumed."""
        w = self.workload
        return f"{self.plan.to_string() or 'single device'}  (mbs={w.mbs}, m={w.microbatches})"


@dataclass
class SearchResult:
    """Fitting plans ranked by step time, and why each family with none failed."""
    plans: list[Candidate]           # fitting plans, fastest first
    rejected: dict[str, str]         # family -> why none of its plans was returned
    considered: int = 0
    best_by_family: dict[str, Candidate] = field(default_factory=dict)
    removed: dict[str, int] = field(default_factory=dict)  # degree combinations no layout survived, by reason


def family(plan: Plan) -> str:
    """Name of the parallelism family of `plan` (the axes above degree 1)."""
    parts = [name for name in ("pp", "cp", "tp", "ep") if getattr(plan, name) > 1]
    if plan.dp_replicate > 1:
        parts.append("hsdp" if plan.dp_shard > 1 else "ddp")
    elif plan.dp_shard > 1:
        parts.append("fsdp")
    return "+".join(parts) or "single"


def _powers(limit: int) -> list[int]:
    return [2**i for i in range(limit.bit_length()) if 2**i <= limit]


CP_MIN_SHARD = 512  # tokens per context shard below which cp is not tried


def layouts(config: Any, world: int, seq: int, device: Device, removed: dict[str, int] | None = None) -> list[Plan]:
    """Degree combinations worth estimating: tp inside a node, pp up to the layer count, cp > 1 while
    each shard keeps CP_MIN_SHARD tokens; what is left of the world is data parallel, sharded or
    replicated. For an MoE model every ep dividing both dp_shard x cp (where meshkit folds it) and the
    expert count. `removed` counts the combinations each rule dropped, for an empty answer's reason."""
    experts = moe.require_supported(config)
    removed = {} if removed is None else removed
    out = []
    for tp, pp, cp in itertools.product(_powers(device.gpus_per_node), _powers(config.num_hidden_layers),
                                        _powers(8)):
        if world % (tp * pp * cp):
            why = f"tp x pp x cp does not divide world={world} (tp <= {device.gpus_per_node} per node, powers of 2)"
            removed[why] = removed.get(why, 0) + 1
            continue
        if cp > 1 and seq // cp < CP_MIN_SHARD:
            why = f"cp > 1 leaves fewer than {CP_MIN_SHARD} tokens per context shard at seq {seq}"
            removed[why] = removed.get(why, 0) + 1
            continue
        dp = world // (tp * pp * cp)
        for rep in _powers(dp):
            shard = dp // rep
            eps = [e for e in _powers(shard * cp) if experts and experts.num_experts % e == 0] or [1]
            out.extend(Plan(pp=pp, dp_replicate=rep, dp_shard=shard, cp=cp, tp=tp, ep=ep) for ep in eps)
    return out


def search(config: Any, world: int, seq: int, global_batch_tokens: int, device: str | Device = "h100", *,
           top: int = 10, mfu: float = 0.45, memory_fraction: float = 0.9,
           param_dtype: str = "bfloat16") -> SearchResult:
    """Every layout x AC mode x microbatch size (x schedule under pp), estimated; what fits, ranked."""
    moe.require_supported(config)
    device = DEVICES[device] if isinstance(device, str) else device
    limit = budget(device, memory_fraction)
    fits: list[Candidate] = []
    best: dict[str, tuple[float, str]] = {}  # family -> (smallest peak, description) among plans that ran
    reasons: dict[str, str] = {}
    considered = 0
    removed: dict[str, int] = {}
    for layout in layouts(config, world, seq, device, removed):
        base = dataclasses.replace(layout, param_dtype=param_dtype)
        fam = family(base)
        try:
            check_structure(base, config, world, seq)
        except PlanError as error:
            reasons.setdefault(fam, "invalid for this model: " + str(error).splitlines()[1].strip(" -"))
            continue
        per_rank_seqs = global_batch_tokens / (base.dp * seq)
        if per_rank_seqs < 1:
            reasons.setdefault(fam, f"global batch {global_batch_tokens:,} tokens < dp={base.dp} x seq {seq}")
            continue
        for mbs in MICROBATCH_SIZES:
            m = round(per_rank_seqs / mbs)
            if m < 1 or abs(m * mbs - per_rank_seqs) > 0.25 * per_rank_seqs:
                continue
            workload = Workload(seq, mbs, m, mfu)
            for name, v in SCHEDULES if base.pp > 1 else (("1f1b", 1),):
                scheduled = base
                if base.pp > 1:  # one pipeline call per step: all m microbatches in flight
                    scheduled = dataclasses.replace(base, pp_schedule=name, pp_virtual_stages=v, pp_microbatches=m)
                    try:
                        check_structure(scheduled, config, world, seq)
                    except PlanError:
                        continue
                # Least recompute first: once a mode fits, the heavier ones are never faster.
                for ac in AC_ORDER:
                    plan = dataclasses.replace(scheduled, activation_checkpointing=ac)
                    try:
                        e = estimate(config, plan, world, workload, device)
                    except ValueError as error:
                        reasons.setdefault(fam, f"not estimable: {error}")
                        break
                    considered += 1
                    peak = e.peak_bytes
                    if fam not in best or peak < best[fam][0]:
                        best[fam] = (peak, _dominant(e))
                    if peak <= limit:
                        fits.append(Candidate(e.plan, workload, e))
                        break
    fits.sort(key=lambda c: (c.estimate.step_time, c.estimate.peak_bytes))
    by_family: dict[str, Candidate] = {}
    for cand in fits:
        by_family.setdefault(cand.family, cand)
    rejected = {}
    for fam, (peak, what) in best.items():
        if fam not in by_family:
            rejected[fam] = (f"nothing fits: the smallest peak is {peak / GiB:.1f} GiB > {limit / GiB:.1f} GiB "
                             f"budget, at {what}")
    for fam, why in reasons.items():
        if fam not in by_family and fam not in rejected:
            rejected[fam] = why
    return SearchResult(fits[:top], rejected, considered, by_family, removed)


def _dominant(e: Estimate) -> str:
    mem = e.memory
    terms = {"model state": mem.state.persistent, "activations": mem.activations,
             "transients": mem.transient + mem.fsdp_buffers}
    top = max(terms, key=terms.get)
    w = e.workload
    return (f"{e.plan.describe()} ac={e.plan.activation_checkpointing} mbs={w.mbs} "
            f"({top} {terms[top] / GiB:.1f} GiB)")


def render(result: SearchResult, limit: float, world: int) -> str:
    """The search result as the table the CLI prints."""
    lines = [f"{len(result.plans)} best of {result.considered} plans estimated that fit "
             f"{limit / GiB:.1f} GiB per GPU, fastest first:"]
    lines.append(f"  {'#':>2} {'step ms':>8} {'MFU':>6} {'tok/s/GPU':>10} {'peak GiB':>9} {'bubble':>7} "
                 f"{'exposed comm':>13}  plan")
    for i, c in enumerate(result.plans, 1):
        e = c.estimate
        lines.append(f"  {i:>2} {e.step_time * 1e3:>8.0f} {e.mfu:>6.1%} {e.tokens_per_step / e.step_time / world:>10,.0f} "
                     f"{e.peak_bytes / GiB:>9.1f} {e.times['bubble']:>7.1%} "
                     f"{e.times['exposed_comm'] * 1e3:>10.0f} ms  {c.describe()}")
    lines.append("\nbest plan of each family that fits:")
    for fam, c in sorted(result.best_by_family.items(), key=lambda kv: kv[1].estimate.step_time):
        lines.append(f"  {fam:<16} {c.estimate.step_time * 1e3:>8.0f} ms  MFU {c.estimate.mfu:5.1%}  {c.describe()}")
    if result.rejected:
        lines.append("\nfamilies with no plan returned:")
        for fam, why in sorted(result.rejected.items()):
            lines.append(f"  {fam:<16} {why}")
    if not result.plans and not result.rejected:
        lines.append("\nno layout was estimated: " + ("; ".join(
            f"{why} ({n} degree combination{'s' if n > 1 else ''})" for why, n in sorted(result.removed.items()))
            or f"no degree combination for world={world}"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit code."""
    parser = build_parser("Search meshkit plans that fit memory, ranked by estimated step time.",
                          prog="python -m meshkit.plan_search")
    parser.add_argument("--global-batch-tokens", default="1M", help="tokens per optimizer step (1M = 2**20)")
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--memory-fraction", type=float, default=0.9, help="share of device memory a plan may use")
    args = parser.parse_args(argv)
    config = load_config(args.model)
    device = device_from_args(args)
    result = search(config, args.world, args.seq, parse_tokens(args.global_batch_tokens), device,
                    top=args.top, mfu=args.mfu,
                    memory_fraction=args.memory_fraction)
    print(f"model {args.model}, {args.world} x {device.name}, seq {args.seq}, global batch "
          f"{parse_tokens(args.global_batch_tokens):,} tokens, assumed compute efficiency {args.mfu:.0%}")
    print(render(result, budget(device, args.memory_fraction), args.world))
    return 0


if __name__ == "__main__":
    sys.exit(main())

