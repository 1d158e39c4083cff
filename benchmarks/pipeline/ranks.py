"""Per-rank code of the pipeline benchmark: sleep stages, HF stages, and the timed steps.

Each rank runs every variant (meshkit's runtime and torch's schedules on the same modules, plus the
unsplit HF model on rank 0) in the same rotated order per repetition, with a barrier before every
step, and records when its step started and ended and how long each sleep took. `run` returns the
rank's records to the driver (`__main__`), which turns every rank's into tables.
"""

from __future__ import annotations

import contextlib
import os
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from benchmarks.pipeline import torch_pipeline as torch_pp
from meshkit.models import llama
from meshkit.models.stage import build_stages
from meshkit.pipeline import split as pp_split
from meshkit.pipeline.runtime import TensorMeta, TraceEvent, run_schedule
from meshkit.pipeline.schedules import Schedule, build_schedule, stage_chunks, stage_placement
from meshkit.testing.reference import ModelSpec

# ------------------------------------------------------------------------------------- sleep stages

#: (kind, start, end) of every sleep on this rank since the last `clear_log()`.
SLEEPS: list[tuple[str, float, float]] = []
#: meshkit's `run_schedule` trace of the step being timed (`TraceEvent`s), cleared with SLEEPS.
TRACE: list[TraceEvent] = []


def sleep(kind: str, seconds: float) -> None:
    """Stand-in compute: it occupies the timeline without a CPU, so 2 shared cores do not skew it."""
    start = time.perf_counter()
    time.sleep(seconds)
    SLEEPS.append((kind, start, time.perf_counter()))


class _SleepThrough(torch.autograd.Function):
    """Identity whose forward sleeps F and whose backward sleeps B.

    Its backward lies on the input-gradient path, so it runs in B under both meshkit's split (which
    defers only linear weight gradients) and torch's (which asks autograd for input gradients only).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, forward_s: float, backward_s: float) -> torch.Tensor:
        ctx.backward_s = backward_s
        sleep("F", forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        sleep("B", ctx.backward_s)
        return grad, None, None


class SleepStage(nn.Module):
    """A pipeline stage whose F, B and W each sleep a configured time.

    W sleeps in a hook on an `nn.Linear` weight: meshkit's `weight_grad` defers exactly the eager
    `nn.Linear` weight gradients to W (its W runs `autograd.backward` on the weights, which fires
    the hook), torch's W asks autograd for the weight gradients (the hook fires on capture), and a
    full backward fires it once. So B and W each take their own time whichever runtime splits them.
    The linear itself is tiny, and P2P tensors are a few hundred bytes.
    """

    def __init__(self, dim: int, costs_s: Sequence[float]) -> None:
        super().__init__()
        self.forward_s, self.backward_s, self.weight_s = costs_s
        self.proj = nn.Linear(dim, dim)
        self.proj.weight.register_hook(self._weight_grad)

    def _weight_grad(self, grad: torch.Tensor) -> torch.Tensor:
        sleep("W", self.weight_s)
        return grad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.requires_grad:  # first stage: a real one still has an input-gradient chain in B
            x = x.detach().requires_grad_()
        return self.proj(_SleepThrough.apply(x, self.forward_s, self.backward_s))


def sleep_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).square().mean()


# ---------------------------------------------------------------------------------------- HF stages


class WithPositions(nn.Module):
    """A meshkit `CausalLMStage` taking one positional tensor, as torch's `PipelineStage` expects.

    Positions are built inside (0..S-1 for every row), so neither runtime has to chunk or pass them.
    """

    def __init__(self, stage: nn.Module) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        return self.stage(x, position_ids=positions)


def hf_spec(cfg: dict) -> ModelSpec:
    return ModelSpec(layers=cfg["layers"], heads=cfg["heads"], kv_heads=cfg["kv_heads"], head_dim=cfg["head_dim"],
                     intermediate=cfg["intermediate"], vocab=cfg["vocab"])


def hf_batch(cfg: dict, microbatches: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and next-token labels; every label valid, so per-microbatch means average exactly."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg["vocab"], (microbatches * cfg["rows"], cfg["seq"]), generator=gen)
    return ids, ids.clone()


def hf_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """HF's causal-LM loss (predict token t+1 from t), as the mean over the microbatch's tokens."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())


def hf_stages(model: nn.Module, name: str, pp: int, v: int, rank: int) -> dict[int, nn.Module]:
    """This rank's stages of `model` split into chunks by meshkit (embedding and head count as
    layers), placed as schedule `name` places them (the V schedules: stages r and 2p-1-r on rank r;
    DualPipe: chunk r down and chunk p-1-r up)."""
    parts = llama.parts(model)
    chunks = stage_chunks(name, pp, v)
    ranges = pp_split.split_layers(len(parts.blocks), max(chunks) + 1)
    ids = pp_split.stages_of_rank(rank, stage_placement(name, pp, v))
    stages = build_stages(parts, parts.blocks, [ranges[c] for c in chunks], ids, None, chunks)
    return {s: WithPositions(m) for s, m in stages.items()}


# ------------------------------------------------------------------------------------------- steps


@dataclass
class Variant:
    """One timed thing: `step()` runs one training step on this rank (maybe nothing on some ranks)."""

    name: str
    step: Callable[[], Any]
    zero: Callable[[], None] = lambda: None  # outside the timed region: clear gradients


def meshkit_variant(name: str, schedule: Schedule, modules: dict[int, nn.Module], inputs: list[torch.Tensor],
                    loss_fn: Callable[[torch.Tensor, int], torch.Tensor], meta: TensorMeta,
                    trace: bool = False, runtime: str = "meshkit") -> Variant:
    """meshkit's runtime on this rank's modules, named `runtime:name`; with `trace`, its timeline goes to
    TRACE (the sleep section also times an untraced twin, "meshkit-untraced", for what tracing costs)."""
    def step() -> list[torch.Tensor]:
        return run_schedule(schedule, modules, pp_group=dist.group.WORLD, microbatch_inputs=inputs,
                            loss_fn=loss_fn, shapes=meta, trace=TRACE if trace else None)

    return Variant(f"{runtime}:{name}", step, lambda: _zero(modules.values()))


def torch_variant(name: str, pipeline: torch_pp.TorchPipeline, modules: dict[int, nn.Module], batch: torch.Tensor,
                  target: torch.Tensor) -> Variant:
    return Variant(f"torch:{name}", lambda: pipeline.step(batch, target), lambda: _zero(modules.values()))


def _zero(modules: Any) -> None:
    for module in modules:
        for p in module.parameters():
            p.grad = None


def torch_pipelines(schedules: Sequence[tuple[str, int]], pp: int, m: int, make_modules: Callable[[str, int], dict],
                    loss_fn: Callable, metas: Callable) -> tuple[dict[str, Any], dict[str, Any]]:
    """Build each torch peer; per schedule name either (pipeline, modules) or the reason it cannot run.

    Construction errors are local and deterministic (argument checks), so every rank agrees on them;
    the ranks still exchange outcomes so that none runs a schedule another rank refused.
    """
    built: dict[str, Any] = {}
    for name, _ in schedules:
        if name in torch_pp.NO_PEER:
            built[name] = torch_pp.NO_PEER[name]
            continue
        class_name, v = torch_pp.PEERS[name]
        try:
            modules = make_modules(name, v)
            built[name] = (torch_pp.build(class_name, modules, pp * v, m, loss_fn, metas), modules)
        except Exception as error:  # noqa: BLE001 - the reason is the result
            built[name] = f"{class_name}: {torch_pp.first_line(error)}"
    outcomes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, {n: b if isinstance(b, str) else None for n, b in built.items()})
    orders: dict[str, Any] = {}
    for name in list(built):
        reasons = {o[name] for o in outcomes if o[name] is not None}
        if reasons:
            built[name] = "; ".join(sorted(reasons))
        else:
            orders[name] = torch_pp.compute_order(built[name][0])
    return built, orders


# ------------------------------------------------------------------------------------------- timing


def clear_log() -> None:
    SLEEPS.clear()
    TRACE.clear()


def record(t0: float, t1: float, cpu: float, keep_sequence: bool) -> dict[str, Any]:
    """This rank's step: its span, CPU seconds, and per sleep kind the count and seconds actually slept.

    CPU time is what a loaded, shared machine cannot distort much (gloo waits block, they do not spin).
    """
    busy: dict[str, float] = {}
    count: dict[str, int] = {}
    for kind, start, end in SLEEPS:
        busy[kind] = busy.get(kind, 0.0) + end - start
        count[kind] = count.get(kind, 0) + 1
    out: dict[str, Any] = {"t0": t0, "t1": t1, "cpu": cpu, "busy": busy, "count": count}
    if keep_sequence:
        out["sequence"] = "".join(kind for kind, _, _ in SLEEPS)
    out["sleeps"] = list(SLEEPS)  # every sleep, for the per-action replay (`replay.sleep_times`)
    if TRACE:  # as text and floats, for `critical_path` and `replay.stage_times`
        out["trace"] = [(e.kind, tuple(map(str, e.what)) if e.kind == "post" else str(e.what), e.start, e.end)
                        for e in TRACE]
    return out


def measure(variants: list[Variant], reps: int, warmup: int) -> dict[str, list[dict]]:
    """Interleave the variants (rotating their order every repetition) and time every step.

    A variant that fails in warm-up on any rank is dropped with its reason: the ranks agree before
    the first timed step, so none waits on a peer that gave up.
    """
    failed: dict[str, str] = {}
    for variant in variants:
        for _ in range(warmup):
            try:
                variant.zero()
                variant.step()
            except Exception as error:  # noqa: BLE001 - reported, not fatal
                failed[variant.name] = torch_pp.first_line(error)
                traceback.print_exc()
                break
        dist.barrier()
    reasons: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(reasons, failed)
    dropped = {name: why for r in reasons for name, why in r.items()}
    alive = [v for v in variants if v.name not in dropped]
    out: dict[str, list[dict]] = {v.name: [] for v in alive}
    for rep in range(reps):
        shift = rep % max(1, len(alive))
        for variant in alive[shift:] + alive[:shift]:
            variant.zero()
            clear_log()
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            variant.step()
            t1, c1 = time.perf_counter(), time.process_time()
            out[variant.name].append(record(t0, t1, c1 - c0, keep_sequence=rep == 0))
    for name, why in dropped.items():
        out[name] = [{"error": why}]
    return out


# ---------------------------------------------------------------------------------------- sections


@contextlib.contextmanager
def scheduling(priority: str) -> Iterator[None]:
    """Run the block with every thread of this process under SCHED_FIFO ("fifo") or as it is ("normal").

    Sleep stages measure the runtime between sleeps; on a shared machine each wake-up otherwise waits
    behind other tenants' work. Linux applies the policy per thread, so it is set on every thread
    (the gloo transport's included) and set back to SCHED_OTHER after the block.
    """
    if priority == "normal":
        yield
        return
    threads = [int(t) for t in os.listdir("/proc/self/task")]
    for tid in threads:
        os.sched_setscheduler(tid, os.SCHED_FIFO, os.sched_param(1))
    try:
        yield
    finally:
        for tid in threads:
            with contextlib.suppress(ProcessLookupError):
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))


def sleep_section(spec: dict) -> dict[str, Any]:
    """The sleep-stage measurements, at the priority the spec asks for."""
    with scheduling(spec.get("priority", "normal")):
        return _sleep_section(spec)


def _sleep_section(spec: dict) -> dict[str, Any]:
    pp, m, rank = dist.get_world_size(), spec["microbatches"], dist.get_rank()
    cfg = spec["sleep"]
    rows, dim = cfg["rows"], cfg["dim"]
    torch.manual_seed(0)
    batch, target = torch.randn(m * rows, dim), torch.zeros(m * rows, dim)
    inputs, targets = list(batch.chunk(m)), list(target.chunk(m))
    meta = TensorMeta((rows, dim), torch.float32)

    def make_modules(name: str, v: int) -> dict[int, nn.Module]:
        costs = [c / 1000 / v for c in spec["costs_ms"]]  # a rank's work per microbatch is split over its v stages
        return {s: SleepStage(dim, costs) for s in pp_split.stages_of_rank(rank, stage_placement(name, pp, v))}

    variants = []
    for name, v in spec["schedules"]:
        modules = make_modules(name, v)
        for traced in (True, False):
            variants.append(meshkit_variant(name, build_schedule(name, pp, m, v), modules, inputs,
                                            lambda out, mb: sleep_loss(out, targets[mb]) / m, meta, trace=traced,
                                            runtime="meshkit" if traced else "meshkit-untraced"))
    built, orders = ({}, {})
    if spec["torch"]:
        def metas(s: int, num_stages: int) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.empty(rows, dim, requires_grad=s > 0), torch.empty(rows, dim, requires_grad=True)

        built, orders = torch_pipelines(spec["schedules"], pp, m, make_modules, sleep_loss, metas)
        variants += [torch_variant(n, *b, batch, target) for n, b in built.items() if not isinstance(b, str)]
    times = measure(variants, spec["reps"], spec["warmup"])
    return {"times": times, "torch_refused": {n: b for n, b in built.items() if isinstance(b, str)},
            "torch_orders": orders}


def hf_section(spec: dict) -> dict[str, Any]:
    pp, m, rank = dist.get_world_size(), spec["microbatches"], dist.get_rank()
    cfg = spec["hf"]
    model = hf_spec(cfg).build()
    ids, labels = hf_batch(cfg, m)
    inputs, label_mbs = list(ids.chunk(m)), list(labels.chunk(m))
    hidden = cfg["heads"] * cfg["head_dim"]
    meta = TensorMeta((cfg["rows"], cfg["seq"], hidden), torch.float32)
    losses: dict[str, float] = {}

    def single() -> None:
        if rank == 0:  # the unsplit HF model on one process; the other ranks wait at the next barrier
            loss = model(input_ids=ids, labels=labels, use_cache=False).loss
            loss.backward()
            losses["single"] = loss.item()

    variants = [Variant("single", single, lambda: _zero([model]))]
    for name, v in spec["schedules"]:
        modules = hf_stages(model, name, pp, v, rank)
        variants.append(meshkit_variant(name, build_schedule(name, pp, m, v), modules, inputs,
                                        lambda out, mb: hf_loss(out, label_mbs[mb]) / m, meta))
    built, orders = ({}, {})
    if spec["torch"]:
        def metas(s: int, num_stages: int) -> tuple[torch.Tensor, torch.Tensor]:
            # torch reads requires_grad from the examples: a received activation must ask for its gradient
            x = (torch.zeros(cfg["rows"], cfg["seq"], dtype=torch.long) if s == 0
                 else torch.empty(meta.shape, requires_grad=True))
            out_shape = (cfg["rows"], cfg["seq"], cfg["vocab"]) if s == num_stages - 1 else meta.shape
            return x, torch.empty(out_shape, requires_grad=True)

        def make_modules(name: str, v: int) -> dict[int, nn.Module]:
            return hf_stages(model, name, pp, v, rank)

        built, orders = torch_pipelines(spec["schedules"], pp, m, make_modules, hf_loss, metas)
        variants += [torch_variant(n, *b, ids, labels) for n, b in built.items() if not isinstance(b, str)]
    times = measure(variants, cfg["reps"], spec["warmup"])
    return {"times": times, "torch_refused": {n: b for n, b in built.items() if isinstance(b, str)},
            "losses": _losses([v for v in variants if "error" not in times[v.name][0]], m),
            "single_loss": losses.get("single")}


def _losses(variants: list[Variant], m: int) -> dict[str, float | None]:
    """Mean loss of one more step of every pipelined variant, from whichever rank holds the last stage.

    The same number from every runtime and schedule (and the unsplit model) is the evidence that the
    timed steps computed the same thing.
    """
    out: dict[str, float | None] = {}
    for variant in variants:
        if variant.name == "single":
            continue
        variant.zero()
        values = variant.step()
        dist.barrier()
        mine = None
        if values:
            total = float(sum(t.item() for t in values))
            mine = total if variant.name.startswith("meshkit") else total / m  # meshkit's loss_fn divides by m
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        # Summed: under DualPipe two ranks end a pipeline, each with its half of the microbatches.
        held = [g for g in gathered if g is not None]
        out[variant.name] = sum(held) if held else None
    return out


# ------------------------------------------------------------------------------------------- entry


def run(spec: dict) -> dict[str, Any]:
    """One gloo rank (every rank of the pool runs it): the records of each section `spec` asks for."""
    return {section: {"sleep": sleep_section, "hf": hf_section}[section](spec) for section in spec["sections"]}
