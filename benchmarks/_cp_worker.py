"""One gloo rank of `benchmarks/context_parallel.py`: it measures, the parent prints.

Everything a rank observes is recorded by one TorchDispatchMode (`Recorder`) rather than by
wrapping meshkit's functions: the attention kernels that actually run (so the work table checks the
schedule that executes, not the one the planner claims), and every c10d / functional collective
(so forward and backward bytes include what autograd issues on its own, e.g. the backward
all-to-all of Ulysses). Rank 0 writes one JSON file with every rank's numbers; the parent turns it
into tables and compares it with theory.

Private torch APIs are reached only through the accessors in the first section.
"""

from __future__ import annotations

import ctypes
import json
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshkit._compat import dispatch_mode_base, op_schema_arguments, torch_context_parallel
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

# --------------------------------------------------------------------------- private torch APIs


def watched_ops() -> dict[Any, str]:
    """Op overloads the recorder classifies; the CPU flash ops and the c10d namespaces are private."""
    aten, c10d, fc = torch.ops.aten, torch.ops.c10d, torch.ops._c10d_functional
    return {
        c10d.send.default: "send",
        c10d.recv_.default: "recv",
        c10d._allgather_base_.default: "all_gather",
        c10d._reduce_scatter_base_.default: "reduce_scatter",
        c10d.alltoall_base_.default: "all_to_all",
        fc.all_to_all_single.default: "all_to_all",
        fc.all_gather_into_tensor.default: "all_gather",
        fc.reduce_scatter_tensor.default: "reduce_scatter",
        aten._scaled_dot_product_flash_attention_for_cpu.default: "fwd_kernel",
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default: "bwd_kernel",
        torch.ops.meshkit.attention_block.default: "block_op",
    }


def bound_arguments(func: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """An op call's arguments by schema name: callers pass flags such
    as is_causal positionally or by keyword, and dispatch hands them on as given."""
    schema = op_schema_arguments(func)
    out = {a.name: a.default_value for a in schema if a.has_default_value()}
    out.update(zip((a.name for a in schema), args))
    out.update(kwargs)
    return out


# Collectives that carry no payload worth counting (waits, barriers, wrappers).
_IGNORED = {"wait_tensor", "_wrap_tensor_autograd", "barrier", "monitored_barrier_"}

# --------------------------------------------------------------------------------- recording


class Recorder(dispatch_mode_base()):  # type: ignore[misc]
    """Bytes each rank sends, collective calls and attention-kernel work, split by phase.

    Bytes are what leaves this rank: a send's buffer; (n-1)/n of an equal-split all-to-all's input
    (the self slice stays); (n-1)/n of an all-gather output (the ring algorithm forwards n-1 pieces)
    and of a reduce-scatter input. Kernel work is q*k score pairs per call, summed over batch and
    q heads, with a causal square block counted as its triangle (what the kernels compute).
    """

    def __init__(self, group_sizes: dict[str, int], head_dim: int) -> None:
        super().__init__()
        self.ops = watched_ops()
        self.group_sizes = group_sizes
        self.head_dim = head_dim
        self.phase = "fwd"
        self.sent: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self.kernels: dict[str, list[list[int]]] = {"fwd": [], "bwd": []}
        self.other: set[str] = set()
        self.max_extent = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        kind = self.ops.get(func)
        if kind is not None:
            self._classify(kind, func, args, kwargs)
        elif func.namespace in ("c10d", "_c10d_functional") and func.name().split("::")[-1] not in _IGNORED:
            self.other.add(func.name())
        self._track_extent(out)
        return out

    def _classify(self, kind: str, func: Any, args: tuple, kwargs: dict) -> None:
        if kind.endswith("kernel") or kind == "block_op":
            self._kernel(kind, bound_arguments(func, args, kwargs))
            return
        self.calls[f"{self.phase}:{kind}"] += 1
        if kind == "send":
            self.sent[self.phase] += sum(t.nbytes for t in args[0])
        elif kind != "recv":  # all-to-all input, all-gather output, reduce-scatter input: the larger of the two buffers
            full = max((a for a in args[:2] if isinstance(a, Tensor)), key=lambda t: t.nbytes)
            n = self._size(args)
            self.sent[self.phase] += full.nbytes * (n - 1) // n

    def _size(self, args: tuple) -> int:
        """Group size: functional ops name their group, c10d ops pass the ProcessGroup object."""
        for a in args:
            if isinstance(a, str) and a in self.group_sizes:
                return self.group_sizes[a]
            if not isinstance(a, (Tensor, str, int, float, bool, list, tuple)) and hasattr(a, "size"):
                try:
                    return int(a.size())
                except (RuntimeError, TypeError):
                    continue
        return dist.get_world_size()

    def _kernel(self, kind: str, a: dict[str, Any]) -> None:
        if kind == "block_op":  # meshkit::attention_block(q, k, v, causal_kind, ...): Ulysses' differentiable op
            q, k, causal = a["q"], a["k"], a["causal_kind"] == "causal"
        else:
            q, k, causal = a["query"], a["key"], a["is_causal"]
        B, H, Sq, _ = q.shape
        Sk = k.shape[2]
        per_head = Sq * (Sq + 1) // 2 if causal else Sq * Sk
        phase = "bwd" if kind == "bwd_kernel" else "fwd"
        self.kernels[phase].append([per_head, B * H, Sq, Sk, int(bool(causal))])

    def _track_extent(self, out: Any) -> None:
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, Tensor) and t.dim() >= 4 and t.shape[-1] == self.head_dim:
                self.max_extent = max(self.max_extent, int(t.shape[-2]))

    def summary(self) -> dict[str, Any]:
        return {"sent": dict(self.sent), "calls": dict(self.calls), "kernels": self.kernels,
                "other": sorted(self.other), "max_extent": self.max_extent}


class SavedBytes:
    """Bytes autograd keeps for backward, counted once per storage (views of one buffer share it)."""

    def __init__(self) -> None:
        self.storages: dict[int, int] = {}

    def pack(self, t: Tensor) -> Tensor:
        s = t.untyped_storage()
        self.storages[s.data_ptr()] = s.nbytes()
        return t

    @staticmethod
    def unpack(t: Tensor) -> Tensor:
        return t

    @property
    def total(self) -> int:
        return sum(self.storages.values())


# ------------------------------------------------------------------------------ peak RSS


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def reset_peak_rss() -> int | None:
    """Reset the kernel's high-water mark (clear_refs 5); return current RSS bytes, None if not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status_kb("VmRSS") * 1024
    except (OSError, KeyError):
        return None


def peak_rss_since(base: int | None) -> int | None:
    return None if base is None else _status_kb("VmHWM") * 1024 - base


def return_big_frees_to_os() -> None:
    """Fix glibc's mmap threshold at 128 KiB: big tensors are mmapped and unmapped on free, so RSS peaks
    track tensor lifetimes instead of a heap that only grows (the dynamic threshold would hide them)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
    except OSError:
        pass


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
        groups = [g for g in (self.world, self.inner, self.outer) if g is not None]
        return {g.group_name: dist.get_world_size(g) for g in groups}


class _GatherSeq(torch.autograd.Function):
    """All-gather along the sequence (dim 2 of [2, B, H, S, D]); backward reduce-scatters the gradient."""

    @staticmethod
    def forward(ctx, kv: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        n = dist.get_world_size(group)
        local = kv.permute(3, 0, 1, 2, 4).contiguous()  # sequence first: all_gather_into_tensor concatenates dim 0
        full = local.new_empty((n * local.shape[0], *local.shape[1:]))
        dist.all_gather_into_tensor(full, local, group=group)
        return full.permute(1, 2, 3, 0, 4)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
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
    from torch.distributed.device_mesh import init_device_mesh

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
                rec.phase = "bwd"
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


# -------------------------------------------------------------------------------- HF step


def llama_config(spec: dict) -> Any:
    """A fresh config per model: parallelize re-points a config's attention implementation."""
    from transformers import LlamaConfig

    m = spec["model"]
    return LlamaConfig(hidden_size=m["hidden"], intermediate_size=m["inter"], num_hidden_layers=m["layers"],
                       num_attention_heads=m["heads"], num_key_value_heads=m["kv_heads"],
                       vocab_size=m["vocab"], max_position_embeddings=max(spec["shape"]["seq"], 128),
                       use_cache=False, tie_word_embeddings=False, attn_implementation="sdpa",
                       attention_dropout=0.0)


class NaiveCP:
    """Stands in for meshkit's context-parallel attention (the `context_parallel` of each stage, which
    the stage hands to every attention call), so the all-gather baseline runs through exactly the
    same model, sharding and loss as meshkit's kinds."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, scale: float, doc_ids: Tensor | None) -> Tensor:
        if doc_ids is not None:
            raise ValueError("the all-gather baseline does not do packed documents")
        return allgather_attention(q, k, v, self.group, scale)


def build_meshkit(spec: dict, kind: str, ulysses: int) -> Any:
    """parallelize a meta-initialised Llama with cp = world; kind 'all-gather KV' reuses the ring's
    contiguous sharding and swaps the attention."""
    from transformers import LlamaForCausalLM

    import meshkit

    with torch.device("meta"):
        model = LlamaForCausalLM(llama_config(spec))
    P = dist.get_world_size()
    cp_kind = "ring" if kind == "all-gather KV" else kind.split(" ")[0]
    plan = meshkit.Plan(cp=P, cp_attention=cp_kind, cp_ulysses=ulysses if cp_kind == "usp" else 1)
    pm = meshkit.parallelize(model, plan)
    pm.init_weights(0)
    if kind == "all-gather KV":
        for stage in pm.model_parts:
            stage.context_parallel = NaiveCP(dist.group.WORLD)
    return pm


def meshkit_step(pm: Any, ids: Tensor) -> float:
    loss = pm.forward_backward(ids, ids)
    for p in pm.parameters():
        p.grad = None
    return float(loss)


def plain_step(model: Any, ids: Tensor) -> float:
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    return float(loss.detach())


def torch_cp_step(model: Any, mesh: Any, ids: Tensor) -> None:
    """HF forward/backward under torch's experimental CP; targets shifted on the full sequence first."""
    context_parallel, set_rotate_method = torch_context_parallel()
    set_rotate_method("alltoall")
    targets = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
    pos = torch.arange(ids.shape[1]).expand_as(ids).contiguous()
    bufs = [ids.clone(), targets, pos]
    with context_parallel(mesh, buffers=bufs, buffer_seq_dims=[1, 1, 1], no_restore_buffers=set(bufs)):
        logits = model(input_ids=bufs[0], position_ids=bufs[2]).logits
        F.cross_entropy(logits.flatten(0, 1), bufs[1].flatten(), ignore_index=-100).backward()
    model.zero_grad(set_to_none=True)


def hf_time_section(spec: dict, groups: Groups, torch_cp_ok: bool) -> dict[str, Any]:
    """A tiny Llama's training step (fwd+bwd, no optimizer) through parallelize, per kind, vs the
    plain HF model in one process and vs torch's experimental CP on the HF model where it runs
    (decided beforehand by `probe_hf_torch_cp` in a world of its own)."""
    from transformers import LlamaForCausalLM

    m = spec["model"]
    kinds = ["ring", "zigzag"] + (["ulysses"] if m["heads"] % groups.size == 0 else [])
    kinds += [usp_name(groups.ulysses)] if groups.ulysses > 1 else []
    kinds += ["all-gather KV"]
    models = {kind: build_meshkit(spec, kind, groups.ulysses) for kind in kinds}
    state = models["ring"].full_state_dict()
    plain = LlamaForCausalLM(llama_config(spec))
    plain.load_state_dict(state)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, m["vocab"], (spec["shape"]["batch"], spec["shape"]["seq"]), generator=g)
    losses = {kind: meshkit_step(pm, ids) for kind, pm in models.items()}
    losses["single process (plain HF)"] = plain_step(plain, ids) if groups.rank == 0 else float("nan")
    runs: dict[str, tuple[Callable[[], Any], bool]] = {
        kind: ((lambda pm=pm: meshkit_step(pm, ids)), True) for kind, pm in models.items()
    }
    if torch_cp_ok:
        mesh = cp_mesh()
        runs["torch CP (alltoall ring)"] = ((lambda: torch_cp_step(plain, mesh, ids)), True)
    runs["single process (plain HF)"] = ((lambda: plain_step(plain, ids)), groups.rank == 0)
    times = interleave(runs, spec["hf_reps"], 1)
    return {"times": times, "losses": losses}


def probe_hf_torch_cp(rank: int, world: int, port: int, spec: dict, out_dir: str) -> None:
    """Try one HF step under torch's experimental CP in a world of its own and write each rank's outcome.

    Ranks may fail at different points (HF builds an attention mask on some load-balanced shards and
    not on others), leaving peers inside a collective that never completes; a throwaway world keeps
    that from wrecking the measuring one. Each rank records its own exception before anything else.
    """
    import warnings

    from transformers import LlamaForCausalLM

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    with process_group(rank, world, port):
        plain = LlamaForCausalLM(llama_config(spec))
        ids = torch.randint(0, spec["model"]["vocab"], (spec["shape"]["batch"], spec["shape"]["seq"]),
                            generator=torch.Generator().manual_seed(7))
        try:
            torch_cp_step(plain, cp_mesh(), ids)
            reason = None
        except Exception as e:  # noqa: BLE001 - the reason is the result
            reason = first_line(e)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"reason": reason}, f)
        if reason is not None:
            os._exit(0)  # peers may sit in a collective this rank never joins: skip the teardown


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
    return attention_block(q, k, v, causal_kind="causal")[0]


# ---------------------------------------------------------------------------------- entry


@contextmanager
def process_group(rank: int, world: int, port: int) -> Iterator[None]:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), CUDA_VISIBLE_DEVICES="")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def run(rank: int, world: int, port: int, spec: dict, out_path: str) -> None:
    """Entry point of one rank (torch.multiprocessing); rank 0 writes every rank's results."""
    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    return_big_frees_to_os()
    with process_group(rank, world, port):
        groups = Groups(spec["ulysses"] if world >= 4 and world % spec["ulysses"] == 0 else 1)
        mine: dict[str, Any] = {}
        if "counts" in spec["sections"]:
            mine["counts"] = count_section(spec, groups)
        probe_result = torch_cp_probe_section(spec, groups)
        mine["torch_cp"] = probe_result
        if "time" in spec["sections"]:
            mine["attention_time"] = attention_time_section(spec, groups, probe_result["reason"] is None)
            mine["hf_time"] = hf_time_section(spec, groups, spec["torch_cp_hf_ok"])
        if "memory" in spec["sections"]:
            mine["memory"] = memory_section(spec, groups)
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, mine)
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump({"world": world, "ranks": everyone}, f)
