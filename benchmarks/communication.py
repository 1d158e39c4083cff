"""Bytes per training step on every axis, next to the scheme's minimum AND the cheapest alternative
(`python -m benchmarks.communication [--out benchmarks/results/communication.md]`).

Counted by `CommCounter` on 2 gloo ranks, one `forward_backward` of the same model and inputs per
plan, as wire bytes one rank sends (ring algorithms: (n-1)/n of an all-gather / reduce-scatter /
all-to-all buffer, a P2P message whole). Each row: the measured bytes, the scheme's own minimum
(closed form below), their ratio, and the ratio to the cheapest scheme that computes the same thing:

- CP (cp=2): ring, zig-zag (each also with `cp_keep_kv=true`), all-gather K/V, Ulysses, in fp32 and in bf16 with fp32 gradient
  reduction. Minimum per layer, b = one rank's [K; V] shard in the compute dtype, g the same in the
  reduce dtype: ring (cp-1)(2b + g) (K/V forward and backward, dK/dV back to the owner); all-gather
  (cp-1)(b + g), and the ring kinds keeping K/V the same; Ulysses (cp-1)/cp of q, k, v, out forward and their gradients backward.
- FSDP (dp_shard=2): meshkit's units against a hand-written `fully_shard` layout (embedding, each
  block, [norm, head] kept gathered, root). Minimum: every parameter gathered once, the blocks that
  were resharded gathered again for backward (not the embedding: its backward reads only the ids),
  every gradient reduce-scattered once.
- TP (tp=2): with and without sequence parallelism. Minimum: Megatron's two reductions of the
  [tokens, hidden] activations per block in each direction (all-reduce, or all-gather + reduce-scatter
  under SP), plus the embedding and LM-head boundaries.

Bytes only: step times on this shared 2-core machine (load average in the header) are not measured
here.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib
import torch
import torch.distributed as dist

from benchmarks.launch import handwritten_fsdp, meshkit_model, run_ranks, seeded_llama
from benchmarks.report import emit, machine_line, table
from meshkit.comm_counter import CommCounter

matplotlib.use("Agg")  # headless
import matplotlib.pyplot as plt  # noqa: E402

MODEL = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=1024, use_cache=False)
BATCH, SEQ = 1, 512
CP_KINDS = ("ring", "zigzag", "ring_keep", "zigzag_keep", "allgather", "ulysses")  # _keep: cp_keep_kv=true
KEPT = "<!-- kept across runs -->"  # text after this line in --out is carried over (hand-written sections)
FACTOR = {"all_gather": 0.5, "reduce_scatter": 0.5, "all_to_all": 0.5, "all_reduce": 1.0, "send": 1.0}  # n=2


def _wire(counter: CommCounter) -> dict[str, float]:
    """Wire bytes this rank sent per collective kind (scalars of the loss left out)."""
    out: dict[str, float] = {}
    for kind, _, nbytes in counter.events:
        if nbytes > 8 and kind in FACTOR:
            out[kind] = out.get(kind, 0.0) + nbytes * FACTOR[kind]
    return out


def _meshkit_bytes(plan: str) -> dict[str, float]:
    """Wire bytes of one meshkit step under `plan` (the same model and ids for every plan, so rows compare)."""
    pm = meshkit_model(MODEL, plan)
    ids = torch.randint(0, MODEL["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    with CommCounter(pm.mesh) as counter:
        pm.forward_backward(ids, ids)
    return _wire(counter)


def _handwritten_fsdp_bytes() -> dict[str, float]:
    """Wire bytes of the hand-written FSDP2 layout's step: the peer row of the FSDP table."""
    model, mesh = handwritten_fsdp(seeded_llama(MODEL))
    ids = torch.randint(0, MODEL["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(dist.get_rank()))
    with CommCounter(mesh) as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    return _wire(counter)


def _all_on_rank(plans: dict[str, str]) -> dict[str, dict[str, float]]:
    """Every plan and the peer on one pool of ranks, so the whole table comes from one run."""
    out = {key: _meshkit_bytes(plan) for key, plan in plans.items()}
    out["fsdp/hand-written fully_shard"] = _handwritten_fsdp_bytes()
    return out


def _cp_minimum(kind: str, act: int, red: int) -> float:
    """The fewest bytes a rank must send for CP `kind` at cp=2 (K/V and dK/dV blocks), the floor a kind is compared with."""
    L, cp, S_l = MODEL["num_hidden_layers"], 2, SEQ // 2
    kv, heads, d = MODEL["num_key_value_heads"], MODEL["num_attention_heads"], MODEL["head_dim"]
    block = 2 * BATCH * kv * S_l * d  # one rank's [K; V] elements
    if kind in ("ring", "zigzag"):
        return L * (cp - 1) * (2 * block * act + block * red)
    if kind in ("allgather", "ring_keep", "zigzag_keep"):  # K/V once forward, dK/dV once backward
        return L * (cp - 1) * (block * act + block * red)
    q = BATCH * heads * S_l * d
    return L * (cp - 1) / cp * 2 * (2 * q + block) * act  # q, k, v and out, forward and backward


def _params() -> tuple[int, int]:
    """(all parameters, the decoder blocks') element counts."""
    m = seeded_llama(MODEL)
    return sum(p.numel() for p in m.parameters()), sum(p.numel() for p in m.model.layers.parameters())


def _fsdp_minimum() -> float:
    """The fewest bytes FSDP's units must move per rank: forward gathers, backward re-gathers of the resharded blocks, one reduce-scatter."""
    total, blocks = _params()
    # fwd gathers everything, bwd re-gathers the blocks but the last ([norm, head] and the block before
    # it are needed first by backward, the embedding's backward reads no weight), every gradient
    # reduce-scattered once; fp32, (n-1)/n = 1/2
    regathered = blocks * (MODEL["num_hidden_layers"] - 1) / MODEL["num_hidden_layers"]
    return 0.5 * 4 * (total + regathered + total)


def _tp_minimum(sp: bool) -> float:
    """The fewest bytes TP must move per rank: the activation reductions of each block plus embedding and LM head, with or without SP."""
    L, h = MODEL["num_hidden_layers"], MODEL["hidden_size"]
    act = BATCH * SEQ * h * 4
    # per block 2 reductions forward, 2 backward; + embedding output and LM-head input gradient
    per = act * (0.5 + 0.5 if sp else 1.0)  # AG + RS of (n-1)/n each, or one all-reduce of 2(n-1)/n
    return (4 * L + 2) * per


def main(argv: list[str] | None = None) -> int:
    """Count every plan's bytes on 2 ranks, print them against the minimum and the peer, write with --out."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="also write the markdown here")
    args = parser.parse_args(argv)
    dtypes = {"fp32": "param_dtype=float32", "bf16 (fp32 grads)": "param_dtype=bfloat16,reduce_dtype=float32"}
    plans = {f"cp/{k}/{d}": f"cp=2,cp_attention={k.removesuffix('_keep')},{text}"
             + (f",cp_keep_kv={str(k.endswith('_keep')).lower()}" if k.startswith(("ring", "zigzag")) else "")
             for k in CP_KINDS for d, text in dtypes.items()}
    plans["fsdp/meshkit"] = "dp_shard=2"
    plans["tp/TP+SP"] = "tp=2"
    plans["tp/TP"] = "tp=2,sequence_parallel=false"
    measured = run_ranks(_all_on_rank, 2, plans)[0]

    # FSDP runs over the cp ranks too (they hold the same weights): the cp axis's bytes are the plan's
    # minus what FSDP moves, measured on the ring plan of the same dtype (the ring gathers nothing).
    def cp_bytes(key: str) -> float:
        """A CP kind's own bytes: the plan's FSDP traffic (the ring row's gathers and scatters) taken out."""
        m, ring = measured[key], measured["cp/ring/" + key.split("/", 2)[2]]
        fsdp_part = ring.get("all_gather", 0) + ring.get("reduce_scatter", 0)
        return m.get("send", 0) + m.get("all_to_all", 0) + m.get("all_gather", 0) + m.get("reduce_scatter", 0) - fsdp_part

    lines = ["# Communication per training step: measured, the scheme's minimum, the cheapest scheme", "",
             machine_line(), f"- model: {MODEL['num_hidden_layers']} Llama blocks, hidden {MODEL['hidden_size']}, "
             f"{MODEL['num_attention_heads']} q / {MODEL['num_key_value_heads']} kv heads, vocab {MODEL['vocab_size']}; "
             f"batch {BATCH} x {SEQ} tokens; 2 gloo ranks; wire bytes one rank sends", ""]
    charted: dict[str, tuple[float, float]] = {}
    for d in dtypes:
        act, red = (4, 4) if d == "fp32" else (2, 4)
        rows, got = [], {k: cp_bytes(f"cp/{k}/{d}") for k in CP_KINDS}
        cheapest = min(got, key=got.get)
        for k in CP_KINDS:
            mini = _cp_minimum(k, act, red)
            charted[f"cp {k} {d.split()[0]}"] = (got[k] / mini, got[k] / got[cheapest])
            rows.append([k, f"{got[k]:,.0f}", f"{mini:,.0f}", f"{got[k] / mini:.2f}", cheapest,
                         f"{got[k] / got[cheapest]:.2f}"])
        lines += [f"## CP, cp=2, {d}", ""] + table(
            ["kind", "measured B", "scheme minimum B", "measured / minimum", "cheapest kind", "/ cheapest"], rows)
    fsdp = {k: sum(measured[k].get(c, 0) for c in ("all_gather", "reduce_scatter"))
            for k in ("fsdp/meshkit", "fsdp/hand-written fully_shard")}
    mini, best = _fsdp_minimum(), min(fsdp.values())
    charted.update({f"FSDP {k.split('/')[1].split()[0]}": (v / mini, v / best) for k, v in fsdp.items()})
    lines += ["## FSDP, dp_shard=2 (all-gather + reduce-scatter)", ""] + table(
        ["layout", "measured B", "minimum B", "measured / minimum", "/ cheapest"],
        [[k.split("/")[1], f"{v:,.0f}", f"{mini:,.0f}", f"{v / mini:.2f}", f"{v / best:.2f}"] for k, v in fsdp.items()])
    tp = {k: sum(v for c, v in measured[k].items() if c != "send") for k in ("tp/TP+SP", "tp/TP")}
    best = min(tp.values())
    charted.update({k.split("/")[1]: (v / _tp_minimum(k.endswith("SP")), v / best) for k, v in tp.items()})
    lines += ["## TP, tp=2 (activation-sized collectives)", ""] + table(
        ["layout", "measured B", "minimum B", "measured / minimum", "/ cheapest"],
        [[k.split("/")[1], f"{v:,.0f}", f"{_tp_minimum(k.endswith('SP')):,.0f}",
          f"{v / _tp_minimum(k.endswith('SP')):.2f}", f"{v / best:.2f}"] for k, v in tp.items()])
    if args.out and Path(args.out).exists() and KEPT in Path(args.out).read_text():
        lines += ["", KEPT + Path(args.out).read_text().split(KEPT, 1)[1].rstrip("\n")]
    emit(lines, args.out)
    if args.out:
        _chart(Path(args.out).with_name("communication_bytes.png"), charted)
    return 0


def _chart(path: Path, bars: dict[str, tuple[float, float]]) -> None:
    """Bytes per step of each scheme, as a multiple of its own minimum and of the cheapest scheme."""
    fig, ax = plt.subplots(figsize=(9, 3.6))
    names = list(bars)
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], [bars[n][0] for n in names], 0.4, label="measured / scheme's minimum")
    ax.bar([i + 0.2 for i in x], [bars[n][1] for n in names], 0.4, label="measured / cheapest scheme")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(list(x), names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("ratio")
    ax.set_title("Bytes per training step, 2 ranks (benchmarks.communication)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
