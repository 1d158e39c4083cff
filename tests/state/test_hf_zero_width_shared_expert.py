"""HF round trip of MoE blocks whose shared expert has zero width (DeepSeek-V3 with n_shared_experts=0,
Qwen2-MoE with shared_expert_intermediate_size=0).

HF builds such a shared expert all the same, with empty weights (and Qwen2-MoE its [1, H] sigmoid
gate); the converted `MoE` leaves them out (FSDP2 cannot shard empty tensors; they add exactly zero).
HF's own `save_pretrained` writes the empty tensors, and `from_pretrained` of a directory without them
reports them MISSING and initialises them (harmless, but not the directory HF would write). So the
export writes them back (the dead gate as zeros), and the import accepts them: HF save -> meshkit
load (strict) -> the same logits as HF's model -> meshkit export -> `from_pretrained` with nothing
missing or unexpected, every tensor equal (the gate aside) and logits identical to the original's.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers

import meshkit
from meshkit.models.hf_moe import to_hf_state_dict
from meshkit.models.moe import convert_moe_blocks
from meshkit.state import hf_checkpoint as hf_io
from meshkit.testing.families import family_spec
from meshkit.testing.reference import BatchSpec, ModelSpec

LOGIT_TOL = 1e-5
BATCH = BatchSpec(batch=4, seq=8)
ZERO_WIDTH = {"deepseek_v3": {"n_shared_experts": 0}, "qwen2_moe": {"shared_expert_intermediate_size": 0}}
DEAD_GATE = ".mlp.shared_expert_gate.weight"  # Qwen2-MoE's gate of a zero-width shared expert


def _spec(kind: str) -> ModelSpec:
    spec = family_spec(kind, seed=0)
    zero = ZERO_WIDTH[kind]
    return dataclasses.replace(spec, extra=tuple((k, zero.get(k, v)) for k, v in spec.extra))


def _shared_keys(state: dict) -> set[str]:
    return {k for k in state if ".shared_expert" in k}


@pytest.mark.parametrize("kind", sorted(ZERO_WIDTH))
def test_export_state_has_every_hf_key(kind):
    """One process: a converted model's state, mapped to HF's keys, loads strictly into the HF class."""
    spec = _spec(kind)
    hf, converted = spec.build(), spec.build()
    convert_moe_blocks(converted)
    hf_state, state = hf.state_dict(), converted.state_dict()
    assert _shared_keys(hf_state) and not _shared_keys(state), "the test needs a zero-width shared expert"
    exported = to_hf_state_dict(state, converted.config)
    assert sorted(exported) == sorted(hf_state)
    for name, value in hf_state.items():
        assert exported[name].shape == value.shape and exported[name].dtype == value.dtype, name
        if not name.endswith(DEAD_GATE):
            assert torch.equal(exported[name], value), name
    fresh = spec.build()
    fresh.load_state_dict(exported, strict=True)
    ids, _ = BATCH.make(spec.vocab)
    with torch.no_grad():
        assert torch.equal(fresh.eval()(ids).logits, hf.eval()(ids).logits)


def _round_trip_on_rank(spec: ModelSpec, plan: str, source: str, target: str) -> dict:
    pm = meshkit.parallelize(spec.build(device="meta"), meshkit.Plan.from_string(plan))
    hf_io.load_hf_checkpoint(pm, source)  # strict: HF's empty shared-expert tensors are accepted
    ids, _ = BATCH.make(spec.vocab)
    rows = BATCH.batch // pm.dp_size
    mine = slice(pm.dp_rank * rows, (pm.dp_rank + 1) * rows)
    logits = pm.forward(ids[mine], gather=True)
    hf_io.save_hf_checkpoint(pm, target)
    return {"rows": (mine.start, mine.stop), "logits": logits}


@pytest.mark.parametrize("kind, plan", [
    ("deepseek_v3", "dp_shard=4,ep=2"),
    pytest.param("qwen2_moe", "dp_shard=2,tp=2,ep=2", marks=pytest.mark.slow),  # the same path, with TP
])
def test_hf_save_meshkit_load_and_export_round_trip(dist, tmp_path, kind, plan):
    spec = _spec(kind)
    original = spec.build().eval()
    original.save_pretrained(tmp_path / "hf")
    results = dist(4).run(_round_trip_on_rank, spec, plan, str(tmp_path / "hf"), str(tmp_path / "meshkit"))
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "meshkit", attn_implementation="sdpa", output_loading_info=True)
    assert not any(info.values()), f"from_pretrained of the export: {info}"
    want, got = original.state_dict(), loaded.state_dict()
    assert sorted(got) == sorted(want)
    assert _shared_keys(got)
    differ = [k for k in want if not k.endswith(DEAD_GATE) and not torch.equal(got[k], want[k])]
    assert not differ, f"tensors changed by the round trip: {differ}"
    ids, _ = BATCH.make(spec.vocab)
    with torch.no_grad():
        hf_logits = loaded.eval()(ids).logits
        assert torch.equal(hf_logits, original(ids).logits)
    for rank, r in enumerate(results):
        start, stop = r["rows"]
        err = (r["logits"] - hf_logits[start:stop]).abs().max().item()
        assert err <= LOGIT_TOL, f"rank {rank}: meshkit's logits differ from HF's by {err:.3g}"
