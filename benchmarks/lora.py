"""LoRA against full fine-tuning under the same plan, and meshkit's LoRA against the single-device
PeftModel (`python -m benchmarks.lora [--out benchmarks/results/lora.md] [--quick]`).

Four gloo ranks hold two copies of one seeded Llama-shaped model under each plan: one trains every
weight, the other is `peft.get_peft_model(model, LoraConfig(r, all seven linears))` with the base
frozen. Steps alternate between the two (AdamW, one step each per repetition), so load that drifts
across the run cancels in the per-repetition ratio. Per rank it reads the model state from the tensors
themselves (parameter shards, gradients, AdamW state), the activation bytes alive at the loss (every
storage created in the forward that still lives, parameters excluded) and meshkit's estimate of the
peak. On one process it then alternates the PEFT model itself (HF forward with labels, backward,
AdamW) with meshkit's single-device plan of the same PeftModel, on the same global batch: meshkit's
per-step overhead on LoRA. CPU times: ratios, not throughput claims.
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import time

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig

import meshkit
from benchmarks.launch import run_ranks, seeded_llama
from benchmarks.report import emit, machine_line, mib, ms, paired, table
from meshkit import estimate as est
from meshkit.integrations.peft.model import with_lora

MODEL = dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, vocab_size=4096, max_position_embeddings=256)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
R, WORLD, GLOBAL_BATCH, SEQ = 16, 4, 8, 128
PLANS = ["dp_shard=4", "tp=2,dp_shard=2", "pp=2,dp_shard=2,pp_schedule=zb_h1,pp_microbatches=2"]


def _lora(model):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=R, lora_alpha=2 * R, target_modules=TARGETS))


class _Live(TorchDispatchMode):
    """Weak references to every plain storage an op creates (DTensor ops come back as their local ops)."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: dict[int, StorageWeakRef] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if type(t) in (torch.Tensor, torch.nn.Parameter):
                ref = StorageWeakRef(t.untyped_storage())
                self.refs[ref.cdata] = ref
        return out

    def live(self, exclude: set[int]) -> int:
        gc.collect()
        return sum(torch.UntypedStorage._new_with_weak_ptr(r.cdata).nbytes()
                   for k, r in self.refs.items() if k not in exclude and not r.expired())


def _local(tensors) -> int:
    return sum((t.to_local() if hasattr(t, "to_local") else t).numel() * t.element_size()
               for t in tensors if t is not None)


def _keys(tensors) -> set[int]:
    return {StorageWeakRef(getattr(t, "_local_tensor", t).untyped_storage()).cdata for t in tensors}


def _activations_at_loss(pm, ids) -> int:
    """Bytes of the storages made in this forward still alive when the loss is computed."""
    from meshkit.step import loss as loss_lib

    original, mode, seen = loss_lib.summed_cross_entropy, _Live(), {}

    def snapshot(logits, targets):
        out = original(logits, targets)
        seen["bytes"] = mode.live(_keys(pm.parameters()) | _keys([logits]))
        return out

    loss_lib.summed_cross_entropy = snapshot
    try:
        with mode:
            pm.forward_backward(ids, ids)
    finally:
        loss_lib.summed_cross_entropy = original
    return seen.get("bytes", 0)


def measure(plan: str, steps: int) -> dict:
    """One rank: full fine-tuning and LoRA of the same model under `plan`, stepped alternately."""
    variants = {}
    for name, wrap in (("full", lambda m: m), ("lora", _lora)):
        pm = meshkit.parallelize(wrap(seeded_llama(MODEL)), meshkit.Plan.from_string(plan))
        pm.check_inputs = False
        opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=1e-4)
        variants[name] = (pm, opt, [])
    per = GLOBAL_BATCH // variants["full"][0].dp_size
    ids = torch.randint(0, MODEL["vocab_size"], (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    mine = ids[variants["full"][0].dp_rank * per:(variants["full"][0].dp_rank + 1) * per]
    for step in range(steps + 1):  # the first step creates the optimizer state and warms up
        for pm, opt, times in variants.values():
            start = time.perf_counter()
            pm.forward_backward(mine, mine)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if step:
                times.append(time.perf_counter() - start)
    out = {}
    for name, (pm, opt, times) in variants.items():
        params = list(pm.parameters())
        state = _local(params) + _local(v for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
        out[name] = {"times": times, "state": state, "activations": _activations_at_loss(pm, mine),
                     "trainable": sum(p.numel() for p in params if p.requires_grad),
                     "grads": _local(p.grad for p in params)}
        opt.zero_grad(set_to_none=True)
    return out


def single_device(steps: int) -> dict:
    """The PEFT model itself vs meshkit's single-device plan of it, alternated on one process."""
    ref = _lora(seeded_llama(MODEL))
    pm = meshkit.parallelize(copy.deepcopy(ref), meshkit.Plan())
    pm.check_inputs = False
    ids = torch.randint(0, MODEL["vocab_size"], (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    opts = {"peft": torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-4),
            "meshkit": torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=1e-4)}
    runs = {"peft": lambda: ref(input_ids=ids, labels=ids, use_cache=False).loss.backward(),
            "meshkit": lambda: pm.forward_backward(ids, ids)}
    times: dict[str, list[float]] = {k: [] for k in runs}
    for step in range(steps + 1):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            opts[name].step()
            opts[name].zero_grad(set_to_none=True)
            if step:
                times[name].append(time.perf_counter() - start)
    return times


def main(argv: list[str] | None = None) -> int:
    """Measure every plan and the single-device pair; print (and with --out write) the tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="markdown file to write")
    parser.add_argument("--quick", action="store_true", help="3 timed steps instead of 8")
    args = parser.parse_args(argv)
    steps = 3 if args.quick else 8
    config, lora_config = LlamaConfig(**MODEL), with_lora(LlamaConfig(**MODEL), R, TARGETS)
    rows = []
    for plan_text in PLANS:
        results = run_ranks(measure, WORLD, plan_text, steps)
        plan = meshkit.Plan.from_string(plan_text).resolve(WORLD)
        workload = est.Workload(SEQ, GLOBAL_BATCH // plan.dp // plan.microbatches, plan.microbatches)
        r = {k: max(results, key=lambda x: x[k]["state"])[k] for k in ("full", "lora")}  # the fullest rank
        peaks = {k: est.estimate(c, plan, WORLD, workload).peak_bytes for k, c in (("full", config),
                                                                                    ("lora", lora_config))}
        step_ratio = statistics.median(paired(x["lora"]["times"], x["full"]["times"]) for x in results)
        for name in ("full", "lora"):
            v = r[name]
            rows.append([plan_text, name, f"{v['trainable']:,}", ms(statistics.median(v["times"])),
                         mib(v["state"]), mib(v["grads"]), mib(v["activations"]), mib(peaks[name]),
                         f"{step_ratio:.2f}" if name == "lora" else "1.00",
                         f"{(v['state'] + v['activations']) / (r['full']['state'] + r['full']['activations']):.2f}"])
    single = single_device(steps)
    lines = ["# LoRA: against full fine-tuning under the same plan, and against the single-device PeftModel", "",
             machine_line(), "",
             f"Model: {MODEL}; LoRA r={R}, alpha={2 * R} on {', '.join(TARGETS)}; global batch {GLOBAL_BATCH} x "
             f"{SEQ} tokens, fp32, AdamW. {WORLD} gloo ranks on this machine's cores; full and LoRA steps alternate "
             f"({steps} timed steps each after one warm-up). Per plan the rank holding the most model state is "
             "shown. State: parameter shards + gradients + AdamW state read from the tensors after a step; "
             "activations: storages made in the forward still alive at the loss; estimate: meshkit.estimate's "
             "peak for that rank (h100 budget, this batch). Ratios: LoRA / full, per repetition then median "
             "(time), and (state + activations) for memory.", ""]
    lines += table(["plan", "variant", "trainable params (held)", "step ms", "state MiB", "grads MiB",
                    "activations MiB", "estimated peak MiB", "step time / full", "state+activations / full"], rows)
    peft_ms, mk_ms = statistics.median(single["peft"]), statistics.median(single["meshkit"])
    lines += ["Single device, the same PeftModel and batch, steps alternated:", ""]
    lines += table(["runner", "step ms", "ratio to the PeftModel (paired median)"],
                   [["peft.PeftModel (HF forward with labels, backward, AdamW)", ms(peft_ms), "1.00"],
                    ["meshkit.parallelize(peft_model, Plan())", ms(mk_ms),
                     f"{paired(single['meshkit'], single['peft']):.2f}"]])
    emit(lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
