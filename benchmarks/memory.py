"""Memory and bytes per step of ZeRO-1/2/3, host offload and the fused step, next to the formulas
(`python -m benchmarks.memory [--out benchmarks/results]`).

Four gloo ranks train a Llama-shaped model (dp_shard=4, fp32) for one window of two micro-batches per
configuration. Per rank and configuration it measures the model state at the end of the window's last
backward (parameter, gradient and optimizer shards, FSDP2's gathered buffers and unreduced gradients,
read from the tensors themselves), the largest gradient bytes alive during that backward (sampled at
each unit's reduction), FSDP's bytes over the window (CommCounter) and the process's peak RSS; and
prints them beside meshkit's estimate and the ZeRO paper's fp32 analogue. On this CPU-only machine
offload saves nothing (its shards already live in host memory); its numbers are the offload path's.
"""

from __future__ import annotations

import argparse
import resource
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from torch.distributed.fsdp import FSDPModule  # noqa: E402
from transformers import LlamaConfig  # noqa: E402

import meshkit  # noqa: E402
from benchmarks.launch import meshkit_model, run_ranks  # noqa: E402
from benchmarks.report import emit, machine_line, mib, ratio, table  # noqa: E402
from meshkit import estimate as est  # noqa: E402
from meshkit._compat.dispatch import storage_key, storage_nbytes  # noqa: E402
from meshkit._compat.fsdp import fsdp_after_unit_reduce, fsdp_unsharded_tensors  # noqa: E402
from meshkit.comm_counter import CommCounter  # noqa: E402
from meshkit.data_parallel.zero_stages import fsdp_roots  # noqa: E402
from meshkit.estimate.zero import paper_model_states, zero_memory  # noqa: E402

MODEL = dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, vocab_size=4096, max_position_embeddings=256)
WORLD, BATCH, SEQ = 4, 2, 64
CONFIGS = {  # name -> (plan, fused)
    "ZeRO-1": ("dp_shard=4,zero=1,grad_sync=last_microbatch", False),
    "ZeRO-2": ("dp_shard=4,zero=2", False),
    "ZeRO-3": ("dp_shard=4,zero=3", False),
    "ZeRO-2 + offload": ("dp_shard=4,zero=2,offload=optimizer", False),
    "ZeRO-3 fused": ("dp_shard=4,zero=3", True),
}


def _local_bytes(tensors) -> int:
    """Bytes of the local parts (a DTensor's shard on this rank): what the rank itself holds."""
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    return sum(t.numel() * t.element_size() for t in local)


def _held(pm, params, opt_state) -> dict:
    """Model-state bytes this rank holds now, by kind, read from the tensors themselves."""
    gathered, unreduced = [], []
    for root in fsdp_roots(pm.model_parts):
        g, u = fsdp_unsharded_tensors(root)
        gathered, unreduced = gathered + g, unreduced + u
    return {"master": _local_bytes(params), "grads": _local_bytes(p.grad for p in params if p.grad is not None),
            "optimizer": _local_bytes(opt_state()),
            "gathered": sum({storage_key(t): storage_nbytes(t) for t in gathered}.values()),
            "unreduced": _local_bytes(unreduced)}


def measure(plan_text: str, fused: bool) -> dict:
    """One rank, after a first step: model state between the window's two calls (after the fused
    step's one call), the most gradient bytes alive at any unit's reduction, FSDP bytes over the
    window, peak RSS."""
    pm = meshkit_model(MODEL, plan_text)
    params = list(pm.parameters())
    ids = torch.randint(0, MODEL["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(pm.dp_rank))
    peak_grads = [0]

    def sample(_params=None) -> None:
        """After each unit's reduction: the gradient bytes held at that moment, whose maximum is the step's gradient peak."""
        held = _held(pm, params, lambda: [])
        peak_grads[0] = max(peak_grads[0], held["grads"] + held["unreduced"])

    # Sampled after each unit's reduction; registered before fusing, so under the fused step it runs
    # after the reduce-scatter and before that unit's update frees its gradients.
    for part in pm.model_parts:
        for unit in part.modules():
            if isinstance(unit, FSDPModule):
                fsdp_after_unit_reduce(unit, sample)
    if fused:
        handle = meshkit.fuse_optimizer_into_backward(pm, lambda ps: torch.optim.AdamW(ps, lr=1e-4))

        def opt_state():
            """The fused step's optimizer state, spread over its per-parameter optimizers."""
            return [v for o in handle.optimizers.values() for s in o.state.values() for v in s.values()
                    if torch.is_tensor(v)]
        pm.forward_backward(ids, ids)  # a first step creates the optimizer state
    else:
        opt = torch.optim.AdamW(params, lr=1e-4)

        def opt_state():
            """The plain AdamW's state tensors."""
            return [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
        pm.forward_backward(ids, ids)
        opt.step()
        opt.zero_grad(set_to_none=True)
    peak_grads[0] = 0
    start = time.perf_counter()
    with CommCounter(pm.mesh) as counter:
        if fused:
            pm.forward_backward(ids, ids)
            held = _held(pm, params, opt_state)
        else:
            pm.forward_backward(ids, ids, last_microbatch=False)
            held = _held(pm, params, opt_state)
            sample()
            pm.forward_backward(ids, ids)
    elapsed = time.perf_counter() - start
    fsdp = {k: 0 for k in ("all_gather", "reduce_scatter")}
    for kind, label, nbytes in counter.events:
        if kind in fsdp and label == "dp_shard_cp":
            fsdp[kind] += nbytes
    return {"held": held, "peak_grads": peak_grads[0], "comm": fsdp, "seconds": elapsed,
            "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def main(argv: list[str] | None = None) -> int:
    """Run every configuration, print the table, write it and the bar chart under --out."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="directory for memory.md and memory.png")
    args = parser.parse_args(argv)
    config = LlamaConfig(**MODEL)
    rows, bars = [], {}
    for name, (plan_text, fused) in CONFIGS.items():
        plan = meshkit.Plan.from_string(plan_text).resolve(WORLD)
        results = run_ranks(measure, WORLD, plan_text, fused)
        r = results[0]
        state = est.model_state(config, plan)
        zm = zero_memory(plan, state, config, fused=fused)
        psi, n = state.held_elements, WORLD
        measured = sum(r["held"].values())
        estimate = zm.master + zm.optimizer if fused else zm.between_calls
        paper = paper_model_states(plan.zero, psi, n, param_bytes=4, grad_bytes=4, k=12)
        workload = est.Workload(seq=SEQ, mbs=BATCH, microbatches=1 if fused else 2)
        comm_est = sum(c.calls * c.buffer for c in est.communication(config, plan, workload, est.DEVICES["h100"],
                                                                    state, 1.0, 0.0) if c.axis == "dp_shard_cp")
        comm = sum(r["comm"].values())
        rows.append([name, plan_text + (" + fused" if fused else ""), mib(measured), mib(estimate),
                     ratio(measured, estimate), mib(paper), ratio(measured, paper), mib(zm.host),
                     mib(r["peak_grads"]), mib(comm), mib(comm_est), ratio(comm, comm_est),
                     mib(max(x["rss"] for x in results)), f"{r['seconds']:.2f}"])
        bars[name] = (measured, paper, r["peak_grads"], comm)
    lines = ["# Memory: ZeRO stages, offload, fused step", "", machine_line(), "",
             f"Model: {MODEL}; {WORLD} ranks, dp_shard={WORLD}, fp32; one window of 2 micro-batches of "
             f"{BATCH}x{SEQ} tokens (the fused step: one call), after a first step. Rank 0 shown. Model state: "
             "what the rank holds between the window's two calls (ZeRO-1 syncs on the last call, so its full "
             "gradient is held; the others sync every call), read from the tensors; after the call for the "
             "fused step. Paper: its fp32 analogue (4 + 4 bytes, K = 12 with an fp32 master): ZeRO-1/2 equal it "
             "up to padding, ZeRO-3 holds 16 not 20 bytes / N because FSDP2's fp32 shard is the master. Peak "
             "grads: the most gradient bytes (shards and unreduced) alive at any unit's reduction. Comm: FSDP's "
             "all-gather + reduce-scatter buffers over the window. On this CPU machine offload saves no device "
             "memory (the shards already live in host memory); the host column is what it moves there.", ""]
    lines += table(["config", "plan", "state MiB", "estimate", "ratio", "paper", "state/paper", "host (offload)",
                    "peak grads", "comm MiB", "comm estimate", "comm ratio", "max RSS MiB", "window s"], rows)
    unfused, fused_peak = bars["ZeRO-3"][2], bars["ZeRO-3 fused"][2]
    lines.append(f"Fused step: peak live gradient bytes {mib(fused_peak)} MiB vs {mib(unfused)} MiB unfused "
                 f"(ratio {ratio(fused_peak, unfused)}; {MODEL['num_hidden_layers']} blocks + embedding + head).")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
        names = list(bars)
        xs = range(len(names))
        left.bar([x - 0.2 for x in xs], [bars[k][0] / 2**20 for k in names], 0.4, label="measured")
        left.bar([x + 0.2 for x in xs], [bars[k][1] / 2**20 for k in names], 0.4, label="formula")
        left.set_title("model state per rank (MiB)")
        right.bar(xs, [bars[k][3] / 2**20 for k in names], 0.6, color="tab:green")
        right.set_title("FSDP bytes per window (MiB)")
        for ax in (left, right):
            ax.set_xticks(list(xs), names, rotation=20, fontsize=8)
        left.legend()
        fig.tight_layout()
        fig.savefig(out / "memory.png", dpi=110)
        lines.append("\n![memory](memory.png)")
        emit(lines, str(out / "memory.md"))
    else:
        emit(lines, None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
