"""What one gloo rank of the context-parallel benchmark measures on the attention op itself.

Every kind meshkit runs (ring, zig-zag, Ulysses, USP) and the all-gather baseline, on this rank's
shard of one causal attention call: collectives and kernels (`count_section`), torch's experimental
CP (`torch_cp_probe_section`), interleaved timings and memory. `hf_ranks.run` is the entry each rank
runs; what a rank observes is recorded by `recording.Recorder`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from benchmarks.context_parallel.recording import (
    Recorder,
    SavedBytes,
    peak_rss_since,
    reset_peak_rss,
)
from meshkit._compat.peers import torch_context_parallel
from meshkit.context_parallel import (
    attention_block,
    ring_attention,
    shard,
    ulysses_attention,
    unshard,
    usp_attention,
    usp_group_ranks,
)

Tensor = torch.Tensor
Attention = Callable[[Tensor, Tensor, Tensor], Tensor]


# ------------------------------------------------------------------------------- variants


@dataclass(frozen=True)
class Shape:
    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    seq: int


@dataclass
class Variant:
    """One way to run causal attention on a cp group: how inputs are sharded and the call itself."""

    name: str
    layout: str
    ulysses: int
    fn: Attention


def usp_name(ulysses: int) -> str:
    """The row label of USP, shared with the parent's tables."""
    return f"usp (u={ulysses})"


class Groups:
    """Process groups of one world: the whole cp group and, for USP, this rank's inner/outer groups."""

    def __init__(self, ulysses: int) -> None:
        self.world = dist.group.WORLD
        self.size = dist.get_world_size()
        self.rank = dist.get_rank()
        self.ulysses = ulysses
        self.inner = self.outer = None
        if ulysses > 1:
            inner, outer = usp_group_ranks(list(range(self.size)), ulysses)
            for ranks in inner + outer:  # every rank creates every group, in the same order
                pg = dist.new_group(ranks)
                if self.rank in ranks:
                    if ranks in inner:
                        self.inner = pg
                    else:
                        self.outer = pg

    def sizes(self) -> dict[str, int]:
        """Group sizes by name, for turning the counter's per-group bytes into bytes on the wire."""
        groups = [g for g in (self.world, self.inner, self.outer) if g is not None]
        return {g.group_name: dist.get_world_size(g) for g in groups}


class _GatherSeq(torch.autograd.Function):
    """All-gather along the sequence (dim 2 of [2, B, H, S, D]); backward reduce-scatters the gradient."""

    @staticmethod
    def forward(ctx, kv: Tensor, group: dist.ProcessGroup) -> Tensor:
        """Gather K/V along the sequence from every rank (the all-gather CP kind's forward)."""
        ctx.group = group
        n = dist.get_world_size(group)
        local = kv.permute(3, 0, 1, 2, 4).contiguous()  # sequence first: all_gather_into_tensor concatenates dim 0
        full = local.new_empty((n * local.shape[0], *local.shape[1:]))
        dist.all_gather_into_tensor(full, local, group=group)
        return full.permute(1, 2, 3, 0, 4)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        """Reduce-scatter the K/V gradients back to their owners: the conjugate of the forward gather."""
        n = dist.get_world_size(ctx.group)
        full = grad.permute(3, 0, 1, 2, 4).contiguous()
        local = full.new_empty((full.shape[0] // n, *full.shape[1:]))
        dist.reduce_scatter_tensor(local, full, group=ctx.group)
        return local.permute(1, 2, 3, 0, 4), None


def allgather_attention(q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup,
                        scale: float | None = None) -> Tensor:
    """The simplest correct CP: gather the whole K/V, attend the local queries causally.

    Contiguous layout: local query i sits at global position rank*S_local + i and sees keys <= it.
    Like the ring it sends K and V in one buffer and never repeats GQA heads.
    """
    kv = _GatherSeq.apply(torch.stack([k, v]), group)
    S_local, S = q.shape[2], kv.shape[3]
    offset = dist.get_rank(group) * S_local
    keep = torch.arange(S, device=q.device)[None, :] <= torch.arange(S_local, device=q.device)[:, None] + offset
    return F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=keep, scale=scale,
                                          enable_gqa=kv.shape[2] != q.shape[1])


def variants(groups: Groups, heads: int) -> list[Variant]:
    """Every meshkit kind this world can run (USP needs cp >= 4), plus the all-gather baseline."""
    w = groups.world
    out = [
        Variant("ring", "contiguous", 1, lambda q, k, v: ring_attention(q, k, v, w, layout="contiguous")),
        Variant("zigzag", "zigzag", 1, lambda q, k, v: ring_attention(q, k, v, w, layout="zigzag")),
    ]
    if heads % groups.size == 0:
        out.append(Variant("ulysses", "contiguous", 1, lambda q, k, v: ulysses_attention(q, k, v, w)))
    if groups.inner is not None:
        inner, outer = groups.inner, groups.outer
        out.append(Variant(usp_name(groups.ulysses), "zigzag", groups.ulysses,
                           lambda q, k, v: usp_attention(q, k, v, inner, outer, layout="zigzag")))
    out.append(Variant("all-gather KV", "contiguous", 1, lambda q, k, v: allgather_attention(q, k, v, w)))
    return out


def full_inputs(shape: Shape, dtype: torch.dtype, seed: int = 0) -> list[Tensor]:
    """q, k, v, dout of the whole sequence, identical on every rank (same generator)."""
    g = torch.Generator().manual_seed(seed)
    B, H, Hkv, S, D = shape.batch, shape.heads, shape.kv_heads, shape.seq, shape.head_dim
    shapes = [(B, H, S, D), (B, Hkv, S, D), (B, Hkv, S, D), (B, H, S, D)]
    return [torch.randn(s, generator=g).to(dtype) for s in shapes]


def local_inputs(shape: Shape, dtype: torch.dtype, variant: Variant) -> list[Tensor]:
    """This rank's shards of q, k, v (leaves requiring grad) and of dout."""
    rank, P = dist.get_rank(), dist.get_world_size()
    parts = [shard(t, variant.layout, P, rank, dim=2, ulysses=variant.ulysses) for t in full_inputs(shape, dtype)]
    return [t.requires_grad_() for t in parts[:3]] + [parts[3]]


def fwd_bwd(fn: Attention, q: Tensor, k: Tensor, v: Tensor, dout: Tensor) -> Tensor:
    """One forward and backward of an attention function, gradients dropped so repetitions do not accumulate."""
    out = fn(q, k, v)
    out.backward(dout)
    q.grad = k.grad = v.grad = None
    return out.detach()


# ------------------------------------------------------------------ torch experimental CP


def torch_cp_attention(mesh: Any, causal_full: list[Tensor], gqa: bool) -> Tensor:
    """One fwd+bwd of torch's experimental CP (all-to-all ring rotation) on the full-sequence inputs,
    which the context manager shards itself (head-tail load balancing)."""
    context_parallel, set_rotate_method = torch_context_parallel()
    set_rotate_method("alltoall")
    bufs = [t.detach().clone() for t in causal_full]
    with context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2, 2, 2, 2], no_restore_buffers=set(bufs)):
        q, k, v = (b.detach().requires_grad_() for b in bufs[:3])
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        out.backward(bufs[3])
    return out.detach()


def first_line(e: BaseException) -> str:
    """An exception as one table cell (a kind that fails is reported, not fatal)."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def probe(fn: Callable[[], Any]) -> str | None:
    """None if `fn` runs on every rank, else the first rank's exception (ranks agree on the outcome)."""
    try:
        fn()
        reason = None
    except Exception as e:  # noqa: BLE001 - the point is to report whatever torch refuses with
        reason = first_line(e)
    reasons: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(reasons, reason)
    return next((r for r in reasons if r is not None), None)


def cp_mesh() -> Any:
    """A 1D mesh of the whole world named "cp" (what torch's experimental CP takes)."""
    return init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))


# ------------------------------------------------------------------------------- sections


def count_section(spec: dict, groups: Groups) -> dict[str, Any]:
    """Per kind and dtype: one recorded forward and backward (bytes, calls, kernels) on every rank."""
    shape = Shape(**spec["shape"])
    result: dict[str, Any] = {}
    for dtype_name in spec["dtypes"]:
        dtype = getattr(torch, dtype_name)
        for var in variants(groups, shape.heads):
            q, k, v, dout = local_inputs(shape, dtype, var)
            rec = Recorder(groups.sizes(), shape.head_dim)
            with rec:
                out = var.fn(q, k, v)
                rec.switch("bwd")
                out.backward(dout)
            result[f"{var.name}|{dtype_name}"] = rec.summary()
    return result


def torch_cp_probe_section(spec: dict, groups: Groups) -> dict[str, Any]:
    """Whether torch's experimental CP runs here, and if so what it sends (recorded like ours)."""
    shape = Shape(**spec["shape"])
    mesh = cp_mesh()
    inputs = full_inputs(shape, torch.float32)
    rec = Recorder(groups.sizes() | {mesh.get_group().group_name: groups.size}, shape.head_dim)

    def run() -> None:
        """torch's own context parallel on the same inputs, recorded like meshkit's kinds for the byte comparison."""
        with rec:
            torch_cp_attention(mesh, inputs, shape.kv_heads != shape.heads)

    reason = probe(run)
    return {"reason": reason, "record": rec.summary() if reason is None else None}


def timed(fn: Callable[[], Any], active: bool) -> list[float]:
    """[wall s, CPU s of this process] of fn after a barrier; [] on ranks that sit this one out."""
    dist.barrier()
    if not active:
        return []
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    return [time.perf_counter() - t0, time.process_time() - c0]


def interleave(runs: dict[str, tuple[Callable[[], Any], bool]], reps: int, warmup: int) -> dict[str, list]:
    """Run every variant `reps` times, rotating the order each repetition so that machine load
    drifting over the run hits every variant alike; returns this rank's [wall, cpu] per rep."""
    names = list(runs)
    for _ in range(warmup):
        for name in names:
            timed(runs[name][0], runs[name][1])
    times: dict[str, list] = {n: [] for n in names}
    for rep in range(reps):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(timed(runs[name][0], runs[name][1]))
    return times


def attention_time_section(spec: dict, groups: Groups, torch_cp_ok: bool) -> dict[str, Any]:
    """fwd+bwd of the attention op: every kind, the all-gather baseline, torch CP where it runs, and
    single-process full attention on rank 0 (the others wait in a barrier)."""
    shape = Shape(**spec["shape"])
    rank = groups.rank
    gqa = shape.kv_heads != shape.heads

    def full_sdpa(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Causal attention over the whole sequence in one process: the reference each kind is checked against, and a timed row."""
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

    runs: dict[str, tuple[Callable[[], Any], bool]] = {}
    check: dict[str, float] = {}
    full = full_inputs(shape, torch.float32)
    q0, k0, v0, d0 = (t.clone().requires_grad_() if i < 3 else t for i, t in enumerate(full))
    reference = fwd_bwd(full_sdpa, q0, k0, v0, d0)
    for var in variants(groups, shape.heads):
        args = local_inputs(shape, torch.float32, var)
        out = fwd_bwd(var.fn, *args)
        check[var.name] = _max_error(out, reference, var)
        runs[var.name] = ((lambda fn=var.fn, a=args: fwd_bwd(fn, *a)), True)
    if torch_cp_ok:
        mesh = cp_mesh()
        runs["torch CP (alltoall ring)"] = ((lambda: torch_cp_attention(mesh, full, gqa)), True)
    runs["single process (full SDPA)"] = ((lambda: fwd_bwd(full_sdpa, q0, k0, v0, d0)), rank == 0)
    times = interleave(runs, spec["reps"], spec["warmup"])
    return {"times": times, "max_error": check}


def _max_error(out_local: Tensor, reference: Tensor, var: Variant) -> float:
    """Largest |out - single-process out| after reassembling every rank's output shard."""
    parts = [torch.empty_like(out_local) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, out_local.contiguous())
    full = unshard(parts, var.layout, dim=2, ulysses=var.ulysses)
    return float((full - reference).abs().max())


# -------------------------------------------------------------------------------- memory


def measure_memory(fn: Attention, q: Tensor, k: Tensor, v: Tensor, dout: Tensor, head_dim: int,
                   sizes: dict[str, int]) -> dict[str, Any]:
    """Saved-for-backward bytes, the longest sequence run of any [.., S, D] tensor that existed, and
    the peak RSS increase over one fwd+bwd."""
    saved = SavedBytes()
    rec = Recorder(sizes, head_dim)
    base = reset_peak_rss()
    with rec, torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        out = fn(q, k, v)
    saved_bytes = saved.total
    fwd_peak = peak_rss_since(base)
    reset_peak_rss()
    with rec:
        out.backward(dout)
    return {"saved": saved_bytes, "extent": rec.max_extent, "peak_fwd": fwd_peak, "peak_bwd": peak_rss_since(base)}


def memory_section(spec: dict, groups: Groups) -> dict[str, Any]:
    """For each sequence length: every kind on every rank, then cp=1 on rank 0 alone (the local op
    meshkit's ring runs per block, here over the whole sequence)."""
    base = Shape(**spec["shape"])
    out: dict[str, Any] = {}
    for seq in spec["mem_seqs"]:
        shape = Shape(base.batch, base.heads, base.kv_heads, base.head_dim, seq)
        for var in variants(groups, shape.heads):
            q, k, v, dout = local_inputs(shape, torch.float32, var)
            out[f"{seq}|{var.name}"] = measure_memory(var.fn, q, k, v, dout, shape.head_dim, groups.sizes())
            del q, k, v, dout
        dist.barrier()
        if groups.rank == 0:
            q, k, v, dout = full_inputs(shape, torch.float32)
            for t in (q, k, v):
                t.requires_grad_()
            out[f"{seq}|cp=1"] = measure_memory(_whole_sequence, q, k, v, dout, shape.head_dim, {})
            del q, k, v, dout
        dist.barrier()
    return out


def _whole_sequence(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Causal attention over the whole sequence on one rank: the reference each CP kind must equal."""
    return attention_block(q, k, v, causal_kind="causal")[0]
