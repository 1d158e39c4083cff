"""What `pm.generate` was asked to do, resolved as HF's `generate` resolves it, checked, and agreed.

Resolution: an argument given to `generate` wins; else the model's own `generation_config` (what
`from_pretrained` read from `generation_config.json`: eos, pad, and a chat model's sampling
defaults); else HF's global defaults (`GenerationConfig._get_default_generation_params`: greedy,
temperature 1, top_k 50, top_p 1, repetition penalty 1, max_length 20). So `pm.generate(ids)` stops
where `model.generate(ids)` stops, at the model's eos.

Agreement: every rank runs every decoding step (FSDP gathers, expert all-to-alls), so the number of
steps and whether rows can finish early must be the same on every rank, and the ranks that share a
data rank's rows (tp/cp/pp peers) must share prompts and every option. A rank asking for other
values would leave its peers waiting in a collective; instead every rank raises, each naming its
own values, before the first step (`refuse_on_every_rank`).
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from meshkit.step.batch import peer_agreement_problem
from meshkit.step.consensus import disagreement, raise_if_any

if TYPE_CHECKING:
    from meshkit.parallel_model import ParallelModel

__all__ = ["GenerateOptions", "StopStrings", "prompt_problem", "refuse_on_every_rank", "resolve_options"]

# HF's global defaults for the fields meshkit reads (transformers 5.x).
HF_DEFAULTS = {"do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.0,
               "max_length": 20}
SAMPLING_ONLY = ("temperature", "top_k", "top_p")


@dataclasses.dataclass(frozen=True)
class GenerateOptions:
    """The resolved options of one `generate` call."""

    max_new_tokens: int
    do_sample: bool
    temperature: float
    top_k: int | None
    top_p: float
    repetition_penalty: float
    eos: tuple[int, ...]
    pad: int | None
    stop_strings: tuple[str, ...]
    seed: int

    def loop_signature(self) -> list[int]:
        """What every rank must agree on: the number of steps, and whether a row can finish early."""
        return [self.max_new_tokens, int(bool(self.eos) or bool(self.stop_strings))]

    def peer_signature(self) -> list[int]:
        """Every option, as small integers (a checksum of their text), for the tp/cp/pp peers to compare."""
        crc = zlib.crc32(repr(dataclasses.astuple(self)).encode())
        return [crc >> 16, crc & 0xFFFF]


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    return (value,) if isinstance(value, int) else tuple(value)


def resolve_options(generation_config: Any, prompt_len: int, given: dict[str, Any]) -> tuple[GenerateOptions | None, str | None]:
    """(options, None) or (None, what is wrong); `given` holds the arguments the caller passed (None: not given)."""
    def pick(name: str) -> Any:
        if given.get(name) is not None:
            return given[name]
        own = getattr(generation_config, name, None) if generation_config is not None else None
        return own if own is not None else HF_DEFAULTS.get(name)

    max_new = pick("max_new_tokens")
    if max_new is None:
        max_new = max(pick("max_length") - prompt_len, 0)
    do_sample = pick("do_sample")
    eos = _ids(pick("eos_token_id"))
    pad = pick("pad_token_id")
    if pad is None and eos:
        pad = eos[0]  # HF pads finished rows with the first eos when no pad is set
    stops = given.get("stop_strings") if given.get("stop_strings") is not None else pick("stop_strings")
    stops = (stops,) if isinstance(stops, str) else tuple(stops or ())
    problem = _problem(given, max_new, do_sample, eos, pad, stops)
    if problem:
        return None, problem
    top_k = pick("top_k")
    return GenerateOptions(max_new, bool(do_sample), float(pick("temperature")), int(top_k) if top_k else None,
                           float(pick("top_p")), float(pick("repetition_penalty")), eos, pad, stops,
                           int(given.get("seed") or 0)), None


def _problem(given: dict[str, Any], max_new: Any, do_sample: Any, eos: tuple, pad: Any, stops: tuple) -> str | None:
    if not isinstance(max_new, int) or isinstance(max_new, bool) or max_new < 0:
        return f"max_new_tokens={max_new!r} must be an int >= 0"
    if not isinstance(do_sample, bool):
        return f"do_sample={do_sample!r} must be True or False"
    explicit = [k for k in SAMPLING_ONLY if given.get(k) is not None]
    if explicit and not do_sample:
        values = ", ".join(f"{k}={given[k]!r}" for k in explicit)
        return (f"{values} shape(s) sampling, but do_sample is False (greedy; HF's generate would ignore them "
                "with a warning); fix: do_sample=True to sample, or leave them out for greedy decoding")
    temperature, top_k, top_p = given.get("temperature"), given.get("top_k"), given.get("top_p")
    if temperature is not None and not (isinstance(temperature, (int, float)) and temperature > 0):
        return f"temperature={temperature!r} must be > 0 (greedy is do_sample=False)"
    if top_k is not None and (not isinstance(top_k, int) or top_k < 0):
        return f"top_k={top_k!r} must be an int >= 0 (0: no top-k)"
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        return f"top_p={top_p!r} must be in (0, 1]"
    penalty = given.get("repetition_penalty")
    if penalty is not None and not (isinstance(penalty, (int, float)) and penalty > 0):
        return f"repetition_penalty={penalty!r} must be > 0 (1: none)"
    if any(not isinstance(t, int) for t in [*eos, *([] if pad is None else [pad])]):
        return f"eos_token_id={list(eos)} / pad_token_id={pad!r} must be token ids"
    if any(not isinstance(s, str) or not s for s in stops):
        return f"stop_strings={list(stops)!r} must be non-empty strings"
    if stops and given.get("tokenizer") is None:
        return (f"stop_strings={list(stops)!r} need the tokenizer to read the generated text; fix: "
                "pm.generate(..., stop_strings=..., tokenizer=tok)")
    return None


def inferred_attention_mask(prompt_ids: torch.Tensor, options: GenerateOptions) -> torch.Tensor | None:
    """The mask HF's generate infers when none is given: the prompt's pad tokens are padding, if a pad
    token is set, is not an eos token, and occurs in the prompt (None: every token is real). Only as left
    padding, the one layout a decoder can continue: a pad id that also occurs inside or at the end of a
    row is taken as an ordinary token there, as before (HF would mask it, and warn of right padding)."""
    pad = options.pad
    if pad is None or pad in options.eos or not bool((prompt_ids == pad).any()):
        return None
    mask = (prompt_ids != pad).long()
    left_padding = bool((mask[:, 1:] >= mask[:, :-1]).all()) and bool(mask[:, -1].all())
    return mask if left_padding else None


def prompt_problem(prompt_ids: torch.Tensor, attention_mask: Any, options: GenerateOptions | None,
                   config: Any) -> str | None:
    """The attention mask (left padding only) and the room below `max_position_embeddings`."""
    vocab = config.vocab_size
    if options is not None:
        bad = [t for t in [*options.eos, *([] if options.pad is None else [options.pad])] if not 0 <= t < vocab]
        if bad:
            return f"eos_token_id/pad_token_id {bad} must be token ids in [0, {vocab})"
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != tuple(prompt_ids.shape):
            return (f"attention_mask must be a tensor of the prompt's shape {tuple(prompt_ids.shape)}, got "
                    f"{getattr(attention_mask, 'shape', type(attention_mask).__name__)}")
        mask = attention_mask.to(torch.int64)
        if bool(((mask != 0) & (mask != 1)).any()):
            return "attention_mask must hold 0 (padding) and 1 (token)"
        if bool((mask[:, 1:] < mask[:, :-1]).any()) or not bool(mask[:, -1].all()):
            return ("attention_mask pads on the right or in the middle; a decoder continues the last token, so "
                    "padding must be on the left; fix: tokenizer.padding_side = 'left'")
    limit = getattr(config, "max_position_embeddings", None)
    length = prompt_ids.shape[1] + (options.max_new_tokens if options is not None else 0)
    if limit is not None and length > limit:
        room = limit - prompt_ids.shape[1]
        fix = f"max_new_tokens <= {room}" if room > 0 else f"a prompt of at most {limit - 1} tokens"
        return (f"prompt of {prompt_ids.shape[1]} tokens + max_new_tokens={options.max_new_tokens if options else 0} "
                f"is above the model's max_position_embeddings={limit} (positions past it extrapolate the rotary "
                f"embedding silently); fix: {fix}")
    return None


def refuse_on_every_rank(pm: ParallelModel, prompt_ids: torch.Tensor, attention_mask: torch.Tensor | None,
          options: GenerateOptions | None, problem: str | None) -> None:
    """Raise on every rank if any rank's prompt or options are bad, or ranks disagree; else return.

    Every rank joins the same collectives whatever it found: the peers' comparison of prompts,
    masks and options (pp x cp x tp), then the world's comparison of the loop's shape, then one
    all-or-none reduction of the problems.
    """
    plan = pm.plan
    if plan.pp * plan.tp * plan.cp > 1:
        signed = None
        if problem is None:
            mask = torch.ones_like(prompt_ids) if attention_mask is None else attention_mask.to(prompt_ids.dtype)
            extra = torch.tensor(options.peer_signature(), dtype=prompt_ids.dtype).expand(prompt_ids.shape[0], 2)
            signed = torch.cat([prompt_ids.cpu(), mask.cpu(), extra], dim=1)
        if peer_agreement_problem(signed, pm.mesh, pm.device) and problem is None:
            problem = ("tp/cp/pp peers (ranks with the same pm.dp_rank) passed different prompts, attention_mask "
                       "or generation options; they decode the same rows, so they must pass identical ones")
    mine = options.loop_signature() if options is not None else [-1, -1]
    if disagreement(mine, device=pm.device) and problem is None:
        problem = (f"ranks passed different max_new_tokens or stopping conditions (this rank: max_new_tokens="
                   f"{options.max_new_tokens}, eos_token_id={list(options.eos)}, stop_strings="
                   f"{list(options.stop_strings)}); every rank runs every step, so max_new_tokens, and whether "
                   "eos_token_id or stop_strings are set, must be the same on every rank")
    raise_if_any(problem, device=pm.device)


class StopStrings:
    """Which rows end with a stop string, read from the decoded text as HF's `StopStringCriteria` reads it.

    A row stops when a stop string ends inside its newest token (its tail may lie in earlier tokens,
    the prompt's included): a string that is already whole before the newest token is past and stops
    nothing. Only the last tokens are decoded, enough for the longest string twice over plus slack,
    since byte-level tokens may decode to nothing on their own.
    """

    def __init__(self, strings: Iterable[str], tokenizer: Any):
        self.strings = tuple(strings)
        self.tokenizer = tokenizer
        self.window = 2 * max(len(s) for s in self.strings) + 4

    def hits(self, tokens_BT: torch.Tensor, valid_BT: torch.Tensor) -> torch.Tensor:
        """Bool [B]: the rows whose newest token completes a stop string."""
        out = []
        for row, valid in zip(tokens_BT.tolist(), valid_BT.tolist()):
            tail = [t for t, v in zip(row, valid) if v][-self.window:]
            before = self._decode(tail[:-1])
            text = self._decode(tail)
            common = 0
            while common < min(len(before), len(text)) and before[common] == text[common]:
                common += 1
            out.append(any((j := text.rfind(s)) >= 0 and j + len(s) > common for s in self.strings))
        return torch.tensor(out, dtype=torch.bool, device=tokens_BT.device)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
