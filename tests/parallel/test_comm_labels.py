"""CommCounter names FSDP's collectives by the axis FSDP shards over, `dp_shard_cp`, under every plan:
also where that axis is one process group with `dp_shard` (cp = 1) or spans the whole world, so
the same FSDP degree gives the same label and the same bytes whether it is made of dp_shard alone
or of dp_shard x cp."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import meshkit
from meshkit.comm_counter import CommCounter
from meshkit.mesh import axis

MODEL = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=160, max_position_embeddings=64, use_cache=False)
# FSDP over 4 ranks made two ways (dp_shard_cp is the world's group, the same group as dp_shard's in
# the first), over 2 ranks beside tp (its own group, distinct from dp_shard's), and HSDP (2 x 2).
PLANS = ["dp_shard=4", "dp_shard=2,cp=2", "tp=2,dp_shard=2", "dp_replicate=2,dp_shard=2"]


def _fsdp_labels(plans: list[str]) -> dict[str, dict]:
    """Per plan: bytes per (kind, label) of the all-gathers and reduce-scatters of one step, the
    label FSDP's own group gets, and the axes that label stands for."""
    out = {}
    for plan in plans:
        torch.manual_seed(0)
        pm = meshkit.parallelize(LlamaForCausalLM(LlamaConfig(**MODEL)), meshkit.Plan.from_string(plan))
        pm.check_inputs = False
        ids = torch.randint(0, MODEL["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(0))
        with CommCounter(pm.mesh) as counter:
            pm.forward_backward(ids, ids)
        moved: dict[str, int] = {}
        for kind, label, nbytes in counter.events:
            if kind in ("all_gather", "reduce_scatter"):
                moved[f"{kind}@{label}"] = moved.get(f"{kind}@{label}", 0) + nbytes
        out[plan] = {"moved": moved, "fsdp_label": counter.label(axis(pm.mesh, "dp_shard_cp").get_group()),
                     "same_group": counter.same_group, "sizes": counter.sizes}
    return out


def test_fsdp_collectives_are_labelled_dp_shard_cp_under_every_plan(dist):
    results = dist(4).run(_fsdp_labels, PLANS)
    for rank, by_plan in enumerate(results):
        for plan, r in by_plan.items():
            where = f"{plan}, rank {rank}"
            assert r["fsdp_label"] == "dp_shard_cp", where
            assert r["moved"].get("all_gather@dp_shard_cp", 0) > 0, (where, r["moved"])
            assert r["moved"].get("reduce_scatter@dp_shard_cp", 0) > 0, (where, r["moved"])
            assert not any(k.endswith("@dp_shard") for k in r["moved"]), (where, r["moved"])
            fsdp_size = meshkit.Plan.from_string(plan).resolve(4)
            assert r["sizes"]["dp_shard_cp"] == fsdp_size.dp_shard * fsdp_size.cp, where
        # dp_shard alone over the world: dp_shard's group is FSDP's, and the label says which axes it stands for
        assert {"dp_shard_cp", "dp_shard"} <= set(by_plan["dp_shard=4"]["same_group"]["dp_shard_cp"])
        # the same 4-way FSDP, whichever axes make it: the same bytes under the same label
        fsdp = {p: {k: v for k, v in by_plan[p]["moved"].items() if k.endswith("@dp_shard_cp")}
                for p in ("dp_shard=4", "dp_shard=2,cp=2")}
        assert fsdp["dp_shard=4"] == fsdp["dp_shard=2,cp=2"], (rank, fsdp)
