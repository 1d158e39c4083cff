"""A LoRA model's files: base weights in from `save_pretrained`, the adapter out in PEFT's format (loaded
by `PeftModel.from_pretrained` to the same logits) and back in under another plan, the merged model out
(`merge_and_unload`'s, loaded by `from_pretrained` alone), and an adapter saved for another base refused
on every rank."""

from __future__ import annotations

import json

import torch
import transformers
from peft import PeftModel

import meshkit
from meshkit.testing.reference import BatchSpec, LoraSpec, ModelSpec

BATCH = BatchSpec(batch=4, seq=8)
SPEC = ModelSpec(lora=LoraSpec(targets=("q_proj", "v_proj", "o_proj", "up_proj", "down_proj")))
BASE = ModelSpec()  # the same seed: SPEC's base weights


def _rows(pm) -> slice:
    per = BATCH.batch // pm.dp_size
    return slice(pm.dp_rank * per, (pm.dp_rank + 1) * per)


def _train_and_export(plan: str, adapter_dir: str, merged_dir: str):
    """One AdamW step from SPEC's weights, then both exports; the logits of this rank's rows."""
    pm = meshkit.parallelize(SPEC.build(device="meta"), meshkit.Plan.from_string(plan))
    pm.load_full_state_dict(SPEC.build().state_dict())
    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=1e-2, eps=1e-3)
    ids, labels = BATCH.make(SPEC.vocab)
    rows = _rows(pm)
    pm.forward_backward(ids[rows], labels[rows])
    opt.step()
    pm.save_hf_checkpoint(adapter_dir)
    pm.save_hf_checkpoint(merged_dir, merge=True)
    state = pm.full_state_dict()
    return rows, pm.forward(ids[rows], gather=True), state if torch.distributed.get_rank() == 0 else None


def _load_under_another_plan(plan: str, base_dir: str, adapter_dir: str):
    pm = meshkit.parallelize(SPEC.build(device="meta"), meshkit.Plan.from_string(plan))
    pm.load_hf_checkpoint(base_dir)
    pm.load_hf_checkpoint(adapter_dir)
    ids, _ = BATCH.make(SPEC.vocab)
    rows = _rows(pm)
    return rows, pm.forward(ids[rows], gather=True)


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def test_adapter_and_merged_exports_load_with_peft_and_transformers(dist, tmp_path):
    adapter_dir, merged_dir, base_dir, peft_dir = (tmp_path / n for n in ("adapter", "merged", "base", "peft"))
    results = dist(4).run(_train_and_export, "pp=2,tp=2", str(adapter_dir), str(merged_dir))
    ids, _ = BATCH.make(SPEC.vocab)
    loaded = PeftModel.from_pretrained(BASE.build(), adapter_dir).eval()
    want = _logits(loaded, ids)
    for rows, logits, _ in results:
        assert (logits - want[rows]).abs().max().item() < 1e-5

    # The same files PeftModel.save_pretrained writes for the same trained model.
    trained = SPEC.build()
    trained.load_state_dict(results[0][2])
    trained.save_pretrained(peft_dir)
    ours, theirs = (json.loads((d / "adapter_config.json").read_text()) for d in (adapter_dir, peft_dir))
    for config in (ours, theirs):  # a set in PEFT's config: written in hash order
        config["target_modules"] = sorted(config["target_modules"])
    assert ours == theirs
    from safetensors.torch import load_file
    ours, theirs = load_file(adapter_dir / "adapter_model.safetensors"), load_file(peft_dir / "adapter_model.safetensors")
    assert sorted(ours) == sorted(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)

    merged = transformers.AutoModelForCausalLM.from_pretrained(merged_dir, attn_implementation="sdpa").eval()
    assert not any("lora" in k for k in merged.state_dict())
    assert (_logits(merged, ids) - _logits(loaded.merge_and_unload(), ids)).abs().max().item() < 1e-5

    # Back in, from the base's save_pretrained directory and the adapter directory, under another plan.
    BASE.build().save_pretrained(base_dir)
    for rows, logits in dist(4).run(_load_under_another_plan, "dp_shard=2,tp=2", str(base_dir), str(adapter_dir)):
        assert (logits - want[rows]).abs().max().item() < 1e-5


def _meta_then_base(plan: str, base_dir: str):
    """The README's flow: a meta PeftModel, base weights from files, adapters drawn as PEFT draws them."""
    spec = ModelSpec(lora=LoraSpec(b_nonzero=False))
    pm = meshkit.parallelize(spec.build(device="meta"), meshkit.Plan.from_string(plan))
    pm.load_hf_checkpoint(base_dir)
    state = pm.full_state_dict()
    ids, _ = BATCH.make(spec.vocab)
    rows = _rows(pm)
    return rows, pm.forward(ids[rows], gather=True), state


def test_base_checkpoint_into_a_meta_lora_model(dist, tmp_path):
    BASE.build().save_pretrained(tmp_path)
    base = BASE.build().eval()
    want = _logits(base, BATCH.make(BASE.vocab)[0])
    for rows, logits, state in dist(4).run(_meta_then_base, "pp=2,dp_shard=2", str(tmp_path)):
        assert (logits - want[rows]).abs().max().item() < 1e-5  # B = 0: the base model's function
        for name, t in state.items():
            if ".lora_A." in name:  # kaiming-uniform as nn.Linear (PEFT's default): bound 1/sqrt(in)
                bound = 1 / t.shape[1] ** 0.5
                assert t.abs().max() <= bound and t.abs().max() > 0.5 * bound and t.std() > 0.3 * bound, name
            elif ".lora_B." in name:
                assert not t.any(), name


def _load_adapter(adapter_dir: str) -> None:
    pm = meshkit.parallelize(SPEC.build(device="meta"), meshkit.Plan.from_string("dp_shard=2"))
    pm.init_weights(0)
    pm.load_hf_checkpoint(adapter_dir)


def test_adapter_for_another_base_is_refused_on_every_rank(dist, tmp_path):
    other = ModelSpec(head_dim=4, lora=SPEC.lora).build()  # hidden 16, not 32
    other.save_pretrained(tmp_path / "hidden")
    other_r = ModelSpec(lora=LoraSpec(r=2, targets=SPEC.lora.targets)).build()
    other_r.save_pretrained(tmp_path / "rank")
    for sub, needle in (("hidden", "shape mismatches"), ("rank", "r=2")):
        for o in dist(2).run_raw(_load_adapter, str(tmp_path / sub)):
            assert o.exc_type == "ValueError" and "saved for another base" in o.message, o.traceback or o.message
            assert needle in o.message and "fix:" in o.message, o.message


def _init_both(plan: str):
    from meshkit.state.names import hf_name, is_adapter

    states = []
    for spec in (ModelSpec(lora=LoraSpec(b_nonzero=False)), BASE):
        pm = meshkit.parallelize(spec.build(device="meta"), meshkit.Plan.from_string(plan))
        pm.init_weights(seed=3)
        states.append(pm.full_state_dict())
    lora, plain = states
    base_equal = all(torch.equal(t, plain[hf_name(n)]) for n, t in lora.items() if not is_adapter(n))
    return base_equal, {n: t for n, t in lora.items() if is_adapter(n)}


def test_init_weights_draws_the_base_as_hf_and_the_adapters_as_peft(dist):
    for base_equal, adapters in dist(2).run(_init_both, "tp=2"):
        assert base_equal, "the base of a LoRA model must equal the plain model's init at the same seed"
        for name, t in adapters.items():
            if ".lora_A." in name:
                bound = 1 / t.shape[1] ** 0.5
                assert 0.5 * bound < t.abs().max() <= bound, name
            else:
                assert not t.any(), name
