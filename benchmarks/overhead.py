"""What meshkit costs: step time with every degree 1 vs plain HF, and bytes moved vs the theoretical minimum.

    python -m benchmarks.overhead                 # both parts (part b runs 4 gloo ranks, benchmarks.launch)
    python -m benchmarks.overhead --part time     # or --part bytes

(a) With every degree 1, meshkit should be the HF model plus bookkeeping: same process, same weights,
same inputs, the two steps interleaved so machine noise hits both alike; the ratio of median step
times is the overhead (goal <= 1.05).

(b) A tp=2 x dp_shard=2 plan on 4 processes, one training step (count tokens, forward/backward,
clip, AdamW) counted by `meshkit.comm_counter.CommCounter`, which sees every collective: FSDP2's c10d
calls and DTensor's functional collectives alike. The theory column is the minimum that plan needs
(derivation in `theory`); a ratio above 1 is traffic meshkit could avoid.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections import defaultdict
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import meshkit
from benchmarks.launch import run_ranks
from benchmarks.report import emit, machine_line, table
from meshkit.comm_counter import CommCounter
from meshkit.models.roles import attention_dims
from meshkit.plan import DTYPES

SMALL = 64  # all-reduces at or under this many bytes are latency-bound scalars, reported apart


def llama_config(hidden: int, layers: int, heads: int, kv_heads: int, inter: int, vocab: int, seq: int) -> Any:
    """A fresh Llama config with meshkit's attention kernel (SDPA) pinned for both sides."""
    return LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                       max_position_embeddings=max(seq, 128), use_cache=False, tie_word_embeddings=False,
                       attn_implementation="sdpa")  # what meshkit pins: the same kernel on both sides


# -------------------------------------------------------------------------------- (a) step time


def time_overhead(args: argparse.Namespace) -> list[str]:
    """Interleaved repetitions of both steps in one process; the report lines of part (a)."""
    config = llama_config(args.hidden, args.layers, args.heads, args.kv_heads, args.inter, args.vocab, args.seq)
    torch.manual_seed(0)
    hf = LlamaForCausalLM(config)
    pm = meshkit.parallelize(copy.deepcopy(hf), meshkit.Plan())
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=gen)

    def hf_step() -> float:
        """Plain HF on one process: the peer meshkit's one-rank overhead is measured against."""
        loss = hf(input_ids=ids, labels=ids).loss
        loss.backward()
        hf.zero_grad(set_to_none=True)
        return float(loss.detach())

    def mk_step() -> float:
        """meshkit's one-rank step on the same model and ids; gradients dropped so repetitions do not accumulate."""
        loss = pm.forward_backward(ids, ids)
        for p in pm.parameters():
            p.grad = None
        return float(loss)

    variants = {"plain HF": hf_step, "meshkit (all degrees 1)": mk_step}
    first = {name: fn() for name, fn in variants.items()}
    gap = abs(first["plain HF"] - first["meshkit (all degrees 1)"])
    if gap > 1e-4:
        raise SystemExit(f"losses differ by {gap:.2e}: the two sides do not compute the same thing")
    for _ in range(args.warmup):
        for fn in variants.values():
            fn()
    times: dict[str, list[float]] = defaultdict(list)
    order = list(variants)
    for rep in range(args.reps):
        for name in order if rep % 2 == 0 else order[::-1]:
            start = time.perf_counter()
            variants[name]()
            times[name].append(time.perf_counter() - start)
    base_name, mk_name = order
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    # Each rep runs both back to back, so a per-pair ratio cancels load that drifts between reps; its
    # median is the headline, robust to a busy machine where the raw medians are not.
    paired = statistics.median(m / b for m, b in zip(times[mk_name], times[base_name]))
    tokens = args.batch * args.seq
    rows = [[name, f"{medians[name]:.4f}", f"{min(times[name]):.4f}", f"{tokens / medians[name]:,.0f}",
             f"{medians[name] / medians[base_name]:.3f}", f"{min(times[name]) / min(times[base_name]):.3f}"]
            for name in order]
    return [f"## (a) step time, every degree 1 vs plain HF (fp32, {torch.get_num_threads()} threads, "
            f"{args.reps} interleaved reps, batch {args.batch} x seq {args.seq}, loss {first[base_name]:.4f} on both)",
            "", *table(["variant", "median s", "min s", "tokens/s", "median ratio", "min ratio"], rows),
            f"overhead ratio (median of paired ratios) {paired:.3f} (goal <= 1.05): "
            f"{'OK' if paired <= 1.05 else 'ABOVE GOAL'}", ""]


# ----------------------------------------------------------------------------- (b) bytes moved


def theory(config: Any, plan: Any, batch: int, seq: int) -> dict[tuple[str, str], list[tuple[str, float]]]:
    """Minimum bytes per rank for one step of `plan` (one micro-batch of [batch, seq]), by (kind, axis).

    Unit: the collective's full buffer (all-gather output, reduce-scatter input, all-reduce tensor),
    as CommCounter counts. Terms, for a Llama of L blocks, hidden h, vocab V, t = tp:
    - TP with SP: each block all-gathers its attention and MLP inputs and reduce-scatters the o/down
      outputs (2 AG + 2 RS of b*s*h forward, the conjugates backward); the embedding adds one RS
      forward / AG backward, the LM head one AG forward / RS backward: (4L + 2) AG and RS of b*s*h.
      Without SP the same positions are all-reduces: (4L + 2) AR of b*s*h.
    - vocab-parallel loss: all-reduces of max, sum-exp and target logit per token (3 x b*s fp32);
      without it the logits are all-gathered (b*s*V).
    - SP norms: their weights are replicated over tp but see 1/t of the tokens, so each of the
      2L + 1 norm-weight gradients is all-reduced over tp (h values each).
    - FSDP over dp_shard*cp: each unit's (tp-local) parameters all-gathered forward, again backward
      for the blocks (resharded after forward; not the last unit or the root, which backward needs
      first, nor the embedding, whose backward reads only the ids), and the gradients reduce-scattered; HSDP adds an all-reduce of the gradient shard.
    - scalars: loss and valid-token count over dp, one gradient-norm reduction.
    """
    h, layers, vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
    heads, kv, d = attention_dims(config)
    inter = config.intermediate_size
    t = plan.tp
    act = DTYPES[plan.param_dtype].itemsize
    pbytes, rbytes = act, DTYPES[plan.reduce_dtype].itemsize
    bsh = batch * seq * h * act
    out: dict[tuple[str, str], list[tuple[str, float]]] = defaultdict(list)
    if t > 1:
        n = 4 * layers + 2
        if plan.sequence_parallel:
            out[("all_gather", "tp")].append((f"SP: {n} x b*s*h activations", n * bsh))
            out[("reduce_scatter", "tp")].append((f"SP: {n} x b*s*h activations", n * bsh))
            out[("all_reduce", "tp")].append((f"SP norm-weight grads: {2 * layers + 1} x h", (2 * layers + 1) * h * act))
        else:
            out[("all_reduce", "tp")].append((f"TP: {n} x b*s*h activations", n * bsh))
        if plan.loss_parallel:
            out[("all_reduce", "tp")].append(("vocab-parallel loss: 3 x b*s fp32", 3 * batch * seq * 4))
        else:
            out[("all_gather", "tp")].append(("logits: b*s*V", batch * seq * vocab * act))
    fsdp = plan.dp_shard * plan.cp
    if fsdp > 1 or plan.dp_replicate > 1:
        sharded_block = h * heads * d + 2 * h * kv * d + heads * d * h + 3 * h * inter
        embed = vocab * h / t
        block = sharded_block / t + 2 * h
        last = h + vocab * h / t
        total = embed + layers * block + last
        # the embedding's backward reads no weight; the last block stays gathered for backward
        regathered = (layers - 1) * block if plan.fsdp_reshard else 0.0
        if fsdp > 1:
            out[("all_gather", "dp_shard_cp")].append(("FSDP params forward", total * pbytes))
            if regathered:
                out[("all_gather", "dp_shard_cp")].append(("FSDP params backward (resharded units)", regathered * pbytes))
            out[("reduce_scatter", "dp_shard_cp")].append(("FSDP grads", total * rbytes))
        if plan.dp_replicate > 1:
            out[("all_reduce", "dp_replicate")].append(("HSDP grad shards", total / fsdp * rbytes))
    return out


def count_step(spec: dict[str, Any]) -> dict[str, Any] | None:
    """One rank of part (b): parallelize, one warm-up step, one counted step; rank 0 returns the counts."""
    config = llama_config(**spec["model"])
    plan = meshkit.Plan.from_string(spec["plan"])
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    pm = meshkit.parallelize(model, plan)
    pm.init_weights(0)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(100 + pm.dp_rank)
    ids = torch.randint(0, config.vocab_size, (spec["batch"], spec["seq"]), generator=gen)

    def step() -> None:
        """One whole training step as the recipe runs it (count, forward/backward, clip, AdamW), so every collective counts."""
        denominator = pm.count_valid_tokens(ids)
        pm.forward_backward(ids, ids, loss_denominator=denominator)
        pm.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # lazy initialisation (FSDP, optimizer state) is not per-step traffic
    with CommCounter(pm.mesh) as counter:
        step()
    return {"events": counter.events, "sizes": counter.sizes} if pm.mesh.get_rank() == 0 else None


def bytes_vs_theory(args: argparse.Namespace) -> list[str]:
    """Part (b): one counted training step on 4 ranks against the plan's minimum; the report lines."""
    world = 4
    spec = {
        "model": dict(hidden=args.b_hidden, layers=args.b_layers, heads=4, kv_heads=2, inter=args.b_hidden * 3,
                      vocab=256, seq=args.b_seq),
        "plan": args.b_plan, "batch": args.b_batch, "seq": args.b_seq,
    }
    plan = meshkit.Plan.from_string(spec["plan"]).resolve(world)
    counted = run_ranks(count_step, world, spec)[0]
    measured: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    scalars, excess = [0, 0], []
    for kind, axis, nbytes in counted["events"]:  # FSDP's traffic is labelled dp_shard_cp under every plan
        if kind == "all_reduce" and nbytes <= SMALL:
            scalars[0] += 1
            scalars[1] += nbytes
            continue
        measured[(kind, axis)][0] += 1
        measured[(kind, axis)][1] += nbytes
    expected = theory(llama_config(**spec["model"]), plan, args.b_batch, args.b_seq)
    sizes = counted["sizes"]
    rows, totals = [], [0, 0.0, 0.0, 0.0]  # measured, theory, wire, theory wire
    for key in sorted(set(measured) | set(expected)):
        kind, axis = key
        count, got = measured.get(key, [0, 0])
        want = sum(v for _, v in expected.get(key, []))
        n = sizes.get(axis, getattr(plan, axis, 1) if axis != "dp_shard_cp" else plan.dp_shard * plan.cp)
        factor = {"all_reduce": 2 * (n - 1) / n}.get(kind, (n - 1) / n)  # ring algorithms
        terms = "; ".join(f"{label} {v:,.0f}" for label, v in expected.get(key, [])) or "(none expected)"
        rows.append([kind, axis, count, f"{got:,}", f"{want:,.0f}", f"{got / want:.2f}" if want else "inf",
                     f"{got * factor:,.0f}", terms])
        totals = [totals[0] + got, totals[1] + want, totals[2] + got * factor, totals[3] + want * factor]
        if got > 1.05 * want:
            excess.append(f"excess: {kind} over {axis} moves {got - want:,.0f} B more than the minimum ({count} calls)")
    rows.append(["total (no scalars)", "", "", f"{totals[0]:,}", f"{totals[1]:,.0f}", f"{totals[0] / totals[1]:.2f}",
                 f"{totals[2]:,.0f}", f"theory wire {totals[3]:,.0f} B/rank (ratio {totals[2] / totals[3]:.2f})"])
    return [f"## (b) bytes per rank for one training step: plan {plan.describe()} on {world} gloo ranks, "
            f"Llama h={args.b_hidden} L={args.b_layers}, batch {args.b_batch} x seq {args.b_seq} per dp rank, "
            f"{plan.param_dtype} params / {plan.reduce_dtype} grads", "",
            *table(["collective", "axis", "calls", "measured B", "theory B", "ratio", "wire B/rank", "theory terms"],
                   rows), *excess,
            f"scalar all-reduces (<= {SMALL} B, latency-bound): {scalars[0]} calls, {scalars[1]} B; minimum 3 (loss, "
            "valid-token count, gradient norm); the rest are input checks and per-mesh norm parts", ""]


def main(argv: list[str] | None = None) -> int:
    """(a) the step-time overhead against plain HF and (b) the bytes against the theory, printed and written with --out."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("both", "time", "bytes"), default="both")
    group = parser.add_argument_group("(a) step time")
    group.add_argument("--hidden", type=int, default=256)
    group.add_argument("--layers", type=int, default=4)
    group.add_argument("--heads", type=int, default=8)
    group.add_argument("--kv-heads", type=int, default=4)
    group.add_argument("--inter", type=int, default=768)
    group.add_argument("--vocab", type=int, default=4096)
    group.add_argument("--seq", type=int, default=256)
    group.add_argument("--batch", type=int, default=4)
    group.add_argument("--reps", type=int, default=15)
    group.add_argument("--warmup", type=int, default=2)
    group = parser.add_argument_group("(b) bytes")
    group.add_argument("--b-plan", default="tp=2,dp_shard=2")
    group.add_argument("--b-hidden", type=int, default=64)
    group.add_argument("--b-layers", type=int, default=2)
    group.add_argument("--b-seq", type=int, default=64)
    group.add_argument("--b-batch", type=int, default=4)
    parser.add_argument("--out", help="also write the markdown here")
    args = parser.parse_args(argv)
    lines = ["# meshkit overhead benchmark", "", machine_line(), ""]
    if args.part in ("both", "time"):
        lines += time_overhead(args)
    if args.part in ("both", "bytes"):
        lines += bytes_vs_theory(args)
    emit(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
