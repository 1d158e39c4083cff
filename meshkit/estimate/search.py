"""Plan search (`python -m meshkit.estimate.search`): the Playbook's "best configuration" procedure, automated with meshkit's estimator.

1. Fit memory first. Every layout (pp, dp_replicate, dp_shard, cp, tp, and ep for MoE models) is tried with each
   activation-checkpointing mode, microbatch size, ZeRO stage and gradient-sync policy, and the offloads
   (activations to the host, model state to the host, the optimizer state on to NVMe) where nothing
   else fits a mode; a plan is kept only if the peak memory of its worst rank fits the device's budget
   (and, offloaded, what it keeps in host memory the host's).
2. Then meet the global batch: microbatches per step = global tokens / (dp * mbs * seq).
3. Then scale: rank what fits by estimated step time (compute at an assumed efficiency, the pipeline
   bubble from meshkit's simulator, the communication the overlap cannot hide, and offload's host-link
   copies, CPU optimizer step and disk traffic). Under cp > 1 the zig-zag ring and the all-gather kind
   are both estimated and the faster one that fits is kept. On a device with float8 tensor cores (H100,
   H200) each kept plan's float8="tensorwise" twin is estimated too, where the model's projections take it.

A *family* is the set of parallelisms a plan uses ("fsdp", "tp+fsdp", "pp+tp+fsdp", ...). For every
family with no fitting plan the result says why: the smallest peak any of its plans reached, and
what dominated it, or that the global batch is too small for its data-parallel degree.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
import transformers
from tqdm.auto import tqdm

from meshkit.dryrun import dry_run
from meshkit.estimate import moe
from meshkit.estimate.core import Estimate, estimate
from meshkit.estimate.report import build_parser, config_from_args, device_from_args, parse_tokens
from meshkit.estimate.spec import DEVICES, Device, GiB, Workload, config_from_key, config_key
from meshkit.integrations.peft import model as peft_model
from meshkit.models.moe import convert_moe_blocks
from meshkit.plan import Plan, PlanError

AC_ORDER = ("none", "selective", "full")
MICROBATCH_SIZES = (1, 2, 4, 8)
NVME_DIR = "/nvme"  # offload_dir of the offload="nvme" plans the search prints: replace it with the run's own
SEARCHED_SCHEDULES = (("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1), ("zb_h2", 1), ("zb_v", 1), ("dualpipe_v", 1),
                      ("dualpipe", 1), ("zb_auto", 1))


def budget(device: Device, fraction: float = 0.9) -> float:
    """Bytes a plan may use: the rest is left to the CUDA context, NCCL buffers and fragmentation."""
    return device.memory_bytes * fraction


def check_structure(plan: Plan, config: Any, world: int, seq: int) -> None:
    """`plan.validate`: divisibility, heads, vocab and sequence length for this model and world; for
    a LoRA model also whether every adapter can follow its base under the plan's tp."""
    plan.validate(config, world, seq)
    if peft_model.lora_of(config) is not None and plan.tp > 1:
        problems = _lora_tp_problems(config_key(config), plan.tp)
        if problems:
            raise PlanError.of(*problems)


@functools.lru_cache(maxsize=64)
def _lora_tp_problems(config_json: str, tp: int) -> tuple[str, ...]:
    """What `parallelize` would refuse of a LoRA model's adapters under `tp`, on a one-block meta model
    of the config (cached: a search asks once per layout)."""
    cfg = config_from_key(config_json)
    cfg.num_hidden_layers = 1
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    if moe.model_experts(cfg) is not None:
        convert_moe_blocks(model)
    return tuple(peft_model.tp_problems(peft_model.wrap(model, cfg), tp))


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


def cp_kinds(plan: Plan) -> tuple[tuple[str, bool | None], ...]:
    """The CP kinds, with keep-K/V, the search weighs against each other for a layout: the zig-zag
    ring keeping K/V (the byte minimum, transfers overlapped, (cp-1) K/V shards per layer held under
    AC none), the same without keeping them (K/V sent again in backward, no shard held) and the
    all-gather (the minimum's bytes in fewer calls, the whole sequence's K/V held per layer).
    Ulysses needs head counts a layout may not have and is left to the user."""
    if plan.cp == 1:
        return ((plan.cp_attention, plan.cp_keep_kv),)
    return (("zigzag", True), ("zigzag", False), ("allgather", False))


def _powers(limit: int) -> list[int]:
    return [2**i for i in range(limit.bit_length()) if 2**i <= limit]


CP_MIN_SHARD = 512  # tokens per context shard below which cp is not tried


def layouts(config: Any, world: int, seq: int, device: Device, removed: dict[str, int] | None = None) -> list[Plan]:
    """Degree combinations worth estimating: tp inside a node, pp up to the layer count, cp > 1 while
    each shard keeps CP_MIN_SHARD tokens; what is left of the world is data parallel, sharded or
    replicated. For an MoE model every ep dividing both dp_shard x cp (where meshkit folds it) and the
    expert count. `removed` counts the combinations each rule dropped, for an empty answer's reason."""
    experts = moe.model_experts(config)
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
           param_dtype: str = "bfloat16", progress: bool = False) -> SearchResult:
    """Every layout x AC mode x microbatch size (x schedule under pp), estimated; what fits, ranked.

    A large world takes minutes (tens of thousands of estimates): `progress` shows a bar over the
    layouts on a terminal (the command line turns it on)."""
    device = DEVICES[device] if isinstance(device, str) else device
    limit = budget(device, memory_fraction)
    host_limit = device.host_memory_bytes * memory_fraction
    host_short: dict[str, str] = {}  # family -> why offload, the only way it fit the device, did not fit the host
    fits: list[Candidate] = []
    best: dict[str, tuple[float, str]] = {}  # family -> (smallest peak, description) among plans that ran
    reasons: dict[str, str] = {}
    considered = 0
    removed: dict[str, int] = {}
    bar = dict(desc="plan search: layouts", unit="layout", file=sys.stderr, leave=False,
               disable=None if progress else True)  # None: tqdm shows it on a terminal only
    for layout in tqdm(layouts(config, world, seq, device, removed), **bar):
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
            for name, v in SEARCHED_SCHEDULES if base.pp > 1 else (("1f1b", 1),):
                scheduled = base
                if base.pp > 1:  # one pipeline call per step: all m microbatches in flight
                    scheduled = dataclasses.replace(base, pp_schedule=name, pp_virtual_stages=v, pp_microbatches=m)
                    try:
                        check_structure(scheduled, config, world, seq)
                    except PlanError:
                        continue
                # Least recompute first, and within a mode the on-device memory options that move fewest
                # bytes first: once one fits, the heavier ones are never faster. Host offload is the
                # fallback of a mode where none fits: its options are all estimated and the fastest
                # that fits is kept, and the next recompute mode is still tried (recompute or offload,
                # whichever the step time favours, is the ranking's call).
                for ac in AC_ORDER:
                    options, errors, kinds = [], 0, cp_kinds(scheduled)
                    on_device_fits = False
                    for kind, keep_kv in kinds:
                        offloaded, on_device = [], {}
                        host_tight = False  # a host-offload plan needed more host memory than there is
                        for zero, grad_sync, offload, moved in memory_options(scheduled, workload):
                            if (offload != "none" or moved) and on_device_fits:
                                break
                            if _pruned(on_device.get((zero, grad_sync)), offload, moved, limit) or \
                                    (offload == "nvme" and not host_tight):
                                continue  # offloading cannot fit it, or the host holds the state anyway
                            plan = dataclasses.replace(scheduled, activation_checkpointing=ac, cp_attention=kind,
                                                       cp_keep_kv=keep_kv, zero=zero, grad_sync=grad_sync,
                                                       offload=offload, offload_dir=NVME_DIR if offload == "nvme" else None,
                                                       activation_offload=moved)
                            try:
                                e = estimate(config, plan, world, workload, device)
                            except ValueError as error:
                                reasons.setdefault(fam, f"not estimable: {error}")
                                errors += 1
                                break  # nothing else of this kind is estimable either
                            considered += 1
                            if offload == "none" and not moved:
                                on_device[zero, grad_sync] = e.memory
                            peak = e.peak_bytes
                            if fam not in best or peak < best[fam][0]:
                                best[fam] = (peak, _dominant(e))
                            if peak > limit:
                                continue
                            if e.host_bytes > host_limit:
                                host_tight = True
                                host_short.setdefault(fam, (
                                    f"fits the device only with offload={offload}, activation_offload={moved}, which "
                                    f"needs {e.host_bytes / GiB:.1f} GiB of host memory per GPU > "
                                    f"{host_limit / GiB:.1f} GiB, at {_dominant(e)}"))
                                continue
                            if offload == "none" and not moved:
                                options.append(Candidate(e.plan, workload, e))
                                on_device_fits = True
                                break
                            offloaded.append(Candidate(e.plan, workload, e))
                        options += offloaded
                    if options:  # the CP kind and memory option the numbers favour: faster, then smaller
                        chosen = min(options, key=lambda c: (c.estimate.step_time, c.estimate.peak_bytes))
                        fits.append(chosen)
                        twin = _float8_twin(chosen, config, world, seq, device, limit, host_limit)
                        if twin is not None:
                            fits.append(twin)
                            considered += 1
                    if on_device_fits or errors == len(kinds):
                        break
    fits.sort(key=lambda c: (c.estimate.step_time, c.estimate.peak_bytes))
    by_family: dict[str, Candidate] = {}
    for cand in fits:
        by_family.setdefault(cand.family, cand)
    rejected = {fam: why for fam, why in host_short.items() if fam not in by_family}
    for fam, (peak, what) in best.items():
        if fam not in by_family and fam not in rejected:
            rejected[fam] = (f"nothing fits: the smallest peak is {peak / GiB:.1f} GiB > {limit / GiB:.1f} GiB "
                             f"budget, at {what}")
    for fam, why in reasons.items():
        if fam not in by_family and fam not in rejected:
            rejected[fam] = why
    return SearchResult(fits[:top], rejected, considered, by_family, removed)


def memory_options(plan: Plan, workload: Workload) -> list[tuple[int, str, str, bool]]:
    """(zero, grad_sync, offload, activation_offload) worth estimating: first the on-device ones, fewest
    bytes moved first (ZeRO-2 gathers parameters once per step where ZeRO-3 gathers them per call and
    again in backward; syncing gradients once per window beats syncing every call; ZeRO-1 moves what
    ZeRO-2 does with more memory, so it never wins); then, where none fits, the offloads, whose
    host-link bytes, CPU step and disk traffic the estimate adds to the step time
    (`meshkit.estimate.offload`): activations to the host (ZeRO-R), model state to the host (ZeRO-Offload:
    zero=2, offload="optimizer"; zero=3, offload="params"), the optimizer state on to NVMe
    (ZeRO-Infinity: offload="nvme", for hosts too small for it), and state and activations together."""
    policies = ("last_microbatch", "every_microbatch") if workload.calls(plan) > 1 else ("every_microbatch",)
    state = [(2, sync, "optimizer") for sync in policies] + [(3, sync, "params") for sync in policies] + \
        [(zero, sync, "nvme") for zero in (2, 3) for sync in policies]
    if plan.dp_shard * plan.cp == 1:
        on_device = [(plan.zero, plan.grad_sync, "none")]
    else:
        on_device = [(zero, sync, "none") for zero in (2, 3) for sync in policies]
    return [(*o, False) for o in on_device] + [(*o, True) for o in on_device] + \
        [(*o, False) for o in state] + [(*o, True) for o in state if o[0] == 3]


def _pruned(same: Any, offload: str, moved: bool, limit: float) -> bool:
    """Whether an offload option cannot fit, judged by `same`, the memory of the same plan kept on the
    device (None: not estimated): offloading the state moves exactly the persistent state off the
    device, offloading activations at most the activations held."""
    if same is None or (offload == "none" and not moved):
        return False
    freed = (same.state_at_peak if offload != "none" else 0) + (same.activations if moved else 0)
    return same.peak - freed > limit


def _float8_twin(chosen: Candidate, config: Any, world: int, seq: int, device: Device, limit: float,
                 host_limit: float) -> Candidate | None:
    """The same plan with float8="tensorwise", where the device has float8 tensor cores, the model's
    projections take it, and it still fits (it gathers less, so it does whenever the plan did)."""
    if not device.float8_flops:
        return None
    plan = dataclasses.replace(chosen.plan, float8="tensorwise")
    try:
        check_structure(plan, config, world, seq)
        e = estimate(config, plan, world, chosen.workload, device)
    except (PlanError, ValueError):
        return None
    if e.peak_bytes > limit or e.host_bytes > host_limit:
        return None
    return Candidate(e.plan, chosen.workload, e)


def _dominant(e: Estimate) -> str:
    mem = e.memory
    terms = {"model state": mem.state_at_peak, "activations": mem.activations,
             "transients": mem.transient + mem.fsdp_buffers}
    top = max(terms, key=terms.get)
    w = e.workload
    off = f" offload={e.plan.offload}" if e.plan.offload != "none" else ""
    off += " activation_offload" if e.plan.activation_offload else ""
    return (f"{e.plan.describe()} ac={e.plan.activation_checkpointing}{off} mbs={w.mbs} "
            f"({top} {terms[top] / GiB:.1f} GiB)")


def render(result: SearchResult, limit: float, world: int) -> str:
    """The search result as the table the CLI prints."""
    lines = [f"{len(result.plans)} best of {result.considered} plans estimated that fit "
             f"{limit / GiB:.1f} GiB per GPU, fastest first:"]
    lines.append(f"  {'#':>2} {'step ms':>8} {'MFU':>6} {'tok/s/GPU':>10} {'peak GiB':>9} {'bubble':>7} "
                 f"{'exposed comm':>13} {'offload':>10}  plan")
    for i, c in enumerate(result.plans, 1):
        e = c.estimate
        lines.append(f"  {i:>2} {e.step_time * 1e3:>8.0f} {e.mfu:>6.1%} {e.tokens_per_step / e.step_time / world:>10,.0f} "
                     f"{e.peak_bytes / GiB:>9.1f} {e.times['bubble']:>7.1%} "
                     f"{e.times['exposed_comm'] * 1e3:>10.0f} ms {e.times['offload'] * 1e3:>7.0f} ms  {c.describe()}")
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


def verify_by_dry_run(result: SearchResult, config: Any, world: int, limit: float, k: int, *, jobs: int = 1) -> str:
    """The `k` fastest plans run by the dry run (`meshkit.dryrun`: meshkit's real step as the first,
    middle and last pipeline rank of a fake world), each rank's measured peak beside the estimate and
    the budget, and whether its collectives equal the estimate's byte for byte."""
    lines = [f"\nverified by the dry run (the real step on a fake world of {world}), the {k} fastest:",
             f"  {'#':>2} {'rank':>6} {'estimate GiB':>13} {'measured GiB':>13}  {'fits':<5} collectives"]
    for i, c in enumerate(result.plans[:k], 1):
        run = dry_run(config, c.plan, world, c.workload, jobs=jobs,
                      progress=lambda line: print(line, file=sys.stderr, flush=True))
        for r in run.ranks:
            measured = r.run.measured.peak.bytes
            diffs = r.collective_differences
            lines.append(f"  {i:>2} {r.run.rank:>6} {r.estimate.peak_bytes / GiB:>13.4g} {measured / GiB:>13.4g}  "
                         f"{'yes' if measured <= limit else 'NO':<5} "
                         f"{'equal' if not diffs else 'differ: ' + '; '.join(diffs)}  {c.describe()}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit code."""
    parser = build_parser("Search meshkit plans that fit memory, ranked by estimated step time.",
                          prog="python -m meshkit.estimate.search")
    parser.add_argument("--global-batch-tokens", default="1M", help="tokens per optimizer step (1M = 2**20)")
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--memory-fraction", type=float, default=0.9, help="share of device memory a plan may use")
    parser.add_argument("--verify", type=int, default=0, metavar="K",
                        help="run the K fastest plans through the dry run (python -m meshkit.dryrun)")
    parser.add_argument("--jobs", type=int, default=1, help="dry-run ranks simulated at once (with --verify)")
    args = parser.parse_args(argv)
    config = config_from_args(args)
    device = device_from_args(args)
    result = search(config, args.world, args.seq, parse_tokens(args.global_batch_tokens), device,
                    top=args.top, mfu=args.mfu,
                    memory_fraction=args.memory_fraction, progress=True)
    print(f"model {args.model}, {args.world} x {device.name}, seq {args.seq}, global batch "
          f"{parse_tokens(args.global_batch_tokens):,} tokens, assumed compute efficiency {args.mfu:.0%}")
    limit = budget(device, args.memory_fraction)
    print(render(result, limit, args.world), flush=True)
    if args.verify:
        print(verify_by_dry_run(result, config, args.world, limit, args.verify, jobs=args.jobs))
    return 0


if __name__ == "__main__":
    sys.exit(main())

