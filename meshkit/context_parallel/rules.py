"""The rules a Plan's context-parallel options must satisfy, among themselves and against a model's heads,
and the kind a plan gets when it leaves the choice open (`cp_attention="auto"`, `cp_keep_kv` unset).

Pure functions: the violations return every problem with its fix, as `Plan.validate` collects them.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from meshkit.plan import Plan


def cp_problems(plan: Plan) -> list[str]:
    """Context-parallel options that contradict each other (the Ulysses x outer split of cp)."""
    problems = []
    if plan.cp_attention == "usp":
        if plan.cp > 1 and (plan.cp_ulysses < 2 or plan.cp_ulysses >= plan.cp or plan.cp % plan.cp_ulysses):
            divisors = [d for d in range(2, plan.cp) if plan.cp % d == 0]
            problems.append(
                f"cp_ulysses={plan.cp_ulysses}: USP runs Ulysses over cp_ulysses ranks and a ring over "
                f"cp/cp_ulysses, so cp_ulysses must be a proper divisor of cp={plan.cp} above 1; fix: use one of "
                f"{divisors or 'none (use cp_attention=ulysses or zigzag)'}"
            )
    elif plan.cp_attention == "allgather":
        # Ulysses inside, the K/V all-gather over the cp/cp_ulysses outer ranks; 1 = no Ulysses.
        if plan.cp > 1 and (plan.cp_ulysses >= plan.cp or plan.cp % plan.cp_ulysses):
            divisors = [d for d in range(1, plan.cp) if plan.cp % d == 0]
            problems.append(
                f"cp_ulysses={plan.cp_ulysses}: cp_attention='allgather' runs Ulysses over cp_ulysses ranks and "
                f"gathers K/V over cp/cp_ulysses, so cp_ulysses must be a divisor of cp={plan.cp} below it; fix: "
                f"use one of {divisors}"
            )
    elif plan.cp_ulysses != 1:
        problems.append(
            f"cp_ulysses={plan.cp_ulysses}: only cp_attention='usp' or 'allgather' splits cp into Ulysses x "
            f"ring; fix: set cp_ulysses=1, or cp_attention='usp' or 'allgather'"
        )
    if plan.cp_keep_kv is True and plan.cp_attention not in ("ring", "zigzag"):
        problems.append(
            f"cp_keep_kv=true with cp_attention={plan.cp_attention!r}: only the ring kinds send K/V again in "
            f"backward (the all-gather kind keeps what it gathered, Ulysses moves heads); fix: "
            f"cp_attention='ring' or 'zigzag', or cp_keep_kv=false"
        )
    return problems


def head_problems(plan: Plan, config: Any) -> list[str]:
    """Whether Ulysses (alone, in USP or inside the all-gather kind) can spread each tp rank's query heads."""
    problems: list[str] = []
    heads, tp = config.num_attention_heads, plan.tp
    degree = plan.ulysses_degree
    if plan.cp > 1 and degree > 1 and (heads // tp) % degree:
        problems.append(
            f"cp_attention={plan.cp_attention!r}: Ulysses spreads the {heads // tp} query heads each tp rank holds "
            f"over {degree} ranks, and {degree} does not divide them; fix: use cp_attention='zigzag' or 'ring', or "
            f"a Ulysses degree that divides {heads // tp}"
        )
    return problems


# Kept K/V may add at most this share to a block's saved activations (AC none) before the ring stops
# keeping them by default: (cp-1) [K; V] shards per layer against Korthikanti's per-token bytes.
KEEP_KV_MAX_SHARE = 0.25
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class AttentionShape(NamedTuple):
    """What context parallelism moves, whole-model counts: hidden size, query heads, K/V heads, head dim
    (`models.roles.kernel_dims`: MLA's heads each carry their own K and V)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int


class CpChoice(NamedTuple):
    """The context-parallel kind and keep-K/V a plan runs with, and why (for the plan summary; empty
    when the user set both)."""

    kind: str
    keep_kv: bool
    why: str


def cp_bytes_per_token(kind: str, keep_kv: bool, *, cp: int, heads: int, kv_heads: int, head_dim: int,
                       act: int, red: int, recompute: bool = False) -> float:
    """Bytes one rank sends per local token and layer for a CP kind over `cp` ranks (tp-local head
    counts, `act`/`red` the compute and reduce dtype sizes; `recompute`: activation checkpointing runs
    forward's exchanges again): the closed forms of docs/context_parallel.md and the estimator's."""
    kv, rec = 2 * kv_heads * head_dim, int(recompute)  # one token's [K; V]
    if kind == "ulysses":
        rep = cp // math.gcd(kv_heads, cp) if kv_heads % cp else 1
        return (cp - 1) / cp * (2 + rec) * (2 * heads * head_dim + kv * rep) * act  # q, k, v, out, grads
    if kind == "allgather" or keep_kv:
        return (cp - 1) * kv * ((1 + rec) * act + red)  # K/V once forward, dK/dV once backward
    return (cp - 1) * (2 + rec) * kv * act + cp * kv * red  # K/V again in backward, dK/dV a full turn


def kept_kv_share(plan: Plan, shape: AttentionShape) -> float:
    """The (cp-1) [K; V] shards per layer a kept-K/V ring holds from forward to backward, as a share of
    the block's saved activations per token by Korthikanti's closed form (34h bytes, /tp under SP,
    h(10 + 24/tp) without: a plan cannot run the estimator's traced count); 0
    under activation checkpointing, which saves none of them."""
    if plan.activation_checkpointing != "none":
        return 0.0
    tp, h = plan.tp, shape.hidden
    saved = 34 * h / tp if plan.sequence_parallel or tp == 1 else h * (10 + 24 / tp)  # at 2-byte activations
    kv_heads = max(shape.kv_heads // tp, 1)
    return (plan.cp - 1) * 2 * kv_heads * shape.head_dim * 2 / saved


def choose_cp(plan: Plan, shape: AttentionShape | None) -> CpChoice:
    """The kind and keep-K/V for a plan that left them open: the byte minimum the memory allows.

    Per local token and layer (without recompute: `cp_bytes_per_token`) the zig-zag ring keeping K/V
    and the all-gather kind send (cp-1)·[K; V]·(act + red) bytes, the plain ring
    (cp-1)·2·[K; V]·act + cp·[K; V]·red, Ulysses (cp-1)/cp·2·(2·q + [K; V]·replication)·act: with GQA the ring kinds move fewer bytes, with as many
    K/V heads as query heads Ulysses does once cp > 2 (it needs the tp-local query heads to split
    over cp). Keeping K/V holds (cp-1) more [K; V] shards per layer from forward to backward, nothing
    under activation checkpointing; they are kept unless that exceeds KEEP_KV_MAX_SHARE of the block's
    saved activations. Between the two byte-equal kinds the zig-zag ring is taken: its transfers
    overlap each step's compute and it never holds the whole sequence's K/V during forward. Without a
    model shape the zig-zag ring keeping K/V. What the user set is kept as given.
    """
    auto_kind, auto_keep = plan.cp_attention == "auto", plan.cp_keep_kv is None
    kind = plan.cp_attention
    if not auto_kind and kind not in ("ring", "zigzag"):
        return CpChoice(kind, bool(plan.cp_keep_kv), "")  # nothing left to choose
    if auto_kind and plan.cp_ulysses > 1:
        return CpChoice("usp", False, f"cp_ulysses={plan.cp_ulysses} asks for a Ulysses x ring split")
    if auto_kind and plan.cp_keep_kv:  # only the ring kinds keep K/V
        auto_kind, kind = False, "zigzag"
    if shape is None:
        return CpChoice("zigzag" if auto_kind else kind, True if auto_keep else plan.cp_keep_kv,
                        "no model to weigh: the kept-K/V ring's bytes")
    tp = plan.tp
    heads, kv_heads = shape.heads // tp, max(shape.kv_heads // tp, 1)
    dims = dict(cp=plan.cp, heads=heads, kv_heads=kv_heads, head_dim=shape.head_dim,
                act=_BYTES.get(plan.param_dtype, 4), red=_BYTES.get(plan.reduce_dtype, 4),
                recompute=plan.activation_checkpointing != "none")
    share = kept_kv_share(plan, shape)
    keep = share <= KEEP_KV_MAX_SHARE if auto_keep else plan.cp_keep_kv
    if not auto_keep:
        memory = "K/V kept as set" if keep else "K/V not kept, as set"
    elif keep:
        memory = f"K/V kept (+{share:.0%} of saved activations)"
    else:
        memory = f"K/V not kept (+{share:.0%} of saved activations is over {KEEP_KV_MAX_SHARE:.0%})"
    if not auto_kind:
        return CpChoice(kind, keep, memory)
    ring = cp_bytes_per_token("zigzag", keep, **dims)
    if heads % plan.cp == 0 and cp_bytes_per_token("ulysses", False, **dims) < ring:
        return CpChoice("ulysses", False, f"{heads}:{kv_heads} q:kv heads per tp rank at cp={plan.cp}: "
                                          "fewer bytes than the ring's")
    return CpChoice("zigzag", keep, f"{heads}:{kv_heads} q:kv heads per tp rank at cp={plan.cp}: the ring's "
                                    f"bytes; {memory}")
