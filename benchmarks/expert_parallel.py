"""Expert parallelism on a CPU gloo mesh: all-to-all bytes vs theory, load balance, EP vs replicated experts.

    python -m benchmarks.expert_parallel [--quick] [--gpu] [--out FILE]

The script starts gloo ranks (ep = 2 and 4, one rank per process, 1 thread each; `benchmarks.launch`)
and prints markdown:

1. bytes each rank sends through the token all-to-alls per training step of one MoE layer, forward
   and backward, counted on the c10d calls themselves (a TorchDispatchMode sees autograd's backward
   all-to-alls too) and compared with theory: `T·K·H·itemsize·(ep-1)/ep` per all-to-all under
   uniform routing, two per forward (dispatch, combine) and two per backward. "Uniform" routing is
   forced exactly (each token's top-2 is set by its input); "random" is a freshly initialised router.
2. load balance (max/mean assignments per expert, global over ranks) while training a skewed routing
   problem for a few dozen steps under each balancing method: none, Switch aux loss, DeepSeek-V3 bias.
3. step time (forward + backward + the gradient reductions the layout needs) of EP vs a naive
   baseline where every rank holds every expert (and must all-reduce the expert gradients), as
   medians of interleaved repetitions and their ratio. On a shared 2-core machine these are noisy and
   all-to-all goes through loopback TCP; nothing here asserts on time.
4. grouped GEMM (`torch._grouped_mm`) vs the per-expert loop, single process, on CPU; with `--gpu`
   and a CUDA device also on the GPU (without one the section says it was skipped).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.launch import run_ranks
from benchmarks.report import emit, machine_line, table
from meshkit._compat.dispatch import dispatch_mode_base
from meshkit.expert_parallel import MoE, apply_expert_parallel, pop_router_stats, update_expert_biases
from meshkit.expert_parallel.grouped_gemm import grouped_mm_usable, swiglu_experts

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# ------------------------------------------------------------------------------ instrumentation


class A2ARecorder(dispatch_mode_base()):  # type: ignore[misc]
    """Records every c10d all-to-all and all-reduce issued on this rank, with the bytes that leave it."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "forward"
        self.events: list[dict[str, Any]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        """Note each all-to-all's bytes that leave this rank (its own split stays) and each all-reduce's, then run the op."""
        name = func.__name__.split(".")[0]
        if func.namespace == "c10d" and name == "alltoall_base_":
            inp, group = args[1], dist.ProcessGroup.unbox(args[2])
            row_bytes = inp.element_size() * math.prod(inp.shape[1:])
            in_splits = list(args[4]) or [inp.shape[0] // group.size()] * group.size()
            total = inp.numel() * inp.element_size()
            self.events.append({"phase": self.phase, "kind": "counts" if inp.dtype == torch.int64 else "tokens",
                                "total": total, "off_rank": total - in_splits[group.rank()] * row_bytes})
        elif func.namespace == "c10d" and name == "allreduce_":
            nbytes = sum(t.numel() * t.element_size() for t in args[0])
            self.events.append({"phase": self.phase, "kind": "all_reduce", "total": nbytes, "off_rank": nbytes})
        return func(*args, **(kwargs or {}))


# ------------------------------------------------------------------------------ per-rank work


def uniform_problem(moe: MoE, tokens: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
    """Inputs whose top-2 is exactly {t mod E, t+1 mod E} under a router reading the first E dims:
    every expert gets T·K/E assignments from every rank."""
    E, H = moe.num_experts, moe.hidden_size
    with torch.no_grad():
        moe.gate.weight.zero_()
        moe.gate.weight[:, :E].copy_(torch.eye(E))
    g = torch.Generator().manual_seed(100 + rank)
    x = 0.01 * torch.randn(tokens, H, generator=g)
    t = torch.arange(tokens)
    x[t, t % E] += 4.0
    x[t, (t + 1) % E] += 2.0
    return x.to(dtype)


def build(shape: dict, dtype: torch.dtype = torch.float32, **kw: Any) -> MoE:
    """A meshkit MoE layer of `shape` with the same weights on every rank and in every variant (seed 0)."""
    torch.manual_seed(0)
    return MoE(shape["hidden"], shape["inter"], shape["experts"], shape["top_k"], dtype=dtype, init_std=0.02, **kw)


def bytes_run(shape: dict, rank: int) -> list[dict]:
    """One forward + backward per (dtype, routing); the recorder's events per case."""
    out = []
    for dtype_name, dtype in DTYPES.items():
        for routing in ("uniform", "random"):
            moe = apply_expert_parallel(build(shape, dtype), dist.group.WORLD)
            if routing == "uniform":
                x = uniform_problem(moe, shape["tokens"], rank, dtype)
            else:
                x = torch.randn(shape["tokens"], shape["hidden"], generator=torch.Generator().manual_seed(rank)).to(dtype)
            x.requires_grad_(True)
            rec = A2ARecorder()
            with rec:
                y = moe(x)
                rec.phase = "backward"
                y.float().square().sum().backward()
            out.append({"dtype": dtype_name, "routing": routing, "events": rec.events})
    return out


def balance_run(shape: dict, rank: int, world: int, method: str, steps: int) -> dict:
    """Train a skewed routing problem; per step the global max/mean assignments per expert."""
    opts = {"none": {}, "switch": {"aux_loss_coef": shape["aux_coef"]},
            "bias": {"bias_update_rate": shape["bias_rate"]}}[method]
    moe = build(shape, **opts)
    E, H = moe.num_experts, moe.hidden_size
    g = torch.Generator().manual_seed(7)
    mean_dir = torch.randn(H, generator=g)
    mean_dir /= mean_dir.norm()
    teacher = torch.randn(H, H, generator=g) / math.sqrt(H)
    with torch.no_grad():  # skew: experts 0 and 1 point along the data's mean, so they win nearly every token
        moe.gate.weight[:2] += 0.5 * mean_dir
    apply_expert_parallel(moe, dist.group.WORLD, load_group=dist.group.WORLD)
    moe.keep_router_stats = True  # global counts per step, for the statistics below
    opt = torch.optim.Adam(moe.parameters(), lr=shape["lr"])
    gx = torch.Generator().manual_seed(1000 + rank)
    ratios, losses = [], []
    for _ in range(steps):
        x = torch.randn(shape["tokens"], H, generator=gx) + 2.0 * mean_dir
        target = torch.tanh(x @ teacher)
        err = moe(x) - target
        loss = err.square().sum() / (shape["tokens"] * world * H)  # this rank's share of the global mean
        loss.backward()
        (stats,) = pop_router_stats(moe)
        counts_E = stats.counts_E
        ratios.append((counts_E.max() / counts_E.mean()).item())
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item())
        dist.all_reduce(moe.gate.weight.grad)  # the router is replicated: sum over the data ranks
        opt.step()
        opt.zero_grad()
        update_expert_biases(moe)
    cap = math.ceil(1.25 * counts_E.sum().item() / E)
    overflow = (counts_E - cap).clamp(min=0).sum().item() / counts_E.sum().item()
    return {"method": method, "ratios": ratios, "losses": losses, "overflow": overflow,
            "final_counts": counts_E.tolist()}


def timing_run(shape: dict, rank: int, reps: int) -> dict:
    """Interleaved EP and replicated-experts steps on the same tokens and routing (forced uniform)."""
    ep_moe = apply_expert_parallel(build(shape), dist.group.WORLD)
    full = build(shape)
    x = uniform_problem(ep_moe, shape["tokens"], rank, torch.float32)
    uniform_problem(full, shape["tokens"], rank, torch.float32)

    def ep_step() -> None:
        """The expert-parallel step: the router's gradient needs the all-reduce, the experts' are complete after dispatch's backward."""
        ep_moe(x).square().sum().backward()
        dist.all_reduce(ep_moe.gate.weight.grad)  # expert grads are complete after the all-to-all backward
        ep_moe.zero_grad(set_to_none=True)

    def replicated_compute() -> None:
        """The replicated layer's compute alone: the floor a data-parallel MoE cannot go under."""
        full(x).square().sum().backward()
        full.zero_grad(set_to_none=True)

    def replicated_step() -> None:
        """The replicated layer as data parallelism runs it: every expert's gradient all-reduced."""
        full(x).square().sum().backward()
        grads = [p.grad for p in full.parameters()]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)  # data parallel: every expert's gradient summed over the ranks
        full.zero_grad(set_to_none=True)

    variants: dict[str, Callable[[], None]] = {"ep": ep_step, "replicated (compute only)": replicated_compute,
                                               "replicated + grad all-reduce": replicated_step}
    times: dict[str, list[float]] = {k: [] for k in variants}
    for rep in range(reps + 1):
        for name, fn in variants.items():
            dist.barrier()
            start = time.perf_counter()
            fn()
            dist.barrier()
            if rep:  # the first round warms up
                times[name].append(time.perf_counter() - start)
    expert_bytes = {"ep": sum(p.numel() * 4 for p in ep_moe.experts.parameters()),
                    "replicated": sum(p.numel() * 4 for p in full.experts.parameters())}
    return {"times": times, "expert_bytes": expert_bytes}


def rank_main(spec: dict) -> dict[str, Any]:
    """One rank's measurements (every rank of the pool runs it)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine: dict[str, Any] = {"bytes": bytes_run(spec["bytes_shape"], rank)}
    if "balance" in spec["sections"]:
        mine["balance"] = [balance_run(spec["balance_shape"], rank, world, m, spec["steps"])
                           for m in ("none", "switch", "bias")]
    mine["timing"] = timing_run(spec["time_shape"], rank, spec["reps"])
    return mine


# ------------------------------------------------------------------------------ tables


def kib(n: float) -> str:
    """Bytes as KiB for the tables (the byte counts of tiny shapes read better so)."""
    return f"{n / 1024:.1f}"


def bytes_section(results: dict[int, list], shape: dict) -> list[str]:
    """Section 1: all-to-all bytes per rank measured against T*K*H*(ep-1)/ep, the minimum a dispatch must move."""
    T, K, H = shape["tokens"], shape["top_k"], shape["hidden"]
    rows = []
    for ep, ranks in results.items():
        for case_idx, case in enumerate(ranks[0]["bytes"]):
            item = torch.tensor([], dtype=DTYPES[case["dtype"]]).element_size()
            theory = T * K * H * item * (ep - 1) / ep
            per_rank = [r["bytes"][case_idx]["events"] for r in ranks]

            def total(events: list[dict], phase: str, kind: str = "tokens") -> float:
                """Bytes of one kind that left the ranks in one phase (tokens or counts), the quantity the theory predicts."""
                return sum(e["off_rank"] for e in events if e["phase"] == phase and e["kind"] == kind)

            fwd = statistics.mean(total(ev, "forward") for ev in per_rank)
            bwd = statistics.mean(total(ev, "backward") for ev in per_rank)
            spread = max(total(ev, "forward") + total(ev, "backward") for ev in per_rank)
            counts = statistics.mean(total(ev, "forward", "counts") + total(ev, "backward", "counts")
                                     for ev in per_rank)
            n_a2a = sum(1 for e in per_rank[0] if e["kind"] == "tokens")
            rows.append([ep, case["dtype"], case["routing"], kib(fwd), kib(2 * theory), kib(bwd), kib(2 * theory),
                         f"{(fwd + bwd) / (4 * theory):.3f}", kib(spread), n_a2a, f"{counts:.0f}"])
    return ["## 1. All-to-all bytes per training step of one MoE layer (per rank, off-rank only)", "",
            f"T={T} tokens per rank, K={K}, H={H}, E={shape['experts']}, I={shape['inter']}. Theory per "
            "all-to-all: T·K·H·itemsize·(ep-1)/ep; forward = dispatch + combine, backward = their "
            "transposes. Measured = mean over ranks of the rows each rank sends to other ranks "
            "(its self-split excluded); 'max rank' shows the spread under random routing.", "",
            *table(["ep", "dtype", "routing", "fwd KiB", "fwd theory", "bwd KiB", "bwd theory",
                    "measured/theory", "max rank fwd+bwd KiB", "token a2a calls", "count a2a bytes"], rows)]


def balance_section(ranks: list, shape: dict, steps: int, ep: int) -> list[str]:
    """Section 2: how each balancing method evens the expert load over training, and what it costs the loss."""
    rows = []
    for res in ranks[0]["balance"]:
        r = res["ratios"]
        tail = r[-10:]
        rows.append([res["method"], f"{r[0]:.2f}", f"{statistics.mean(r):.2f}", f"{statistics.mean(tail):.2f}",
                     f"{r[-1]:.2f}", f"{res['overflow'] * 100:.1f}%", f"{res['losses'][0]:.4f}",
                     f"{res['losses'][-1]:.4f}", " ".join(f"{c:.0f}" for c in res["final_counts"])])
    E = shape["experts"]
    return ["## 2. Load balance on a skewed routing problem", "",
            f"ep={ep}, E={E}, K={shape['top_k']}, {shape['tokens']} tokens per rank per step, {steps} Adam steps "
            f"(lr {shape['lr']}); the router starts biased towards experts 0 and 1 along the data's mean. max/mean = "
            f"largest expert's assignments over the average (1.00 is perfect, {E / shape['top_k']:.2f} is "
            "everything on K experts), global over ranks. Switch: aux_loss_coef="
            f"{shape['aux_coef']} (Megatron scale); bias: DeepSeek-V3 update rate {shape['bias_rate']} per step "
            "(larger than DeepSeek's 1e-3 because the run is short). 'overflow' = assignments above a "
            "capacity factor of 1.25 at the last step (what a capacity-limited layer would drop).", "",
            *table(["method", "max/mean step 1", "mean over steps", f"mean last {min(10, steps)}", "last",
                    "overflow cf=1.25", "task loss first", "task loss last", "final counts per expert"], rows)]


def timing_section(results: dict[int, list], shape: dict, reps: int) -> list[str]:
    """Section 3: an expert-parallel step against the replicated layer of the same run, with and without its gradient all-reduce."""
    rows = []
    for ep, ranks in results.items():
        times = ranks[0]["timing"]["times"]  # barriers make every rank's step the slowest rank's
        ep_t = times["ep"]
        for name in ("replicated (compute only)", "replicated + grad all-reduce"):
            ratios = [a / b for a, b in zip(ep_t, times[name])]
            rows.append([ep, name, f"{statistics.median(ep_t) * 1e3:.1f}", f"{statistics.median(times[name]) * 1e3:.1f}",
                         f"{statistics.median(ratios):.2f}"])
        mem = ranks[0]["timing"]["expert_bytes"]
        rows.append([ep, "expert weights per rank (MiB)", f"{mem['ep'] / 2**20:.2f}", f"{mem['replicated'] / 2**20:.2f}",
                     f"{mem['ep'] / mem['replicated']:.2f}"])
    return ["## 3. Step time: EP vs every rank holding every expert", "",
            f"One MoE layer, T={shape['tokens']} tokens per rank, H={shape['hidden']}, I={shape['inter']}, "
            f"E={shape['experts']}, K={shape['top_k']}, fp32, forced uniform routing; forward + backward "
            "(+ the router's gradient all-reduce for EP; + every expert's gradient all-reduce for the replicated "
            f"layout, as data parallelism needs). Medians of {reps} interleaved repetitions; ratio = median of "
            "per-repetition EP/baseline (below 1: EP faster).", "",
            *table(["ep", "baseline", "EP ms", "baseline ms", "EP / baseline"], rows)]


def gemm_rows(device: torch.device, dtype: torch.dtype, shape: dict, reps: int) -> list[list[str]]:
    """Grouped GEMM backends on one uneven routing, timed side by side (the ratio a backend choice rests on)."""
    E, H, inter, rows_total = shape["experts"], shape["hidden"], shape["inter"], shape["rows"]
    g = torch.Generator(device="cpu").manual_seed(0)
    counts = torch.multinomial(torch.ones(E), rows_total, replacement=True, generator=g).bincount(minlength=E)
    tokens = counts.tolist()
    x = torch.randn(rows_total, H, generator=g).to(device, dtype).requires_grad_(True)
    w1 = (torch.randn(E, 2 * inter, H, generator=g) * 0.02).to(device, dtype).requires_grad_(True)
    w2 = (torch.randn(E, H, inter, generator=g) * 0.02).to(device, dtype).requires_grad_(True)
    counts_dev = counts.to(device)
    flops = 3 * 2 * rows_total * 3 * H * inter  # fwd (gate_up + down = 3·H·I MACs per row) + 2x for bwd
    out = []
    if not grouped_mm_usable(x, w1, w2):
        return [[device.type, str(dtype).split(".")[-1], "grouped_mm does not run here", "", "", ""]]

    def step(backend: str) -> float:
        """Seconds of one forward and backward through a backend, synchronised on a GPU so queued kernels count."""
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        swiglu_experts(x, w1, w2, tokens, backend, counts_dev).float().sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    backends = ("grouped_mm", "loop")
    for backend in backends:
        step(backend)  # warm-up
    samples: dict[str, list[float]] = {b: [] for b in backends}
    for _ in range(reps):  # interleaved, so machine noise hits both alike
        for backend in backends:
            samples[backend].append(step(backend))
    for backend in backends:
        t = statistics.median(samples[backend])
        speedup = statistics.median(lo / b for lo, b in zip(samples["loop"], samples[backend]))
        out.append([device.type, str(dtype).split(".")[-1], backend, f"{t * 1e3:.2f}", f"{flops / t / 1e12:.3f}",
                    f"{speedup:.2f}"])
    return out


def gemm_section(args: argparse.Namespace) -> list[str]:
    """Section 4: the grouped GEMM backends on CPU, and on a GPU when one is present and asked for."""
    cpu_shape = {"experts": 8, "hidden": 256, "inter": 512, "rows": 2048}
    torch.set_num_threads(1)  # like each rank above; a shared machine's spare cores are not ours
    rows = gemm_rows(torch.device("cpu"), torch.float32, cpu_shape, args.reps)
    note = "`--gpu` not given."
    if args.gpu and torch.cuda.is_available():
        gpu_shape = {"experts": 8, "hidden": 4096, "inter": 14336, "rows": 16384}
        for dtype in (torch.bfloat16, torch.float32):
            rows += gemm_rows(torch.device("cuda"), dtype, gpu_shape, 20)
        note = f"GPU: {torch.cuda.get_device_name()}, shape E=8, H=4096, I=14336, 16384 rows (Mixtral-8x7B experts)."
    elif args.gpu:
        note = "`--gpu` given but no CUDA device here: the GPU rows were skipped (this machine is CPU-only)."
    return ["## 4. Grouped GEMM vs per-expert loop (SwiGLU experts, forward + backward)", "",
            f"CPU shape: E=8, H=256, I=512, 2048 rows in random expert groups. {note}", "",
            *table(["device", "dtype", "backend", "ms", "TFLOP/s", "speed-up vs loop"], rows)]


# ------------------------------------------------------------------------------ driver



def parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line; --quick keeps a run to about a minute on a shared 2-core machine."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer steps and repetitions (about a minute)")
    p.add_argument("--steps", type=int, default=None, help="training steps of section 2 (default 40, quick 20)")
    p.add_argument("--reps", type=int, default=None, help="timing repetitions of section 3 (default 15, quick 5)")
    p.add_argument("--gpu", action="store_true", help="add GPU rows to section 4 (runs only with a CUDA device)")
    p.add_argument("--out", help="also write the markdown here")
    args = p.parse_args(argv)
    args.steps = args.steps or (20 if args.quick else 40)
    args.reps = args.reps or (5 if args.quick else 15)
    return args


def main(argv: list[str] | None = None) -> int:
    """Run every section on 2 and 4 ranks, print the markdown and write it with --out."""
    args = parse(argv)
    start = time.perf_counter()
    spec = {
        "bytes_shape": {"tokens": 256, "hidden": 64, "inter": 128, "experts": 8, "top_k": 2},
        "balance_shape": {"tokens": 256, "hidden": 32, "inter": 32, "experts": 8, "top_k": 2, "lr": 1e-2,
                          "aux_coef": 0.1, "bias_rate": 1e-2},
        "time_shape": {"tokens": 1024, "hidden": 128, "inter": 256, "experts": 8, "top_k": 2},
        "steps": args.steps, "reps": args.reps,
    }
    results: dict[int, list] = {}
    for ep in (2, 4):
        print(f"[expert_parallel] ep={ep} ({time.perf_counter() - start:.0f}s)", file=sys.stderr, flush=True)
        results[ep] = run_ranks(rank_main, ep, dict(spec, sections=["balance"] if ep == 4 else []))
    lines = ["# meshkit expert-parallel benchmark", "",
             machine_line(", gloo on CPU, 1 thread per rank (benchmarks.launch)"), ""]
    lines += bytes_section(results, spec["bytes_shape"])
    lines += balance_section(results[4], spec["balance_shape"], args.steps, 4)
    lines += timing_section(results, spec["time_shape"], args.reps)
    lines += gemm_section(args)
    lines.append(f"Total runtime {time.perf_counter() - start:.0f} s.")
    emit(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
