"""The estimator's report, and the command-line flags `python -m meshkit.estimate` and the plan
search share (model, world, sequence, device and its overrides)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from meshkit import metrics
from meshkit.activation_checkpoint import AC_MODES
from meshkit.estimate import activations as acts
from meshkit.estimate import moe
from meshkit.estimate.core import Estimate, flop_counter_check
from meshkit.estimate.memory import model_state
from meshkit.estimate.spec import DEVICES, MODEL_PRESETS, Device, GiB, Workload, load_config
from meshkit.integrations.peft.model import lora_of, with_lora
from meshkit.models import roles
from meshkit.plan import Plan


def _gib(n: float) -> str:
    return f"{n / GiB:8.2f}"


def _bytes(n: float) -> str:
    for unit, size in (("GiB", GiB), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def render(e: Estimate, check_flops: bool = True) -> str:
    """The per-rank report the CLI prints."""
    c, p, w, mem = e.config, e.plan, e.workload, e.memory
    heads, kv, _ = roles.attention_dims(c)
    n_total = model_state(c, Plan()).params
    experts = moe.model_experts(c)
    ffn = c.intermediate_size
    if experts is not None:
        active = metrics.nonembedding_params(c) + c.vocab_size * c.hidden_size
        dense = c.num_hidden_layers - len(experts.layers)
        ffn = (f"{experts.num_experts} experts x {experts.intermediate_size}, top-{experts.top_k}, "
               f"{active / 1e9:.2f}B active" + (f", {dense} dense blocks of ffn {c.intermediate_size}" if dense else ""))
    L = []
    L.append(f"model: {n_total / 1e9:.2f}B params, L={c.num_hidden_layers} h={c.hidden_size} heads={heads}/{kv} "
             f"ffn={ffn} vocab={c.vocab_size}")
    L.append(f"plan: {p.describe()} on {p.world_size} x {e.device.name} | AC {p.activation_checkpointing}, "
             f"{p.param_dtype} compute / {p.reduce_dtype} reduce, SP {'on' if p.sequence_parallel else 'off'}, "
             f"loss_parallel {'on' if p.loss_parallel else 'off'}" +
             (f", {p.pp_schedule} x{p.pp_virtual_stages} with {p.microbatches} microbatches" if p.pp > 1 else ""))
    L.append(f"step: seq {w.seq}, mbs {w.mbs}, {w.microbatches} microbatch(es) per dp rank -> "
             f"{e.tokens_per_step:,} tokens per step (dp={p.dp})")
    s = mem.state
    L.append(f"\nmemory per rank (pp rank {mem.pp_rank}, the peak one){'':14}GiB")
    L.append(f"  parameters (fp32 shards = master weights){'':5}{_gib(s.param_bytes)}   {s.params:,} elements")
    L.append(f"  gradients (fp32 shards){'':23}{_gib(s.grad_bytes)}   "
             f"{_bytes(mem.grads_held if mem.moment != 'optimizer' else s.grad_bytes)} of them alive at the peak")
    L.append(f"  optimizer (AdamW exp_avg + exp_avg_sq){'':8}{_gib(s.optimizer_bytes)}")
    L.append(f"  activations held{'':30}{_gib(mem.activations)}   {mem.in_flight} microbatch(es) x "
             f"{mem.held_blocks // max(mem.in_flight, 1)} blocks in flight")
    for kind, per_block in mem.per_kind.items():
        label = "per block" if len(mem.per_kind) == 1 else f"{kind} block"
        held = mem.held.get(kind, 0)
        for part, n in per_block.items():
            L.append(f"    {label}: {part:<16}{_bytes(n):>12}   x{held} = {_bytes(n * held)}")
    L.append(f"    rotary cos/sin{'':14}{_bytes(mem.shared):>12}   x{mem.in_flight}")
    for part, n in mem.head.items():
        L.append(f"    {part:<26}{_bytes(n):>12}")
    moment = {"loss": "as the loss's backward starts", "block": "in a block's backward",
              "optimizer": "in the optimizer's step"}[mem.moment]
    L.append(f"  transient (loss backward / block recompute){'':3}{_gib(mem.transient)}")
    L.append(f"  FSDP buffers (gathered units, grad buffers){'':3}{_gib(mem.fsdp_buffers)}")
    fits = "fits" if mem.peak <= e.device.memory_bytes else "DOES NOT FIT"
    L.append(f"  peak{'':42}{_gib(mem.peak)}   of {e.device.memory_bytes / GiB:.1f} GiB: {fits} ({moment}"
             + (f", head buffers freed: {_bytes(mem.head_freed)}" if mem.head_freed else "") + ")")
    seq, tok = w.seq // p.cp, w.mbs * (w.seq // p.cp)
    measured = sum(mem.per_block.values())
    kort = acts.korthikanti_bytes(c, batch=w.mbs, seq=seq, tp=p.tp, sequence_parallel=p.sequence_parallel,
                                  ac=p.activation_checkpointing)
    L.append(f"  one block, measured: {measured / tok / c.hidden_size:.2f} x s*b*h bytes; Korthikanti "
             f"sbh(34+5as/h) for this TP/AC: {kort / tok / c.hidden_size:.2f} x s*b*h")
    z = "  ".join(f"{k} {v / GiB:.2f}" for k, v in s.zero.items())
    L.append(f"  Playbook model state per rank (GiB, 2+2+12 B/param, Nd={p.dp_shard * p.cp}): {z}; "
             f"meshkit FSDP2: {s.persistent / GiB:.2f} + buffers")
    f = e.flops
    world_flops = f.model * e.tokens_per_step
    lora = "; LoRA: the frozen base computes no weight gradients" if lora_of(c) else ""
    L.append(f"\nFLOPs (model = 6*N_nonembedding + 12*L*h_attn*s per token{lora}; hardware adds recompute)")
    L.append(f"  per token: model {f.model / 1e9:.2f} GFLOP, hardware {f.hardware / 1e9:.2f} GFLOP")
    L.append(f"  per step: {world_flops / 1e15:.1f} PFLOP model, {world_flops / p.world_size / 1e12:.1f} TFLOP per rank")
    if check_flops:
        counted, formula = flop_counter_check(c, w.seq)
        part = " (attention part; the MoE layer routes by data)" if moe.block_kinds(c)[0] == "moe" else ""
        L.append(f"  FlopCounterMode, one fake block{part} at seq {w.seq}: {counted / 1e12:.3f} TFLOP vs "
                 f"formula {formula / 1e12:.3f} (ratio {counted / formula:.4f})")
    L.append(f"\ncommunication per step, per rank (link: nvlink {e.device.nvlink_bw / 1e9:.0f} GB/s, "
             f"ib {e.device.ib_bw / 1e9:.0f} GB/s per GPU)")
    L.append(f"  {'axis':<13}{'collective':<15}{'calls':>7}{'buffer/call':>13}{'wire/rank':>12}{'link':>7}"
             f"{'time ms':>9}{'exposed':>9}  hides?  what")
    for col in e.comm:
        t = col.time(e.device.latency_s)
        hidden = 1 - col.exposed / t if t else 1.0
        verdict = "yes" if hidden > 0.95 else "no" if hidden < 0.05 else \
            f"{hidden:.0%}"
        L.append(f"  {col.axis:<13}{col.kind:<15}{col.calls:>7}{_bytes(col.buffer):>13}{_bytes(col.wire):>12}"
                 f"{col.link:>7}{t * 1e3:>9.1f}{col.exposed * 1e3:>9.1f}  {verdict:<6}  {col.what}")
    off = e.offload
    if off is not None:
        L.append(f"\nhost offload ({p.offload}), per step, per rank (host link {e.device.host_bw / 1e9:.0f} GB/s, "
                 f"host memory {e.device.host_memory_bw / 1e9:.0f} GB/s per GPU)")
        L.append(f"  host memory: {_bytes(off.host_bytes)} of {e.device.host_memory_bytes / GiB:.0f} GiB per GPU "
                 f"(fp32 parameter and gradient shards, optimizer state); {_bytes(mem.offloaded)} off the device")
        L.append(f"  host -> device {_bytes(off.h2d_bytes)} (a parameter shard per all-gather), device -> host "
                 f"{_bytes(off.d2h_bytes)} (a gradient shard per reduction): {off.transfer_time * 1e3:.1f} ms")
        L.append(f"  optimizer step on the CPU: {_bytes(off.host_step_bytes)} through host memory, "
                 f"{off.step_time * 1e3:.1f} ms (all counted exposed)")
        if p.offload == "nvme":
            L.append(f"  NVMe (offload_dir, {e.device.nvme_bw / 1e9:.1f} GB/s per GPU each way): the optimizer state, "
                     f"{_bytes(off.disk_state_bytes)} per rank, read and written each step ({_bytes(off.disk_bytes)}); "
                     f"{off.disk_time * 1e3:.1f} ms beyond the CPU step (reads overlap it, writes do not)")
    moved = e.activation_offload
    if moved is not None:
        L.append(f"\nactivation offload, per step, per rank: {_bytes(moved.host_bytes)} of saved activations in host "
                 f"memory at the peak, {_bytes(moved.link_bytes)} over the host link (out in forward, back in "
                 f"backward, on a side stream), {moved.exposed * 1e3:.1f} ms the compute does not hide")
    if p.float8 != "none":
        rate = f"{e.device.float8_flops / 1e12:.0f}" if e.device.float8_flops else "no float8 peak known:"
        L.append(f"\nfloat8 ({p.float8}): the blocks' projections at {rate} TFLOP/s; "
                 f"{s.float8_elements:,} elements of their gathered weights per rank "
                 f"({'FSDP all-gathers them in 1 byte each' if p.float8 == 'tensorwise' else 'gathered in ' + p.param_dtype})")
    tm = e.times
    host = f" + offload {tm['offload'] * 1e3:.0f} ms" if off is not None or moved is not None else ""
    L.append(f"\nstep time at {w.mfu:.0%} of {e.device.peak_flops / 1e12:.0f} TFLOP/s: compute "
             f"{tm['compute'] * 1e3:.0f} ms (pipeline bubble {tm['bubble']:.1%}) + exposed communication "
             f"{tm['exposed_comm'] * 1e3:.0f} ms{host} = {tm['step'] * 1e3:.0f} ms -> MFU {e.mfu:.1%}, "
             f"{e.tokens_per_step / tm['step'] / p.world_size:,.0f} tokens/s/GPU")
    return "\n".join(L)


# ---------------------------------------------------------------------------------------- CLI


def parse_tokens(text: str) -> int:
    """'1M' -> 2**20 (binary suffixes, so 1M = 128 sequences of 8192), '1e6' -> 1000000."""
    text = text.strip().upper()
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def build_parser(description: str = "", prog: str | None = None) -> argparse.ArgumentParser:
    """The command-line flags shared by `python -m meshkit.estimate` and `python -m meshkit.estimate.search`."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--model", required=True, help=f"preset ({', '.join(MODEL_PRESETS)}), config.json or dir")
    parser.add_argument("--world", type=int, required=True, help="number of GPUs")
    parser.add_argument("--seq", type=int, required=True, help="tokens per sequence")
    parser.add_argument("--device", default="h100", choices=sorted(DEVICES))
    parser.add_argument("--peak-tflops", type=float, help="override the device's dense bf16 peak")
    parser.add_argument("--nvlink-gbps", type=float, help="intra-node GB/s per GPU per direction")
    parser.add_argument("--ib-gbps", type=float, help="inter-node GB/s per GPU per direction")
    parser.add_argument("--gpus-per-node", type=int)
    parser.add_argument("--memory-gib", type=float, help="usable device memory")
    parser.add_argument("--host-gbps", type=float, help="host <-> device GB/s per GPU per direction (offload)")
    parser.add_argument("--host-memory-gib", type=float, help="host memory per GPU (offload)")
    parser.add_argument("--nvme-gbps", type=float, help="NVMe GB/s per GPU per direction (offload=nvme)")
    parser.add_argument("--float8-tflops", type=float, help="override the device's dense float8 peak")
    parser.add_argument("--mfu", type=float, default=0.45, help="assumed fraction of peak for compute")
    parser.add_argument("--lora-r", type=int, help="train a LoRA adapter of this rank, the base frozen (PEFT)")
    parser.add_argument("--lora-targets", default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
                        help="comma-separated target_modules of the LoRA adapter (with --lora-r)")
    return parser


def add_plan_args(parser: argparse.ArgumentParser) -> None:
    """The flags that say which plan and step one rank runs (`python -m meshkit.estimate` and
    `python -m meshkit.dryrun`): the plan string or its per-field flags, microbatch size and count."""
    parser.add_argument("--plan", default="", help='e.g. "tp=8,dp_shard=-1" (meshkit.Plan.from_string)')
    parser.add_argument("--mbs", type=int, default=1, help="sequences per microbatch per data-parallel rank")
    parser.add_argument("--ac", choices=AC_MODES, help="activation checkpointing (overrides the plan)")
    parser.add_argument("--microbatches", type=int,
                        help="per step per data rank (default: the plan's pp_microbatches, or 1 without pipeline)")
    parser.add_argument("--global-batch-tokens", help="e.g. 1M; sets microbatches = tokens / (dp*mbs*seq)")
    Plan.add_cli_args(parser)


def plan_and_workload(args: argparse.Namespace) -> tuple[Plan, Workload]:
    """The resolved plan and the step's workload the flags of `add_plan_args` describe. Unless the plan
    sets `param_dtype`, the recipes' mixed precision (bf16 compute); under pp without
    `pp_microbatches`, one pipeline call per step."""
    plan = Plan.from_cli_args(args, Plan.from_string(args.plan))
    given = args.plan.replace(" ", "")
    if "param_dtype=" not in given and getattr(args, "plan_param_dtype", None) is None:
        plan = dataclasses.replace(plan, param_dtype="bfloat16")
    if args.ac:
        plan = dataclasses.replace(plan, activation_checkpointing=args.ac)
    plan = plan.resolve(args.world)
    m = args.microbatches or plan.microbatches
    if args.global_batch_tokens:
        m = max(1, round(parse_tokens(args.global_batch_tokens) / (plan.dp * args.mbs * args.seq)))
    if plan.pp > 1 and plan.pp_microbatches is None:
        plan = dataclasses.replace(plan, pp_microbatches=m)
    return plan, Workload(args.seq, args.mbs, m, args.mfu)


def config_from_args(args: argparse.Namespace) -> Any:
    """The model's config from `--model`, carrying `--lora-r`/`--lora-targets` when LoRA is asked for."""
    config = load_config(args.model)
    if args.lora_r:
        config = with_lora(config, args.lora_r, [t for t in args.lora_targets.split(",") if t])
    return config


def device_from_args(args: argparse.Namespace) -> Device:
    """The device preset, with any bandwidth or peak overrides from the flags applied."""
    d = DEVICES[args.device]
    changes = {k: v for k, v in (("peak_flops", args.peak_tflops and args.peak_tflops * 1e12),
                                 ("nvlink_bw", args.nvlink_gbps and args.nvlink_gbps * 1e9),
                                 ("ib_bw", args.ib_gbps and args.ib_gbps * 1e9),
                                 ("gpus_per_node", args.gpus_per_node),
                                 ("memory_bytes", args.memory_gib and args.memory_gib * GiB),
                                 ("host_bw", args.host_gbps and args.host_gbps * 1e9),
                                 ("host_memory_bytes", args.host_memory_gib and args.host_memory_gib * GiB),
                                 ("nvme_bw", args.nvme_gbps and args.nvme_gbps * 1e9),
                                 ("float8_flops", args.float8_tflops and args.float8_tflops * 1e12)) if v}
    return dataclasses.replace(d, **changes)
