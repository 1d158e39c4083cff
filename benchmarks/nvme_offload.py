"""NVMe offload against host offload: host memory and step time (`python -m benchmarks.nvme_offload [--out ...]`).

One process per measurement (so each starts from a clean heap) trains a ~32M-parameter Llama on one
rank for `--steps` AdamW steps under `offload="optimizer"` (the master weights, gradients and AdamW's
two moments in host memory) and under `offload="nvme"` (the moments in a file under a temporary
directory, streamed one FSDP unit at a time). It reports the growth of the process's resident memory
from the model being built to its peak (VmHWM; the optimizer state is created at the first step), the
median step time after the first, and the bytes the NVMe run read and wrote per step. Then both run
again with the process's address space capped (RLIMIT_AS) at what the NVMe run grew by, plus 10%:
less than AdamW's state, which `offload="optimizer"` must hold and so cannot allocate. On this machine
the "NVMe" is the VM's disk, and the OS page cache may serve reads of what was just written (the
kernel counts the cache as its own, not the process's, memory).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import torch
import transformers  # lazily: its modeling code (which imports torchao) loads after meshkit, which quiets torchao

import meshkit
from benchmarks.report import emit, machine_line, table
from meshkit.testing.reference import ADAM_EPS

MODEL = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4, vocab_size=8192, max_position_embeddings=256)
BATCH, SEQ = 1, 64


def _status(field: str) -> int:
    """A /proc/self/status memory figure, in bytes."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def child(offload: str, steps: int, cap: int | None) -> dict:
    """One measurement in this process (see the module docstring); `cap`: extra address space allowed."""
    warnings.simplefilter("ignore")  # "offloading saves nothing here": no accelerator
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(dir=os.environ.get("NVME_DIR")) as state_dir:
        plan = f"offload={offload}" + (f",offload_dir={state_dir}" if offload == "nvme" else "")
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**MODEL))
        pm = meshkit.parallelize(model, meshkit.Plan.from_string(plan))
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-4, eps=ADAM_EPS)
        ids = torch.randint(0, MODEL["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
        pm.forward_backward(ids, ids)  # the first forward/backward: its buffers are not the optimizer's
        opt.zero_grad()
        base_rss, base_vm = _status("VmRSS"), _status("VmSize")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        if cap is not None:
            resource.setrlimit(resource.RLIMIT_AS, (base_vm + cap, resource.RLIM_INFINITY))
        times, error = [], None
        try:
            for _ in range(steps):
                start = time.perf_counter()
                pm.forward_backward(ids, ids)
                opt.step()
                opt.zero_grad()
                times.append(time.perf_counter() - start)
        except (MemoryError, RuntimeError) as e:  # torch reports a failed allocation as either
            error = f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
        store = getattr(pm.model_parts[0], "_meshkit_nvme_store", None)
        moments = sum(t.numel() * t.element_size() for p in pm.parameters()
                      for t in dict.get(opt.state, p, {}).values() if t.numel() > 1)
        return {"grew": _status("VmHWM") - base_rss, "vm_grew": _status("VmPeak") - base_vm, "times": times,
                "error": error, "steps": len(times), "moments": moments,
                "params": sum(p.numel() for p in pm.parameters()),
                "io": (store.bytes_read + store.bytes_written) / max(len(times), 1) if store else 0}


def _run(offload: str, steps: int, cap: int | None = None) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.nvme_offload", "--child", offload, "--steps", str(steps)]
    if cap is not None:
        cmd += ["--cap", str(cap)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    if done.returncode or not last.startswith("{"):
        return {"error": f"exit {done.returncode}: {(done.stderr.strip().splitlines() or [''])[-1][:100]}",
                "grew": 0, "vm_grew": 0, "times": [], "steps": 0, "io": 0, "moments": 0, "params": 0}
    return json.loads(last)


def main(argv: list[str] | None = None) -> int:
    """Measure both placements free and capped; print (and with --out write) the comparison."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", help="write the markdown report here")
    parser.add_argument("--child", choices=("optimizer", "nvme"), help=argparse.SUPPRESS)
    parser.add_argument("--cap", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.steps, args.cap)))
        return 0
    free = {name: _run(name, args.steps) for name in ("optimizer", "nvme")}
    cap = int(free["nvme"]["vm_grew"] * 1.1)
    capped = {name: _run(name, args.steps, cap) for name in ("optimizer", "nvme")}
    mib = 2**20

    def median_step(r: dict) -> str:
        return f"{statistics.median(r['times'][1:] or r['times']):.2f}" if r["times"] else "n/a"

    rows = [[name, f"{r['grew'] / mib:.0f}", median_step(r), f"{r['io'] / mib:.0f}", r["error"] or "-"]
            for name, r in free.items()]
    rows += [[f"{name}, address space capped at +{cap / mib:.0f} MiB", f"{r['grew'] / mib:.0f}",
              median_step(r), f"{r['io'] / mib:.0f}", f"{r['steps']} of {args.steps} steps; {r['error'] or 'ok'}"]
             for name, r in capped.items()]
    opt, nvme = free["optimizer"], free["nvme"]
    ratio_mem = nvme["grew"] / opt["grew"] if opt["grew"] else float("nan")
    ratio_time = statistics.median(nvme["times"][1:]) / statistics.median(opt["times"][1:]) \
        if len(nvme["times"]) > 1 and len(opt["times"]) > 1 else float("nan")
    lines = ["# NVMe offload vs host offload (one rank, CPU)", "",
             machine_line(f", {opt['params'] / 1e6:.0f}M parameters, AdamW moments {opt['moments'] / mib:.0f} MiB, "
                          f"batch {BATCH} x {SEQ}, {args.steps} steps"), "",
             f"Resident memory growth, NVMe / host offload: **{ratio_mem:.2f}**; step time, NVMe / host offload: "
             f"**{ratio_time:.2f}**. With the address space capped at what the NVMe run needed (+10%), below "
             f"AdamW's {opt['moments'] / mib:.0f} MiB of moments: host offload "
             f"{'fails' if capped['optimizer']['error'] else 'still runs'}, NVMe offload "
             f"{'fails' if capped['nvme']['error'] else 'runs'}.", "",
             *table(["offload", "RSS growth MiB (peak, from the built model)", "step s (median after the first)",
                     "file read + written per step MiB", "outcome"], rows)]
    emit(lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
