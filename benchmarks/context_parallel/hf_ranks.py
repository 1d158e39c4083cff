"""One gloo rank of the context-parallel benchmark: the HF-model step, and `run`, the entry each rank runs.

Every rank of a world runs `run(spec)` (through `benchmarks.launch`) and returns its numbers; the
parent (`__main__`) turns them into tables. The HF step is a tiny Llama through `meshkit.parallelize`
per CP kind, against the plain HF model and torch's experimental CP where it runs.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

import meshkit
from benchmarks.context_parallel.ranks import (
    Groups,
    allgather_attention,
    attention_time_section,
    count_section,
    cp_mesh,
    interleave,
    memory_section,
    torch_cp_probe_section,
    usp_name,
)
from benchmarks.context_parallel.recording import return_big_frees_to_os
from meshkit._compat.peers import torch_context_parallel

Tensor = torch.Tensor


def llama_config(spec: dict) -> Any:
    """A fresh config per model: parallelize re-points a config's attention implementation."""
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
        """Attention of this rank's queries over the gathered K/V; packed documents refused (the baseline has no masks)."""
        if doc_ids is not None:
            raise ValueError("the all-gather baseline does not do packed documents")
        return allgather_attention(q, k, v, self.group, scale)


def build_meshkit(spec: dict, kind: str, ulysses: int) -> Any:
    """parallelize a meta-initialised Llama with cp = world; kind 'all-gather KV' reuses the ring's
    contiguous sharding and swaps the attention."""
    with torch.device("meta"):
        model = LlamaForCausalLM(llama_config(spec))
    P = dist.get_world_size()
    cp_kind = "ring" if kind == "all-gather KV" else kind.split(" ")[0]
    plan = meshkit.Plan(cp=P, cp_attention=cp_kind, cp_ulysses=ulysses if cp_kind == "usp" else 1,
                        cp_keep_kv=False)  # the ring kinds as tabulated: K/V re-sent in backward
    pm = meshkit.parallelize(model, plan)
    pm.init_weights(0)
    if kind == "all-gather KV":
        for stage in pm.model_parts:
            stage.context_parallel = NaiveCP(dist.group.WORLD)
    return pm


def meshkit_step(pm: Any, ids: Tensor) -> float:
    """One meshkit training step without the optimizer, so only forward and backward are timed."""
    loss = pm.forward_backward(ids, ids)
    for p in pm.parameters():
        p.grad = None
    return float(loss)


def plain_step(model: Any, ids: Tensor) -> float:
    """The same step on the unparallelized HF model, the single-process peer."""
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


def probe_hf_torch_cp(spec: dict) -> None:
    """Try one HF step under torch's experimental CP in a world of its own; raise what torch raises.

    Ranks may fail at different points (HF builds an attention mask on some load-balanced shards and
    not on others), leaving peers inside a collective that never completes; a throwaway world keeps
    that from wrecking the measuring one, and the pool reports each rank's own exception (a failed
    rank closes its sockets, so its peers fail at once instead of at the gloo timeout).
    """
    warnings.filterwarnings("ignore")
    plain = LlamaForCausalLM(llama_config(spec))
    ids = torch.randint(0, spec["model"]["vocab"], (spec["shape"]["batch"], spec["shape"]["seq"]),
                        generator=torch.Generator().manual_seed(7))
    torch_cp_step(plain, cp_mesh(), ids)


def run(spec: dict) -> dict[str, Any]:
    """One rank's measurements of every section `spec` asks for (every rank of the pool runs it)."""
    warnings.filterwarnings("ignore")
    return_big_frees_to_os()
    world = dist.get_world_size()
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
    return mine
