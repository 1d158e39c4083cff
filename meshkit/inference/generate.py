"""`pm.generate`: autoregressive decoding on the sharded model, token for token HF's greedy output.

Every rank of the plan runs every step (FSDP gathers weights and expert parallelism exchanges
tokens across the data ranks, so a rank that stopped early would hang the others): the loop ends
when every data rank's rows are finished, and each rank then returns its own rows trimmed where HF
would have stopped. The next token is chosen from the full-vocabulary logits of the last position,
gathered over tp on the last pipeline stage and broadcast over pp, so every rank of a data rank's
group appends the same token.

KV cache: each rank keeps the keys and values of the attention layers it runs (its heads under tp,
its layers under pp) in `KVCache`, so a step runs only the new token. Under sequence parallelism the
new token is padded to tp positions (the padding's cache entries are dropped after the step).
Context parallelism has no cache: a cached sequence would have to follow the ring's layout as it
grows, so every step recomputes the whole sequence (padded to the layout's multiple) instead.

Sampling draws Gumbel noise from a CPU generator seeded with `seed`: the choice is
argmax(logits / temperature + noise) over the top_k tokens, which samples the softmax exactly, and
reproducibly for the same seed, prompts and plan.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from meshkit.context_parallel import sharding as cp_sharding
from meshkit.data_parallel.fsdp import reshard_fsdp
from meshkit.inference import forward
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


def _options_problem(max_new_tokens, temperature, top_k, eos: list[int], pad, vocab: int) -> str | None:
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        return f"max_new_tokens={max_new_tokens!r} must be an int >= 0"
    if temperature is None or not temperature >= 0:
        return f"temperature={temperature!r} must be >= 0 (0: greedy)"
    if top_k is not None and (not isinstance(top_k, int) or not 1 <= top_k <= vocab):
        return f"top_k={top_k!r} must be None or an int in [1, {vocab}]"
    bad = [t for t in [*eos, pad] if not isinstance(t, int) or not 0 <= t < vocab]
    if bad:
        return f"eos_token_id/pad_token_id {bad} must be token ids in [0, {vocab})"
    return None


def choose(logits_BV: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator) -> torch.Tensor:
    """The next token of every row: argmax when temperature is 0, else a softmax sample (Gumbel-max)."""
    if temperature == 0:
        return logits_BV.argmax(-1)
    scores = logits_BV.float() / temperature
    if top_k is not None:
        kth = torch.topk(scores, top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    uniform = torch.rand(scores.shape, generator=generator, dtype=torch.float64).clamp_(1e-20, 1.0 - 1e-16)
    gumbel = -torch.log(-torch.log(uniform))
    return (scores + gumbel.to(scores.device, scores.dtype)).argmax(-1)


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


@torch.no_grad()
def generate(pm: ParallelModel, prompt_ids: torch.Tensor, *, max_new_tokens: int, temperature: float = 0.0,
             top_k: int | None = None, eos_token_id: int | Iterable[int] | None = None,
             pad_token_id: int | None = None, seed: int = 0) -> torch.Tensor:
    """Prompt [B, P] -> [B, P + n] token ids, n <= max_new_tokens; see the module docstring."""
    vocab = pm.model.config.vocab_size
    eos = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    pad = pad_token_id if pad_token_id is not None else (eos[0] if eos else 0)
    problem = (forward.ids_problem(prompt_ids, None, pm.model.config, "prompt_ids")
               or _options_problem(max_new_tokens, temperature, top_k, eos, pad, vocab))
    forward.check_inputs(pm, prompt_ids, problem)
    plan = pm.plan
    tokens = prompt_ids.to(pm.device, torch.int64)
    batch = tokens.shape[0]
    unfinished = torch.ones(batch, dtype=torch.bool, device=pm.device)
    eos_ids = torch.tensor(eos, dtype=torch.int64, device=pm.device)
    generator = torch.Generator().manual_seed(seed)
    cache = KVCache() if plan.cp == 1 else None
    length = tokens.shape[1]  # HF's output length: the last step at which a local row was unfinished
    new, past = tokens, 0
    for _ in range(max_new_tokens):
        if eos and _everyone_finished(pm, unfinished):
            break
        inputs = forward.stage_inputs(pm, new, None, past=past)
        out = forward.run_stages(pm, inputs, cache)
        last = new.shape[1] - 1
        chosen = None
        if out is not None:
            chosen = choose(_last_logits(pm, inputs, last, out), temperature, top_k, generator).float()
        chosen = forward.to_every_pp_rank(pm, chosen, (batch,)).long()
        chosen = torch.where(unfinished, chosen, torch.full_like(chosen, pad))
        if bool(unfinished.any()):
            length = tokens.shape[1] + 1
        tokens = torch.cat([tokens, chosen[:, None]], dim=1)
        if eos:
            unfinished &= ~torch.isin(chosen, eos_ids)
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
