"""`pm.generate` options as HF's `generate` means them: the model's generation config by default (eos,
pad), left-padded prompts with an attention mask, repetition penalty and stop strings, token for token
against HF's own generate on the unsharded model; the sampling steps against HF's logits processors and
an independent top-k; options that differ between ranks, prompts past max_position_embeddings and
right padding refused on every rank before any step."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer
from transformers.generation.logits_process import (
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import meshkit
from meshkit.data.tokenizer import train_bpe
from meshkit.inference.sampling import choose, penalize_repetition, shape_scores
from meshkit.testing.reference import ModelSpec

SPEC = ModelSpec(layers=2, vocab=300)
NEW = 8


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    train_bpe(["the quick brown fox jumps over the lazy dog, again and again"] * 4, 290, path)
    return str(path)


def _left_padded(batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of different lengths, left-padded with token 0, and their attention mask."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, SPEC.vocab, (batch, 9), generator=gen)
    mask = torch.ones_like(ids)
    for row, pad in enumerate([0, 3, 5, 1][:batch]):
        ids[row, :pad], mask[row, :pad] = 0, 0
    return ids, mask


def _generate_like_hf(plan: str, tokenizer_dir: str) -> dict:
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    reference = SPEC.build().eval()
    model = SPEC.build()
    ids, mask = _left_padded(4, seed=5)
    # An eos the model emits a few steps in (row 0, greedy), set in both models' generation configs only:
    # pm.generate must read it there, as model.generate does.
    reference.generation_config.eos_token_id = None
    free = reference.generate(ids[:1], max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    eos = int(free[0, ids.shape[1] + 3])
    for m in (reference, model):
        m.generation_config.eos_token_id, m.generation_config.pad_token_id = eos, 1
    pm = meshkit.parallelize(model, meshkit.Plan.from_string(plan))
    rows = slice(pm.dp_rank * 2, pm.dp_rank * 2 + 2)
    ids, mask = ids[rows], mask[rows]
    stop = tok.decode(free[0, ids.shape[1] + 1:ids.shape[1] + 3])  # two tokens the free run emits
    calls = {
        "defaults": ({}, {}),
        "left padding, penalty": ({"attention_mask": mask, "repetition_penalty": 1.3},
                                  {"attention_mask": mask, "repetition_penalty": 1.3}),
        # no mask given: HF infers it from the pad token (0 here, not an eos) in the prompt
        "mask from pad tokens": ({"pad_token_id": 0}, {"pad_token_id": 0}),
        "stop strings": ({"stop_strings": [stop], "tokenizer": tok, "eos_token_id": []},
                         {"stop_strings": [stop], "tokenizer": tok, "eos_token_id": None}),
    }
    out = {}
    for name, (mine, theirs) in calls.items():
        got = pm.generate(ids, max_new_tokens=NEW, **mine)
        if name == "stop strings":
            reference.generation_config.eos_token_id = None
        want = reference.generate(ids, max_new_tokens=NEW, do_sample=False, **theirs)
        out[name] = (got.tolist(), want.tolist())
    out["stopped early"] = pm.dp_rank != 0 or eos in out["defaults"][0][0][ids.shape[1]:]
    return out


@pytest.mark.parametrize("plan", ["tp=2,dp_shard=2", "pp=2,cp=2,cp_attention=zigzag"])
def test_greedy_generation_equals_hf_generate_with_its_options(dist, tokenizer_dir, plan):
    """tp x fsdp decodes with a KV cache and SP-padded steps; pp x cp recomputes the whole (cp-sharded)
    sequence each step: both must stop, pad and penalize exactly as HF does."""
    for rank, r in enumerate(dist(4).run(_generate_like_hf, plan, tokenizer_dir)):
        assert r.pop("stopped early"), f"{plan}, rank {rank}: the generation config's eos did not stop row 0"
        for name, (got, want) in r.items():
            assert got == want, f"{plan}, rank {rank}, {name}: {got} vs HF {want}"


def test_sampling_steps_equal_hf_logits_processors():
    """Repetition penalty (left padding excluded), temperature, top-k, top-p on the same logits: the
    tokens each keeps and their scores equal HF's processors', for random logits, histories, settings."""
    gen = torch.Generator().manual_seed(0)
    for trial in range(40):
        batch, vocab, length = 3, 50, 7
        logits = torch.randn(batch, vocab, generator=gen) * 3
        tokens = torch.randint(0, vocab, (batch, length), generator=gen)
        pads = torch.tensor([0, 2, 4])
        valid = torch.arange(length)[None, :] >= pads[:, None]
        penalty = float(torch.empty(()).uniform_(0.7, 1.6, generator=gen))
        temperature = float(torch.empty(()).uniform_(0.3, 2.0, generator=gen))
        top_k = int(torch.randint(1, vocab, (), generator=gen))
        top_p = float(torch.empty(()).uniform_(0.05, 1.0, generator=gen))
        hf = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(penalty, prompt_ignore_length=pads),
                                  TemperatureLogitsWarper(temperature), TopKLogitsWarper(top_k),
                                  TopPLogitsWarper(top_p)])(tokens, logits.clone())
        mine = shape_scores(penalize_repetition(logits, tokens, valid, penalty), temperature=temperature,
                            top_k=top_k, top_p=top_p)
        assert torch.equal(torch.isinf(mine), torch.isinf(hf)), f"trial {trial}: different tokens kept"
        kept = ~torch.isinf(hf)
        torch.testing.assert_close(mine[kept], hf[kept], rtol=1e-6, atol=1e-6)


def test_top_k_draws_exactly_the_k_best_tokens():
    """The set of sampled tokens is the independent top-k of the logits: none outside, every one inside
    (a top-k that kept k-1 or k+1 tokens would show); the (k+1)-th is nearly as likely as the k-th."""
    rng = np.random.default_rng(0)
    for k in (1, 3, 7):
        logits = rng.normal(size=64)
        order = np.argsort(-logits, kind="stable")
        logits[order[:k + 1]] = 4.0 + 0.01 * np.arange(k + 1)[::-1]  # the k best and the next, close together
        expected = set(np.argsort(-logits, kind="stable")[:k].tolist())
        generator = torch.Generator().manual_seed(k)
        batch = torch.tensor(logits, dtype=torch.float32).expand(4000, -1)
        drawn = set(choose(batch, do_sample=True, top_k=k, generator=generator).tolist())
        assert drawn == expected, f"top_k={k}: drew {sorted(drawn)}, the top {k} are {sorted(expected)}"


REFUSALS = {
    "max_new_tokens": "different max_new_tokens or stopping conditions (this rank: max_new_tokens=3",
    "peer options": "passed different prompts, attention_mask or generation options",
    "too long": "is above the model's max_position_embeddings=256",
    "right padding": "padding must be on the left",
    "sampling option without sampling": "temperature=0.7 shape(s) sampling, but do_sample is False",
}


def _refusals() -> dict[str, str]:
    """Each bad call on every rank, in turn: every rank must raise (and so stay in step for the next)."""
    model = SPEC.build()
    pm = meshkit.parallelize(model, meshkit.Plan.from_string("tp=2,dp_shard=2"))
    rank = torch.distributed.get_rank()
    ids = torch.randint(3, SPEC.vocab, (2, 6), generator=torch.Generator().manual_seed(pm.dp_rank))
    right = torch.ones_like(ids)
    right[0, -2:] = 0
    calls = {
        "max_new_tokens": dict(max_new_tokens=3 if pm.dp_rank == 1 else 2),  # tp peers agree, data ranks do not
        "peer options": dict(max_new_tokens=2, do_sample=True, top_p=0.5 if rank == 1 else 0.9),
        "too long": dict(max_new_tokens=model.config.max_position_embeddings - 3),
        "right padding": dict(max_new_tokens=2, attention_mask=right),
        "sampling option without sampling": dict(max_new_tokens=2, temperature=0.7),
    }
    raised = {}
    for case, kwargs in calls.items():
        try:
            pm.generate(ids, **kwargs)
            raised[case] = "returned"
        except ValueError as err:
            raised[case] = str(err)
    return raised


def test_bad_or_disagreeing_generation_options_raise_on_every_rank(dist):
    for rank, raised in enumerate(dist(4).run(_refusals, timeout=120.0)):
        for case, message in REFUSALS.items():
            assert message in raised[case], f"{case}, rank {rank}: {raised[case]}"
