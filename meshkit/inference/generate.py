"""`pm.generate`: autoregressive decoding on the sharded model, token for token HF's greedy output.

Options resolve as HF's `generate` resolves them (`inference.options`: the call's arguments, then the
model's `generation_config`, then HF's defaults), so decoding stops at the model's eos, pads finished
rows with its pad token, and honours `top_p`, `repetition_penalty` and `stop_strings` as HF does
(`inference.sampling` shapes the scores in HF's order). Every rank checks its prompt and options and
compares them with its peers before the first step, and all raise together on any problem.

Every rank of the plan runs every step (FSDP gathers weights and expert parallelism exchanges
tokens across the data ranks, so a rank that stopped early would hang the others): the loop ends
when every data rank's rows are finished, and each rank then returns its own rows trimmed where HF
would have stopped. The next token is chosen from the full-vocabulary logits of the last position,
gathered over tp on the last pipeline stage and broadcast over pp, so every rank of a data rank's
group appends the same token.

Left-padded prompts (`attention_mask`, rows of different lengths; without one, HF's inference from
the pad token: `options.inferred_attention_mask`): a row's padding is a document of its own, so
meshkit's block-diagonal attention keeps every real token away from it, and each row's positions
count its real tokens only, as HF's do. With a KV cache the padding stays in the
cache, and each step passes the document ids of the whole cached sequence so the new token's
attention skips it.

KV cache: each rank keeps the keys and values of the attention layers it runs (its heads under tp,
its layers under pp) in `KVCache`, so a step runs only the new token. Under sequence parallelism the
new token is padded to tp positions (the padding's cache entries are dropped after the step).
Context parallelism has no cache: a cached sequence would have to follow the ring's layout as it
grows, so every step recomputes the whole sequence (padded to the layout's multiple) instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshkit.context_parallel import sharding as cp_sharding
from meshkit.data_parallel.fsdp import reshard_fsdp
from meshkit.inference import forward, options, sampling
from meshkit.mesh import axis

if TYPE_CHECKING:
    from meshkit.parallel_model import ParallelModel


class KVCache:
    """Keys and values per attention layer, grown by HF's attention through `update`.

    Duck-types the one method HF's attention layers call on a cache (`update(key, value, layer_idx,
    ...)` returning the whole sequence's keys and values), which stays the same across transformers
    5.x while HF's own cache classes change.
    """

    def __init__(self):
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, key_BHSD: torch.Tensor, value_BHSD: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Append this step's keys and values of layer `layer_idx`; return the layer's whole sequence."""
        if layer_idx in self.layers:
            old_k, old_v = self.layers[layer_idx]
            key_BHSD, value_BHSD = torch.cat([old_k, key_BHSD], dim=2), torch.cat([old_v, value_BHSD], dim=2)
        self.layers[layer_idx] = (key_BHSD, value_BHSD)
        return key_BHSD, value_BHSD

    def keep(self, length: int) -> None:
        """Drop every position past `length` (the padding of the last step)."""
        self.layers = {i: (k[:, :, :length], v[:, :, :length]) for i, (k, v) in self.layers.items()}


def _last_logits(pm: ParallelModel, inputs: forward.StageInputs, last: int, out) -> torch.Tensor | None:
    """Full-vocabulary logits [B, V] of position `last` (of the padded sequence) on the last stage."""
    local = forward.local_logits(out)
    plan = pm.plan
    if plan.cp > 1:
        # One cp rank holds the position; the others contribute zeros to a sum over cp.
        held = cp_sharding.shard_indices(inputs.padded_len, plan.cp_layout, plan.cp,
                                         axis(pm.mesh, "cp").get_local_rank(), ulysses=plan.ulysses_degree)
        where = (held == last).nonzero()
        picked = (local[:, int(where[0, 0])] if len(where) else torch.zeros_like(local[:, 0])).contiguous()
        dist.all_reduce(picked, group=axis(pm.mesh, "cp").get_group())
    else:
        picked = local[:, last].contiguous()
    if forward.vocab_sharded(pm):
        parts = [torch.empty_like(picked) for _ in range(plan.tp)]
        dist.all_gather(parts, picked, group=axis(pm.mesh, "tp").get_group())
        picked = torch.cat(parts, dim=-1)
    return picked


def _decode_inputs(pm: ParallelModel, new_B1: torch.Tensor, position_B: torch.Tensor,
                   docs_BT: torch.Tensor) -> forward.StageInputs:
    """A cached step of left-padded rows: per-row positions, and the documents of every cached key
    (`docs_BT` already covers the new token; SP's padding positions join its document)."""
    multiple = pm.plan.seq_multiple()
    batch = new_B1.shape[0]
    steps = torch.arange(multiple, device=pm.device)
    ids = F.pad(new_B1, (0, multiple - 1))
    docs = torch.cat([docs_BT, docs_BT[:, -1:].expand(batch, multiple - 1)], dim=1)
    return forward.StageInputs(ids, position_B[:, None] + steps, docs, multiple)


@torch.no_grad()
def generate(pm: ParallelModel, prompt_ids: torch.Tensor, *, attention_mask: torch.Tensor | None = None,
             tokenizer: Any = None, **given: Any) -> torch.Tensor:
    """Prompt [B, P] -> [B, P + n] token ids, n <= max_new_tokens; see the module docstring.

    `given`: max_new_tokens, do_sample, temperature, top_k, top_p, repetition_penalty, eos_token_id,
    pad_token_id, stop_strings, seed (None: the model's generation config, then HF's default).
    """
    config = pm.model.config
    problem = forward.ids_problem(prompt_ids, None, config, "prompt_ids")
    opts = None
    if problem is None:
        opts, problem = options.resolve_options(getattr(pm.model, "generation_config", None), prompt_ids.shape[1],
                                        {**given, "tokenizer": tokenizer})
        if attention_mask is None and opts is not None:
            attention_mask = options.inferred_attention_mask(prompt_ids, opts)
        problem = problem or options.prompt_problem(prompt_ids, attention_mask, opts, config)
    options.refuse_on_every_rank(pm, prompt_ids, attention_mask, opts, problem)
    plan = pm.plan
    tokens = prompt_ids.to(pm.device, torch.int64)
    batch = tokens.shape[0]
    valid = (torch.ones_like(tokens) if attention_mask is None else attention_mask.to(pm.device)).bool()
    padded = not bool(valid.all())
    # Real tokens count 0, 1, ... from their row's first; padding counts on its own (a document apart).
    positions = torch.where(valid, valid.long().cumsum(1) - 1, torch.arange(tokens.shape[1], device=pm.device))
    docs = cp_sharding.document_ids(positions) if padded else None
    next_position = valid.long().sum(1)
    unfinished = torch.ones(batch, dtype=torch.bool, device=pm.device)
    eos_ids = torch.tensor(opts.eos, dtype=torch.int64, device=pm.device)
    stops = options.StopStrings(opts.stop_strings, tokenizer) if opts.stop_strings else None
    may_finish = bool(opts.eos) or stops is not None
    generator = torch.Generator().manual_seed(opts.seed)
    cache = KVCache() if plan.cp == 1 else None
    length = tokens.shape[1]  # HF's output length: the last step at which a local row was unfinished
    new, past = tokens, 0
    for _ in range(opts.max_new_tokens):
        if may_finish and _everyone_finished(pm, unfinished):
            break
        if past and padded:
            inputs = _decode_inputs(pm, new, next_position, docs)
        else:
            inputs = forward.stage_inputs(pm, new, positions if padded and not past else None, past=past)
        out = forward.run_stages(pm, inputs, cache)
        chosen = None
        if out is not None:
            scores = sampling.penalize_repetition(_last_logits(pm, inputs, new.shape[1] - 1, out), tokens, valid,
                                                  opts.repetition_penalty)
            chosen = sampling.choose(scores, do_sample=opts.do_sample, temperature=opts.temperature,
                                     top_k=opts.top_k, top_p=opts.top_p, generator=generator).float()
        chosen = forward.to_every_pp_rank(pm, chosen, (batch,)).long()
        if opts.eos:  # HF pads finished rows only when an eos can finish them
            chosen = torch.where(unfinished, chosen, torch.full_like(chosen, opts.pad))
        if bool(unfinished.any()):
            length = tokens.shape[1] + 1
        tokens = torch.cat([tokens, chosen[:, None]], dim=1)
        valid = torch.cat([valid, torch.ones_like(valid[:, :1])], dim=1)
        positions = torch.cat([positions, next_position[:, None]], dim=1)
        docs = torch.cat([docs, docs[:, -1:]], dim=1) if docs is not None else None
        next_position = next_position + 1
        if opts.eos:
            unfinished &= ~torch.isin(chosen, eos_ids)
        if stops is not None:
            unfinished &= ~stops.hits(tokens, valid)
        if cache is not None:
            past = tokens.shape[1] - 1
            cache.keep(past)
            new = chosen[:, None]
        else:
            new = tokens
    for part in pm.model_parts:
        reshard_fsdp(part)
    return tokens[:, :length]


def _everyone_finished(pm: ParallelModel, unfinished: torch.Tensor) -> bool:
    """Whether no data rank has an unfinished row (peers in tp/cp/pp share this rank's rows)."""
    left = unfinished.any().to(torch.int32).reshape(1)
    dp = axis(pm.mesh, "dp")
    if dp.size() > 1:
        dist.all_reduce(left, op=dist.ReduceOp.MAX, group=dp.get_group())
    return not bool(left.item())
