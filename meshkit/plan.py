"""The Plan: how many ranks each parallelism gets, and the options that shape it.

A Plan is plain data. It is checked twice: on its own when built (bad option values), and against a
model, a world size and a sequence length by `validate` (divisibility), which every rank runs on
identical inputs before any collective, so every rank raises the same ValueError instead of some
ranks hanging in a collective that the failing rank never joins.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from meshkit.activation_checkpoint import AC_MODES
from meshkit.context_parallel import rules as cp_rules
from meshkit.context_parallel.sharding import required_multiple
from meshkit.data_parallel.rules import memory_problems
from meshkit.float8 import rules as float8_rules
from meshkit.models import roles
from meshkit.models import rules as model_rules
from meshkit.pipeline import rules as pp_rules
from meshkit.pipeline.auto import memory_limit_problem
from meshkit.pipeline.schedules import SCHEDULES as PP_SCHEDULES
from meshkit.pipeline.schedules import stage_chunks, stages_per_rank

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DEGREES = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")
CP_ATTENTION = ("auto", "ring", "zigzag", "allgather", "ulysses", "usp")  # auto: context_parallel/rules.choose_cp
# The dtype names a plan takes (param_dtype, reduce_dtype) and the torch dtypes they mean.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class PlanError(ValueError):
    """A plan that cannot run; the message lists every violation with its fix."""

    @classmethod
    def of(cls, *problems: str) -> PlanError:
        """The error for these violations, one line each, in the one format every plan check uses."""
        return cls("Plan is invalid:\n" + "\n".join(f"  - {p}" for p in problems))


@dataclass(frozen=True)
class Plan:
    """Degrees of every parallelism plus the options that shape them.

    Degrees multiply to the world size, except `ep`, which folds over `dp_shard * cp` (experts reuse
    data/context ranks). `dp_shard=-1` takes whatever the other degrees leave of the world.
    """

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    sequence_parallel: bool = True
    loss_parallel: bool = True
    activation_checkpointing: str = "none"
    param_dtype: str = "float32"
    reduce_dtype: str = "float32"
    reshard_after_forward: bool | None = None
    compile: bool = False
    cp_attention: str = "auto"
    cp_ulysses: int = 1
    cp_keep_kv: bool | None = None
    pp_schedule: str = "1f1b"
    pp_microbatches: int | None = None
    pp_virtual_stages: int = 1
    pp_split: tuple[int, ...] = ()
    # zb_auto only: the most microbatches' activations a rank may hold at once (None: pp), and the per-action
    # costs F/B/W[/P2P] to build the schedule from (empty: measured on the first forward_backward).
    pp_memory_limit: int | None = None
    pp_costs: tuple[float, ...] = ()
    # Memory (docs/data_parallel.md): the ZeRO stage on dp_shard, when gradients cross ranks, what lives on the
    # host (or, with offload="nvme", in files under offload_dir), saved activations on the host, float8 linears.
    zero: int = 3
    grad_sync: str = "every_microbatch"
    offload: str = "none"
    offload_dir: str | None = None
    activation_offload: bool = False
    float8: str = "none"

    def __post_init__(self) -> None:
        problems = []
        for name in DEGREES:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                problems.append(f"{name}={value!r}: must be an int; fix: pass e.g. {name}=2")
            elif value < 1 and not (name == "dp_shard" and value == -1):
                fill = " (or -1 to fill the world)" if name == "dp_shard" else ""
                problems.append(f"{name}={value}: must be >= 1{fill}; fix: use a positive degree")
        if self.activation_checkpointing not in AC_MODES:
            problems.append(
                f"activation_checkpointing={self.activation_checkpointing!r}: must be one of {AC_MODES}"
            )
        if self.cp_attention not in CP_ATTENTION:
            problems.append(f"cp_attention={self.cp_attention!r}: must be one of {CP_ATTENTION}")
        if not isinstance(self.cp_ulysses, int) or isinstance(self.cp_ulysses, bool) or self.cp_ulysses < 1:
            problems.append(f"cp_ulysses={self.cp_ulysses!r}: must be a positive int")
        if self.pp_schedule not in PP_SCHEDULES:
            problems.append(f"pp_schedule={self.pp_schedule!r}: must be one of {PP_SCHEDULES}")
        for name in ("pp_virtual_stages",) + (("pp_microbatches",) if self.pp_microbatches is not None else ()):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                problems.append(f"{name}={value!r}: must be a positive int")
        if isinstance(self.pp_split, list):
            object.__setattr__(self, "pp_split", tuple(self.pp_split))
        elif isinstance(self.pp_split, str):  # "4/8/12", as strings and flags write it (a TOML preset too)
            object.__setattr__(self, "pp_split", _parse_value(type(self), "pp_split", self.pp_split))
        if not isinstance(self.pp_split, tuple) or not all(isinstance(b, int) for b in self.pp_split):
            problems.append(f"pp_split={self.pp_split!r}: must be a list of first-layer indices, e.g. [4, 8, 12] "
                            f"(or \"4/8/12\")")
        if isinstance(self.pp_costs, str | list):  # "1/2/1/0.1", as strings and flags write it
            object.__setattr__(self, "pp_costs", _parse_value(type(self), "pp_costs", self.pp_costs)
                               if isinstance(self.pp_costs, str) else tuple(self.pp_costs))
        problems += _costs_problems(self.pp_costs)
        limit_problem = memory_limit_problem(self.pp_memory_limit)
        if limit_problem:
            problems.append(limit_problem)
        for name in ("param_dtype", "reduce_dtype"):
            if getattr(self, name) not in DTYPES:
                problems.append(f"{name}={getattr(self, name)!r}: must be one of {tuple(DTYPES)}")
        for name in ("sequence_parallel", "loss_parallel", "compile", "cp_keep_kv", "activation_offload"):
            if not isinstance(getattr(self, name), bool) and not (name == "cp_keep_kv" and self.cp_keep_kv is None):
                problems.append(f"{name}={getattr(self, name)!r}: must be true or false")
        if self.reshard_after_forward is not None and not isinstance(self.reshard_after_forward, bool):
            problems.append(f"reshard_after_forward={self.reshard_after_forward!r}: must be a bool or None")
        problems += memory_problems(self)
        problems += float8_rules.float8_problems(self)
        _raise(problems)

    # ------------------------------------------------------------------ sizes
    def resolve(self, world_size: int) -> Plan:
        """Return a copy with `dp_shard=-1` replaced by what the other degrees leave of the world."""
        if self.dp_shard != -1:
            return self
        others = self.pp * self.dp_replicate * self.cp * self.tp
        if world_size % others:
            raise PlanError.of(
                f"dp_shard=-1 cannot fill world_size={world_size}: the other degrees "
                f"multiply to {others}, which does not divide it; fix: launch a multiple of {others} "
                f"processes or change pp/dp_replicate/cp/tp"
            )
        return dataclasses.replace(self, dp_shard=world_size // others)

    @property
    def world_size(self) -> int:
        """Ranks the plan needs (requires `dp_shard` resolved)."""
        if self.dp_shard == -1:
            raise PlanError("dp_shard=-1 is unresolved; call plan.resolve(world_size) first")
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many distinct batches one step sees."""
        return self.dp_replicate * self.dp_shard

    # ------------------------------------------------------------- validation
    def validate(self, model_config: Any = None, world_size: int | None = None, seq_len: int | None = None) -> Plan:
        """Check the plan against a model config, a world size and a sequence length.

        Pure and deterministic: every rank runs it on identical arguments before any collective, so
        a bad plan raises the same `PlanError` (a ValueError) everywhere. Returns the resolved plan.
        """
        problems: list[str] = []
        plan = self
        if world_size is not None:
            if not isinstance(world_size, int) or world_size < 1:
                raise PlanError.of(f"world_size={world_size!r}: must be a positive int")
            plan = self.resolve(world_size)
            if plan.world_size != world_size:
                problems.append(
                    f"world_size={world_size}: the plan needs pp*dp_replicate*dp_shard*cp*tp = "
                    f"{plan.pp}*{plan.dp_replicate}*{plan.dp_shard}*{plan.cp}*{plan.tp} = {plan.world_size} "
                    f"processes; fix: launch `torchrun --nproc-per-node {plan.world_size}` or set dp_shard=-1"
                )
        unsupported = model_rules.unsupported_config(model_config) if model_config is not None else None
        if model_config is not None and not unsupported:
            plan = plan.resolve_cp(model_config)
        problems += cp_rules.cp_problems(plan)
        problems += pp_rules.pp_problems(plan)
        if (plan.dp_shard * plan.cp) % plan.ep:
            problems.append(
                f"ep={plan.ep}: expert parallelism folds over dp_shard x cp = {plan.dp_shard * plan.cp} ranks and must "
                f"divide it (it never adds ranks of its own); fix: ep in "
                f"{[d for d in range(1, plan.dp_shard * plan.cp + 1) if (plan.dp_shard * plan.cp) % d == 0]}"
            )
        if plan.tp > 1 and plan.compile is True:
            problems.append(
                f"compile=True with tp={plan.tp}: on torch 2.13 a compiled block under tensor parallel hands back "
                "plain-tensor gradients for its DTensor inputs and backward fails inside DTensor's redistribute; "
                "fix: compile=False, or tp=1 (compile runs under FSDP, HSDP and pipeline parallel)"
            )
        if plan.param_dtype == "float32" and plan.reduce_dtype != "float32":
            problems.append(
                f"reduce_dtype={plan.reduce_dtype!r} with param_dtype='float32': reducing in lower precision "
                "than the parameters loses gradient bits for nothing; fix: reduce_dtype='float32'"
            )
        if model_config is not None:
            if unsupported:
                problems.append(unsupported)
            else:
                problems += model_rules.model_problems(plan, model_config)
                problems += pp_rules.layer_problems(plan, model_config)
                problems += cp_rules.head_problems(plan, model_config)
                problems += float8_rules.config_problems(plan, model_config)
        if seq_len is not None:
            if not isinstance(seq_len, int) or seq_len < 2:
                problems.append(f"seq_len={seq_len!r}: need at least 2 tokens to predict one")
            else:
                problem = plan.seq_len_problem(seq_len)
                if problem:
                    problems.append(f"seq_len={seq_len}: {problem}")
        _raise(problems)
        return plan

    def resolve_cp(self, model_config: Any = None) -> Plan:
        """Return a copy whose `cp_attention` / `cp_keep_kv` left open ("auto" / None) are chosen for this
        model (`context_parallel.rules.choose_cp`: the byte minimum the memory allows); the reason
        reads back from `cp_choice` and `describe()`. Plans without context parallelism stay as they are."""
        if self.cp == 1 or (self.cp_attention != "auto" and self.cp_keep_kv is not None):
            return self
        shape = None if model_config is None else \
            cp_rules.AttentionShape(model_config.hidden_size, *roles.kernel_dims(model_config))
        choice = cp_rules.choose_cp(self, shape)
        plan = dataclasses.replace(self, cp_attention=choice.kind, cp_keep_kv=choice.keep_kv)
        object.__setattr__(plan, "_cp_choice", choice.why or None)
        return plan

    @property
    def cp_choice(self) -> str | None:
        """Why the context-parallel kind and keep-K/V are what they are, when meshkit chose them."""
        return getattr(self, "_cp_choice", None)

    @property
    def microbatches(self) -> int:
        """Microbatches per pipeline step (`pp_microbatches`, defaulting to the stage count; 1 without pipelining)."""
        if self.pp_microbatches is not None:
            return self.pp_microbatches
        return self.pp * self.pp_stages_per_rank if self.pp > 1 else 1

    @property
    def pp_stages_per_rank(self) -> int:
        """Stages each pipeline rank holds: `pp_virtual_stages`, but always two under the V schedules
        (zb_v, dualpipe_v), whose placement is the V itself, and under DualPipe (one per direction)."""
        return stages_per_rank(self.pp_schedule, self.pp_virtual_stages)

    @property
    def pp_chunks(self) -> int:
        """How many pieces the layers are cut into (`pp_split` names the first layer of all but the first):
        one per stage, except under DualPipe, whose two directions run the same pp chunks."""
        if self.pp == 1:
            return 1
        return max(stage_chunks(self.pp_schedule, self.pp, self.pp_virtual_stages)) + 1

    @property
    def fsdp_reshard(self) -> bool:
        """Whether FSDP frees gathered parameters after forward: `reshard_after_forward`, by default yes
        unless pipelining, whose microbatches would otherwise re-gather them once each; never under
        ZeRO-1/2, whose parameters stay replicated through forward and backward."""
        if self.zero < 3:
            return False
        return self.reshard_after_forward if self.reshard_after_forward is not None else self.pp == 1

    @property
    def cp_layout(self) -> str:
        """How the sequence is cut over cp: zig-zag balances causal work; Ulysses needs contiguous pieces
        ("auto" before `resolve_cp` reads as the zig-zag ring, its choice when no model says otherwise)."""
        return "zigzag" if self.cp_attention in ("auto", "zigzag", "allgather", "usp") else "contiguous"

    @property
    def ulysses_degree(self) -> int:
        """How many cp ranks exchange heads by all-to-all (all of cp for Ulysses, cp_ulysses for USP and
        the all-gather kind's 2D variant)."""
        if self.cp_attention == "ulysses":
            return self.cp
        return self.cp_ulysses if self.cp_attention in ("usp", "allgather") else 1

    def seq_multiple(self) -> int:
        """Sequence lengths must be a multiple of this: cp's layout times the SP split of each cp shard."""
        cp_multiple = required_multiple(self.cp_layout, self.cp, ulysses=self.ulysses_degree) if self.cp > 1 else 1
        sp = self.tp if self.tp > 1 and self.sequence_parallel else 1
        return math.lcm(cp_multiple, self.cp * sp)

    def seq_len_problem(self, seq_len: int) -> str | None:
        """Why this plan cannot split `seq_len` tokens, with the fix, or None."""
        need = self.seq_multiple()
        if seq_len % need == 0:
            return None
        why = []
        if self.cp > 1:
            why.append(f"cp={self.cp} with cp_attention={self.cp_attention!r} ({self.cp_layout} layout)")
        if self.tp > 1 and self.sequence_parallel:
            why.append(f"sequence parallelism over tp={self.tp}")
        verb = "needs" if len(why) == 1 else "need"
        return (f"{' and '.join(why)} {verb} a multiple of {need} tokens; fix: pad or cut sequences to "
                f"{math.ceil(seq_len / need) * need} tokens" + (", or set sequence_parallel=false"
                                                                   if self.cp == 1 else ""))

    # ------------------------------------------------------------ load / dump
    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        """Build from a mapping; unknown keys are an error naming the known ones."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise PlanError.of(f"unknown option(s) {unknown}; known options: {sorted(known)}")
        return cls(**dict(data))

    @classmethod
    def from_toml(cls, source: str | Path | Mapping[str, Any], table: str = "plan") -> Plan:
        """Load from a TOML file (its `[plan]` table, or the top level if it has none) or parsed dict."""
        if isinstance(source, Mapping):
            data = dict(source)
        else:
            with open(source, "rb") as f:
                data = tomllib.load(f)
        if table in data and isinstance(data[table], Mapping):
            data = dict(data[table])
        return cls.from_dict(data)

    @classmethod
    def from_string(cls, text: str) -> Plan:
        """Parse the compact form `"tp=2,dp_shard=-1,activation_checkpointing=full"`."""
        data: dict[str, Any] = {}
        for item in filter(None, (s.strip() for s in text.split(","))):
            if "=" not in item:
                raise PlanError.of(f"{item!r}: expected key=value, e.g. tp=2")
            key, value = (s.strip() for s in item.split("=", 1))
            data[key] = _parse_value(cls, key, value)
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        """Plain mapping of every field (TOML-serialisable except None values)."""
        return dataclasses.asdict(self)

    def to_string(self) -> str:
        """The compact form `from_string` reads back to an equal Plan: every field off its default."""
        parts = []
        for f in fields(self):
            value = getattr(self, f.name)
            if value == f.default or (f.name in ("pp_split", "pp_costs") and not value):
                continue
            if f.name in ("pp_split", "pp_costs"):
                value = "/".join(str(v) for v in value)
            elif value is None:
                value = "none"
            elif isinstance(value, bool):
                value = str(value).lower()
            parts.append(f"{f.name}={value}")
        return ",".join(parts)

    def describe(self) -> str:
        """One line naming the non-trivial degrees, for logs; with cp, the attention kind, whether the
        ring keeps K/V, and why when meshkit chose them (`resolve_cp`)."""
        parts = [f"{d}={getattr(self, d)}" for d in DEGREES if getattr(self, d) != 1]
        line = ",".join(parts) or "single device"
        if self.cp > 1:
            keep = {True: ", K/V kept", False: ", K/V resent"}.get(self.cp_keep_kv, "") \
                if self.cp_attention in ("ring", "zigzag") else ""
            why = f"; chosen: {self.cp_choice}" if self.cp_choice else ""
            line += f" (cp_attention={self.cp_attention}{keep}{why})"
        return line

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Add one `--<option>` flag per field (all default to "not given", so TOML values survive)."""
        group = parser.add_argument_group("meshkit plan")
        for f in fields(cls):
            flag = "--" + f.name.replace("_", "-")
            # SUPPRESS: a flag not given leaves no attribute, so help shows no misleading "default: None".
            group.add_argument(flag, dest=f"plan_{f.name}", default=argparse.SUPPRESS, metavar=f.name.upper(),
                               help=f"Plan.{f.name}; built-in default {f.default!r} (a TOML plan may set another)")
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, base: Plan | None = None) -> Plan:
        """Overlay the flags given on the command line on `base` (a TOML-loaded plan, say)."""
        data = (base or cls()).to_dict()
        for f in fields(cls):
            raw = getattr(args, f"plan_{f.name}", None)
            if raw is not None:
                data[f.name] = _parse_value(cls, f.name, raw)
        return cls.from_dict(data)


def _parse_value(cls: type, key: str, value: str) -> Any:
    types = {f.name: f.type for f in fields(cls)}
    if key not in types:
        raise PlanError.of(f"unknown option {key!r}; known options: {sorted(types)}")
    kind = str(types[key])
    lowered = value.lower()
    if key == "pp_split":
        try:
            return tuple(int(x) for x in value.replace("/", " ").split())
        except ValueError:
            raise PlanError.of(f"pp_split={value!r}: write first-layer indices as 4/8/12") from None
    if key == "pp_costs":
        try:
            return tuple(float(x) for x in value.replace("/", " ").split())
        except ValueError:
            raise PlanError.of(f"pp_costs={value!r}: write the times of F, B, W (and P2P) as 1/2/1/0.1") from None
    if any(sep in value for sep in ("=", " ", ";")):  # "tp=2 dp_shard=2": options run together
        raise PlanError.of(f"{key}={value!r}: one option per key=value, separated by commas; fix: write "
                           f"e.g. \"tp=2,dp_shard=-1\"")
    if kind.startswith("int"):
        if "None" in kind and lowered in ("none", "null", "auto", ""):
            return None
        try:
            return int(value)
        except ValueError:
            raise PlanError.of(f"{key}={value!r}: must be an int") from None
    if kind.startswith("str") and "None" in kind and lowered in ("none", "null", ""):
        return None
    if "bool" in kind:
        if lowered in ("none", "null", "auto") and "None" in kind:
            return None
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise PlanError.of(f"{key}={value!r}: must be true or false")
    return value


def _costs_problems(costs: Any) -> list[str]:
    """`pp_costs` must be the times of F, B and W, optionally P2P: positive numbers (P2P may be 0)."""
    numbers = isinstance(costs, tuple) and all(isinstance(c, int | float) and not isinstance(c, bool) for c in costs)
    if numbers and (not costs or (len(costs) in (3, 4) and all(c > 0 for c in costs[:3]) and min(costs) >= 0)):
        return []
    return [f"pp_costs={costs!r}: must be the times of F, B and W and optionally the P2P latency, in any one unit "
            f"(F, B, W > 0, P2P >= 0), e.g. \"1/2/1/0.1\"; or empty to measure them on the first step"]


def _raise(problems: Sequence[str]) -> None:
    if problems:
        raise PlanError.of(*problems)
