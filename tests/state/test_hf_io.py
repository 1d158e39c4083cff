"""HF checkpoints in and out: sharded loading that reads only what a rank holds, and exact export.

Import: the test process writes a tiny random HF model with `save_pretrained` (single file and
sharded; Mixtral and Qwen3-MoE in the per-expert format transformers writes), every rank builds the
model on meta, parallelizes it, loads the directory, and must hold exactly the original weights and
give the original model's loss; a recorder around `safe_open` shows which tensors each rank read.
Export: train one step under a plan, `save_hf_checkpoint`, and `from_pretrained` in the test process
must give the trained weights and identical logits.
"""

from __future__ import annotations

import re

import pytest
import torch
import transformers

import meshkit
from meshkit.models.hf_moe import to_hf_state_dict
from meshkit.state import hf_checkpoint as hf_io
from meshkit.testing.reference import BatchSpec, ModelSpec

LOSS_TOL = 1e-5
BATCH = BatchSpec(batch=4, seq=8)
EXPERT_KEY = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.")


class _Recorder:
    """`safe_open` that records every tensor name whose data a rank reads."""

    def __init__(self, real, reads: list[str]):
        self.real, self.reads = real, reads

    def __call__(self, *args, **kwargs):
        return _RecordingFile(self.real(*args, **kwargs), self.reads)


class _RecordingFile:
    def __init__(self, inner, reads: list[str]):
        self.inner, self.reads = inner, reads

    def __enter__(self):
        self.handle = self.inner.__enter__()
        return self

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)

    def get_slice(self, key):
        self.reads.append(key)
        return self.handle.get_slice(key)

    def get_tensor(self, key):
        self.reads.append(key)
        return self.handle.get_tensor(key)


def _local_rows(pm) -> slice:
    rows = BATCH.batch // pm.dp_size
    return slice(pm.dp_rank * rows, (pm.dp_rank + 1) * rows)


def _import_on_rank(spec: ModelSpec, plan: str, directory: str):
    reads: list[str] = []
    real = hf_io.safe_open
    hf_io.safe_open = _Recorder(real, reads)
    try:
        pm = meshkit.parallelize(spec.build(device="meta"), meshkit.Plan.from_string(plan))
        hf_io.load_hf_checkpoint(pm, directory)
    finally:
        hf_io.safe_open = real
    reference = spec.build()  # the same seed: the model the test process saved
    want = reference.state_dict()
    state = pm.full_state_dict()
    ids, labels = BATCH.make(spec.vocab)
    ref_loss = reference(input_ids=ids, labels=labels, use_cache=False).loss.item()
    rows = _local_rows(pm)
    if pm.plan.pp == 1:
        loss = pm.evaluate(ids[rows], labels[rows]).item()
    else:
        loss = pm.forward_backward(ids[rows], labels[rows]).item()
    return {"reads": reads, "held": [n for n, _ in pm.named_parameters()], "loss": loss, "ref_loss": ref_loss,
            "keys_match": sorted(state) == sorted(want),
            "differ": sorted(k for k in want if k in state and not torch.equal(state[k], want[k]))}


IMPORT_CASES = [
    pytest.param(ModelSpec(), "pp=2,dp_shard=2", "20KB", id="llama-sharded-pp2dp2"),
    pytest.param(ModelSpec(tied=True), "tp=2,dp_shard=2", None, id="llama-tied-single-file-tp2dp2"),
    pytest.param(ModelSpec(tied=True), "pp=2,dp_shard=2", None, id="llama-tied-pp2dp2"),
    pytest.param(ModelSpec(kind="qwen3"), "tp=2,dp_shard=2", "20KB", id="qwen3-sharded-tp2dp2"),
    pytest.param(ModelSpec(kind="mixtral", experts=4), "dp_shard=4,ep=2", "20KB", id="mixtral-sharded-dp4ep2"),
    pytest.param(ModelSpec(kind="qwen3_moe", experts=4), "dp_shard=2,tp=2,ep=2", None, id="qwen3moe-dp2tp2ep2"),
    # One expert per ep rank over two FSDP ranks: each rank reads half of one expert's rows.
    pytest.param(ModelSpec(kind="mixtral", experts=2), "dp_shard=4,ep=2", "20KB", id="mixtral-expert-rows-dp4ep2"),
]


@pytest.mark.parametrize(("spec", "plan", "shard_size"), IMPORT_CASES)
def test_load_hf_checkpoint(dist, tmp_path, spec, plan, shard_size):
    model = spec.build()
    model.save_pretrained(tmp_path, **({"max_shard_size": shard_size} if shard_size else {}))
    assert (tmp_path / ("model.safetensors.index.json" if shard_size else "model.safetensors")).is_file()
    file_keys = set()
    for path in tmp_path.glob("*.safetensors"):
        file_keys |= set(hf_io._read_header(path))
    results = dist(4).run(_import_on_rank, spec, plan, str(tmp_path))
    for rank, r in enumerate(results):
        assert r["keys_match"] and not r["differ"], f"rank {rank}: weights differ from the saved model: {r['differ']}"
        assert abs(r["loss"] - r["ref_loss"]) <= LOSS_TOL, f"rank {rank}: loss {r['loss']} vs HF {r['ref_loss']}"
        assert len(r["reads"]) == len(set(r["reads"])), f"rank {rank} read a tensor twice"
    if "pp=2" in plan:
        for rank, r in enumerate(results):
            # Llama's file keys are the model's names: a pipeline rank reads exactly its stage's tensors.
            assert set(r["reads"]) == set(r["held"]), f"rank {rank} read {set(r['reads']) ^ set(r['held'])}"
        assert set(results[0]["reads"]) != set(results[-1]["reads"])
    if spec.experts:
        assert any(EXPERT_KEY.match(k) for k in file_keys), "expected save_pretrained's per-expert format"
        per_rank_experts = []
        for r in results:
            experts = {(int(m[1]), int(m[2])) for m in map(EXPERT_KEY.match, r["reads"]) if m}
            per_rank_experts.append(experts)
            # Each rank holds num_experts / (ep x its FSDP share) experts per layer and reads only those.
            sharing = 4 if plan.startswith("dp_shard=4") else 2
            held_per_layer = max(1, spec.experts // sharing)
            assert len(experts) == spec.layers * held_per_layer, sorted(experts)
            if spec.experts < sharing:
                # Half an expert's rows: the gate or the up matrix (w1 / w3), and half of down (w2).
                assert sum(bool(EXPERT_KEY.match(k)) for k in r["reads"]) == 2 * spec.layers, r["reads"]
        assert set().union(*per_rank_experts) == {(i, e) for i in range(spec.layers) for e in range(spec.experts)}


def _export_on_rank(spec: ModelSpec, plan: str, directory: str):
    pm = meshkit.parallelize(spec.build(device="meta"), meshkit.Plan.from_string(plan))
    pm.load_full_state_dict(spec.build().state_dict())
    optimizer = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    ids, labels = BATCH.make(spec.vocab)
    rows = _local_rows(pm)
    pm.forward_backward(ids[rows], labels[rows])
    optimizer.step()
    hf_io.save_hf_checkpoint(pm, directory, max_shard_size="20KB")
    state = pm.full_state_dict()
    return state if torch.distributed.get_rank() == 0 else None


@pytest.mark.parametrize(
    ("spec", "plan"),
    [
        pytest.param(ModelSpec(), "pp=2,dp_shard=2", id="llama-pp2dp2"),
        pytest.param(ModelSpec(tied=True), "tp=2,dp_shard=2", id="llama-tied-tp2dp2"),
        pytest.param(ModelSpec(tied=True), "pp=2,tp=2", id="llama-tied-pp2tp2"),
        pytest.param(ModelSpec(kind="mixtral", experts=4), "dp_shard=4,ep=2", id="mixtral-dp4ep2"),
        pytest.param(ModelSpec(kind="qwen3_moe", experts=3), "dp_shard=4", id="qwen3moe-expert-rows-dp4"),
    ],
)
def test_save_hf_checkpoint_round_trips_through_from_pretrained(dist, tmp_path, spec, plan):
    trained = dist(4).run(_export_on_rank, spec, plan, str(tmp_path))[0]
    trained = to_hf_state_dict(trained, spec.config())
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa").eval()
    fresh = spec.build().eval()
    fresh.load_state_dict(trained)
    assert sorted(loaded.state_dict()) == sorted(trained)
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, trained[name]), f"{name} differs after from_pretrained"
    assert not torch.equal(fresh.state_dict()["model.norm.weight"], spec.build().state_dict()["model.norm.weight"])
    ids, _ = BATCH.make(spec.vocab)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, fresh(ids).logits)
    if spec.tied:
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight


def _export_refused(spec: ModelSpec, plan: str, directory: str) -> None:
    pm = meshkit.parallelize(spec.build(device="meta"), meshkit.Plan.from_string(plan))
    pm.init_weights(0)
    hf_io.save_hf_checkpoint(pm, directory)


def test_save_failure_on_rank_zero_raises_everywhere(dist, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    outcomes = dist(2).run_raw(_export_refused, ModelSpec(), "dp_shard=2", str(blocker / "export"))
    for o in outcomes:
        assert o.exc_type == "ValueError" and "rank 0 could not write" in o.message, o.traceback or o.message


def test_llama_moe_export_is_refused_on_every_rank(dist, tmp_path):
    outcomes = dist(2).run_raw(_export_refused, ModelSpec(experts=4), "dp_shard=2", str(tmp_path))
    for o in outcomes:
        assert o.exc_type == "ValueError" and "Llama-MoE" in o.message, o.traceback or o.message


def _import_mismatch(spec: ModelSpec, directory: str) -> None:
    pm = meshkit.parallelize(spec.build(device="meta"), meshkit.Plan.from_string("dp_shard=2"))
    hf_io.load_hf_checkpoint(pm, directory)


def test_mismatched_hf_checkpoint_raises_on_every_rank(dist, tmp_path):
    ModelSpec().build().save_pretrained(tmp_path)
    outcomes = dist(2).run_raw(_import_mismatch, ModelSpec(intermediate=32, tied=True), str(tmp_path))
    for o in outcomes:
        assert o.exc_type == "ValueError", o.traceback or o.message
        assert "model.layers.0.mlp.down_proj.weight: file (32, 48), model (32, 32)" in o.message
        assert "lm_head.weight" not in o.message  # tied: the file's head is simply not needed
