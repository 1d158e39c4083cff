"""`pm.forward` and `pm.generate`: logits and greedy tokens equal to the single-device HF model under
tp x fsdp, cp (zig-zag, Ulysses; Gemma 2's soft-cap and window in the zig-zag ring), pp and
expert-parallel MoE plans (DeepSeek-V3's latent attention over tp); seeded sampling reproducible;
under pp the HF module's own forward refused with a pointer to them and its generate `pm.generate`;
bad inputs refused everywhere."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

import meshkit
from meshkit.inference.sampling import choose
from meshkit.testing.families import family_spec
from meshkit.testing.reference import ModelSpec

LOGITS_TOL = 2e-5  # fp32, logits of order 1; independent of the rank count
DENSE = ModelSpec(layers=4, vocab=96)
MOE = ModelSpec(layers=2, intermediate=16, experts=4, top_k=2, vocab=96)
MIXTRAL = ModelSpec(kind="mixtral", layers=2, intermediate=16, experts=4, top_k=2, vocab=96)
GEMMA2 = family_spec("gemma2", vocab=96)  # soft-capping and a window shorter than the generated text
GPT_OSS = family_spec("gpt_oss", vocab=96)  # sinks split over tp, windows, biased experts over ep, KV cache
# Latent attention split by heads over tp, its latent KV cache. A vocabulary whose prompts hold no pad id
# (0): HF's generate would infer an attention mask hiding it, which meshkit's does not.
DEEPSEEK = family_spec("deepseek_v3", vocab=100)
BATCH, SEQ, NEW = 4, 7, 6  # an odd length: every plan that splits the sequence must pad it


def _prompts(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))


def _rows(pm) -> slice:
    per = BATCH // pm.dp_size
    return slice(pm.dp_rank * per, (pm.dp_rank + 1) * per)


def _use_on_rank(plan: str, spec: ModelSpec) -> dict:
    reference = spec.build()
    pm = meshkit.parallelize(spec.build(), meshkit.Plan.from_string(plan))
    ids = _prompts(spec.vocab)
    rows = _rows(pm)
    with torch.no_grad():
        ref_logits = reference(input_ids=ids, use_cache=False).logits
    logits = pm.forward(ids[rows], gather=True)
    sharded = pm.forward(ids[rows])
    if isinstance(sharded, DTensor):
        sharded = sharded.full_tensor()
    # An eos the reference emits in this data rank's first row after a few steps: generation must stop
    # that row and pad it, and the data ranks finish at different steps.
    reference.generation_config.eos_token_id = None
    free = reference.generate(ids[rows], max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    eos = int(free[0, SEQ + 2])
    ref_tokens = reference.generate(ids[rows], max_new_tokens=NEW, do_sample=False, eos_token_id=eos, pad_token_id=0)
    tokens = pm.generate(ids[rows], max_new_tokens=NEW, eos_token_id=eos, pad_token_id=0)
    return {"logits": (logits - ref_logits[rows]).abs().max().item(),
            "sharded": (sharded - ref_logits[rows]).abs().max().item(),
            "shape": tuple(logits.shape),
            "tokens": tokens.tolist(), "ref_tokens": ref_tokens.tolist()}


@pytest.mark.parametrize(
    "plan, spec",
    [
        ("tp=2,dp_shard=2", DENSE),
        ("cp=2,dp_shard=2,cp_attention=zigzag", DENSE),
        ("cp=2,tp=2,cp_attention=ulysses", DENSE),
        ("pp=2,dp_shard=2", DENSE),
        ("pp=2,tp=2,pp_schedule=interleaved_1f1b,pp_virtual_stages=2", DENSE),
        ("dp_shard=2,tp=2,ep=2", MOE),
        ("pp=2,dp_shard=2,ep=2", MIXTRAL),
        ("tp=2,dp_shard=2", GEMMA2),
        ("tp=2,dp_shard=2,ep=2", GPT_OSS),
        ("cp=2,dp_shard=2,cp_attention=zigzag", GEMMA2),
        ("tp=2,dp_shard=2,ep=2", DEEPSEEK),
    ],
)
def test_logits_and_greedy_tokens_match_the_single_device_model(dist, plan, spec):
    for rank, r in enumerate(dist(4).run(_use_on_rank, plan, spec)):
        assert r["shape"][1:] == (SEQ, spec.vocab), f"{plan}, rank {rank}: logits shape {r['shape']}"
        assert r["logits"] <= LOGITS_TOL, f"{plan}, rank {rank}: logits differ by {r['logits']:.3g}"
        assert r["sharded"] <= LOGITS_TOL, f"{plan}, rank {rank}: vocab-sharded logits differ by {r['sharded']:.3g}"
        assert r["tokens"] == r["ref_tokens"], f"{plan}, rank {rank}: {r['tokens']} vs HF {r['ref_tokens']}"


def _sample_on_rank(plan: str, spec: ModelSpec) -> dict:
    reference = spec.build()
    pm = meshkit.parallelize(spec.build(), meshkit.Plan.from_string(plan))
    ids = _prompts(spec.vocab)[_rows(pm)]
    sampled = dict(max_new_tokens=NEW, do_sample=True, temperature=0.8, top_k=10, eos_token_id=[])
    first = pm.generate(ids, **sampled, seed=7)
    again = pm.generate(ids, **sampled, seed=7)
    other = pm.generate(ids, **sampled, seed=8)
    # The same draw on the single-device model, step by step without a cache.
    generator, tokens = torch.Generator().manual_seed(7), ids
    with torch.no_grad():
        for _ in range(NEW):
            logits = reference(input_ids=tokens, use_cache=False).logits[:, -1]
            chosen = choose(logits, do_sample=True, temperature=0.8, top_k=10, generator=generator)
            tokens = torch.cat([tokens, chosen[:, None]], dim=1)
    return {"first": first.tolist(), "again": again.tolist(), "other": other.tolist(), "ref": tokens.tolist()}


@pytest.mark.parametrize("plan", ["tp=2,dp_shard=2", "pp=2,cp=2,cp_attention=zigzag"])
def test_sampling_is_reproducible_under_a_seed(dist, plan):
    for rank, r in enumerate(dist(4).run(_sample_on_rank, plan, DENSE)):
        assert r["first"] == r["again"], f"{plan}, rank {rank}: same seed, different samples"
        assert r["first"] == r["ref"], f"{plan}, rank {rank}: {r['first']} vs single device {r['ref']}"
        assert r["first"] != r["other"], f"{plan}, rank {rank}: another seed drew the same {NEW} tokens"


def _hf_module_after_parallelize(plan: str) -> dict:
    model = DENSE.build()
    pm = meshkit.parallelize(model, meshkit.Plan.from_string(plan))
    ids = _prompts(DENSE.vocab)[:2]
    tokens = model.generate(input_ids=ids, max_new_tokens=3, pad_token_id=0)  # pm.generate under every plan
    same = torch.equal(tokens, pm.generate(ids, max_new_tokens=3, pad_token_id=0))
    try:
        model(input_ids=ids)
    except ValueError as err:
        return {"same": same, "refused": str(err)}
    return {"same": same, "refused": None}


def test_pipelined_hf_forward_points_to_pm_and_generate_is_pm_generate(dist):
    """pp > 1: no rank holds the whole model, so `model(...)` names what runs instead (the pp = 1
    forward is `tests/parallel/test_hf_forward.py`'s); `model.generate` is `pm.generate`."""
    for rank, r in enumerate(dist(4).run(_hf_module_after_parallelize, "pp=2,dp_shard=2", timeout=60.0)):
        assert r["same"], f"rank {rank}: model.generate differs from pm.generate"
        assert r["refused"] and "pm.forward_backward" in r["refused"] and "pm.forward(" in r["refused"], r


def _bad_generate() -> None:
    pm = meshkit.parallelize(DENSE.build(), meshkit.Plan.from_string("tp=2,dp_shard=2"))
    ids = _prompts(DENSE.vocab)[:2]
    rank = torch.distributed.get_rank()
    if rank == 3:
        ids[0, 0] = DENSE.vocab
    pm.generate(ids, max_new_tokens=-1 if rank == 0 else 2)


def test_bad_generation_input_raises_on_every_rank(dist):
    """Rank 3's token is outside the vocabulary, rank 0 asks for -1 tokens: every rank names both."""
    for o in dist(4).run_raw(_bad_generate, timeout=30.0):
        assert not o.ok and o.exc_type == "ValueError", f"rank {o.rank}: {o.exc_type}: {o.message}"
        assert "rank 3: prompt_ids hold token ids" in o.message and "rank 0: max_new_tokens=-1" in o.message, o.message
