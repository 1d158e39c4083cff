"""The recipe's configuration: a TOML preset ([model], [plan], [train], [data], [peft]) with command-line
flags on top, and the Hugging Face model config it describes. `train_llama.py` runs it."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from transformers import AutoConfig, AutoModelForCausalLM

import meshkit
from meshkit.integrations.peft.model import with_lora

# ----------------------------------------------------------------------------------------- config


@dataclass
class TrainConfig:
    """The [train] table. Sizes are per data-parallel rank; the global batch is dp * local_batch * grad_accum."""

    steps: int = 40
    seq_len: int = 64
    local_batch: int = 4
    grad_accum: int = 1
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 5
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    clip: float = 1.0  # max gradient norm; 0 disables clipping (the norm is still logged)
    seed: int = 0
    log_dir: str = "runs"
    name: str = ""  # run name under log_dir; default: <config stem>-<timestamp>
    log_every: int = 1
    profile: bool = False  # torch.profiler trace of a few steps into <log_dir>/<name>/profile
    peak_tflops: float = 0.0  # per-device peak for MFU; 0 picks a preset (metrics.PEAK_FLOPS)
    threads: int = 0  # torch threads per process on CPU; 0: cores / local processes
    save_every: int = 0  # save a meshkit checkpoint every N steps (and at the end); 0: never
    save_dir: str = "checkpoints"  # checkpoints go to <save_dir>/step-NNNNNNNN
    resume: str = ""  # "auto": the newest checkpoint under save_dir that verifies, else a fresh start; or a directory
    allow_batch_change: bool = False  # resume even if global batch or seq_len differ from the checkpoint's
    export_hf: str = ""  # at the end, write a directory that transformers' from_pretrained loads
    sample_tokens: int = 32  # at the end, greedy-continue a held-out prompt by this many tokens (store data); 0: off
    eval_every: int = 0  # held-out loss every N steps and after the last; 0: never
    eval_batches: int = 2  # held-out batches per evaluation (same shape as a training micro-batch)
    # Reliability (docs/reliability.md): checkpoints, restarts, non-finite steps, hung ranks.
    load_step: int = 0  # resume from this step's checkpoint instead of the newest (0: the newest)
    overwrite: bool = False  # let a run delete checkpoints in save_dir it would otherwise refuse to mix with
    keep_last: int = 0  # keep only the newest K complete checkpoints (0: keep all)
    on_save_error: str = "stop"  # a checkpoint that cannot be written (disk full): "stop" (exit 4) or "continue"
    async_save: bool = False  # write checkpoints in the background (DCP async_save); the step goes on
    on_nonfinite: str = "error"  # non-finite loss or grad norm: "error" stops naming the step, "skip" skips it
    nonfinite_max_consecutive: int = 5  # on_nonfinite = "skip": more non-finite steps in a row stop the run (0: no limit)
    nonfinite_max_total: int = 100  # on_nonfinite = "skip": more skipped steps in one launch stop the run (0: no limit)
    timeout_s: float = 600.0  # collective timeout of the process group
    heartbeat_s: float = 60.0  # a rank silent this long is named and the job ended (0: no heartbeat)


@dataclass
class DataConfig:
    """The [data] table: a token store (`path`), a blend of stores (`weights`), or synthetic tokens.

    A store is written by `python -m meshkit.data prepare`; rows are packed documents (`pack = false`:
    one document per row, padded). `weights = {"<store dir>" = 0.7, "<other store>" = 0.3}` blends
    stores sample by sample. Without a store (or with `synthetic = true`) the data is a Markov chain
    over the vocabulary: each token has `branching` successors drawn once from `chain_seed`, so the best
    achievable loss is ln(branching) while a fresh model starts near ln(vocab_size). Sequence length,
    batch and evaluation cadence stay in [train].
    """

    path: str = ""  # a token store directory
    pack: bool = True  # documents packed into rows (position_ids restart per document)
    weights: dict[str, float] = field(default_factory=dict)  # blend: store directory -> weight
    synthetic: bool = False  # true: the Markov chain below (also the default when no store is named)
    branching: int = 2
    chain_seed: int = 1234  # draws the transition table (shared by all ranks)


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PEFT_METHODS = ("none", "lora")


@dataclass
class PeftConfig:
    """The [peft] table: train a PEFT adapter with the model's weights frozen (docs/lora.md), or
    `method = "none"` (the default): train every weight. `--export-hf` then writes the adapter as
    `PeftModel.save_pretrained` does, or with `merge = true` (`--merge`) the merged full model."""

    method: str = "none"  # "lora" (peft.LoraConfig); "none": full fine-tuning
    r: int = 16  # LoRA rank
    alpha: float = 32.0  # LoRA scaling is alpha / r
    dropout: float = 0.0  # LoRA dropout on the adapter's input (refused under tp > 1)
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    merge: bool = False  # --export-hf writes the merged model (merge_and_unload) instead of the adapter

    def __post_init__(self) -> None:
        if self.method not in PEFT_METHODS:
            raise ValueError(f"[peft] method={self.method!r}: meshkit trains LoRA adapters (PEFT's other methods "
                             f"change the inputs or rescale activations); fix: method in {PEFT_METHODS}")
        if self.merge and self.method == "none":
            raise ValueError("[peft] merge=true without an adapter: there is nothing to merge; fix: method = "
                             "\"lora\", or merge = false")
        if isinstance(self.target_modules, str):
            self.target_modules = [t for t in self.target_modules.split(",") if t]


@dataclass
class RunConfig:
    model: dict[str, Any] = field(default_factory=dict)
    plan: meshkit.Plan = field(default_factory=meshkit.Plan)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    source: str = ""
    peft: PeftConfig = field(default_factory=PeftConfig)

    def build_model(self, model_config: Any) -> Any:
        """The HF model of `model_config` (build it under `torch.device("meta")`), as PEFT wraps it when
        [peft] asks for an adapter: a target that matches nothing is PEFT's ValueError, the rest of what
        LoRA rules out is `parallelize`'s, each before any collective."""
        model = AutoModelForCausalLM.from_config(model_config)
        if self.peft.method == "none":
            return model
        from peft import LoraConfig, get_peft_model

        return get_peft_model(model, LoraConfig(r=self.peft.r, lora_alpha=self.peft.alpha, lora_dropout=self.peft.dropout,
                                                target_modules=self.peft.target_modules))

    def estimate_config(self, model_config: Any) -> Any:
        """The config `meshkit.estimate` reads: with the adapter when [peft] trains one."""
        return model_config if self.peft.method == "none" else with_lora(model_config, self.peft.r,
                                                                           self.peft.target_modules)


def _fill(cls: type, table: dict[str, Any], where: str) -> Any:
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(table) - set(known))
    if unknown:
        raise ValueError(f"[{where}] has unknown key(s) {unknown}; known keys: {sorted(known)}")
    return cls(**table)


def load_config(path: str | None) -> RunConfig:
    """Parse a preset; each table is optional, unknown keys are errors (a typo must not be ignored)."""
    if not path:
        return RunConfig()
    with open(path, "rb") as f:
        data = tomllib.load(f)
    unknown = sorted(set(data) - {"model", "plan", "train", "data", "peft"})
    if unknown:
        raise ValueError(f"{path}: unknown table(s) {unknown}; expected [model], [plan], [train], [data], [peft]")
    return RunConfig(
        model=dict(data.get("model", {})),
        plan=meshkit.Plan.from_toml(data.get("plan", {})),
        train=_fill(TrainConfig, data.get("train", {}), "train"),
        data=_fill(DataConfig, data.get("data", {}), "data"),
        source=str(path),
        peft=_fill(PeftConfig, data.get("peft", {}), "peft"),
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--config", help="TOML preset with [model], [plan], [train], [data] tables")
    parser.add_argument("--model-path", help="local HF checkpoint or config directory (overrides [model] path)")
    parser.add_argument("--model-set", action="append", default=[], metavar="KEY=VALUE",
                        help="override one HF config field, e.g. --model-set num_hidden_layers=4 (repeatable)")
    for cls in (TrainConfig, DataConfig, PeftConfig):
        group = parser.add_argument_group(f"[{cls.__name__[:-6].lower()}]")
        for f in fields(cls):
            flag = "--" + f.name.replace("_", "-")
            if cls is PeftConfig and f.name != "merge":  # --peft-r 16, --peft-method lora; and --merge
                flag = "--peft-" + f.name.replace("_", "-")
            # SUPPRESS: a flag not given leaves the preset's value alone, and --help shows the built-in
            # default (what applies when neither the preset nor the flag sets it), not "default: None".
            text = f"built-in default {f.default!r}; a --config preset may set another"
            if f.type in ("bool", bool):
                group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                                   default=argparse.SUPPRESS, help=text)
            else:
                group.add_argument(flag, dest=f.name, default=argparse.SUPPRESS, type=_TYPES[str(f.type)], help=text)
    meshkit.Plan.add_cli_args(parser)
    check = parser.add_argument_group("check and dry run")
    check.add_argument("--check", action="store_true",
                       help="validate config, plan, data and save dir on this one process (no torchrun), print the "
                            "estimate and exit: 0, or 2 listing every problem")
    check.add_argument("--dry-run", action="store_true",
                       help="run one step on a fake world of --world ranks (meshkit.dryrun) instead of training")
    check.add_argument("--world", type=int, default=0, metavar="N",
                       help="with --check: the number of processes the run will launch (default: $WORLD_SIZE or 1); "
                            "with --dry-run: the world size to simulate")
    check.add_argument("--jobs", type=int, default=1, help="with --dry-run: ranks simulated at once")
    return parser


_TYPES = {"int": int, "float": float, "str": str, "list[str]": str,  # a list flag: comma-separated
          "dict[str, float]": lambda text: _toml_value(text)}  # an inline TOML table: '{"a" = 0.7, "b" = 0.3}'


def _toml_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_cli(config: RunConfig, args: argparse.Namespace) -> RunConfig:
    """Flags given on the command line win over the preset; flags not given leave it alone."""
    def overlay(obj: Any) -> Any:
        given = {f.name: getattr(args, f.name) for f in fields(obj) if getattr(args, f.name, None) is not None}
        return dataclasses.replace(obj, **given)

    model = dict(config.model)
    if args.model_path:
        model["path"] = args.model_path
    for item in args.model_set:
        if "=" not in item:
            raise ValueError(f"--model-set {item!r}: expected KEY=VALUE, e.g. num_hidden_layers=4")
        key, value = item.split("=", 1)
        model[key.strip()] = _toml_value(value.strip())
    return RunConfig(model=model, plan=meshkit.Plan.from_cli_args(args, base=config.plan),
                     train=overlay(config.train), data=overlay(config.data), source=config.source,
                     peft=overlay(config.peft))


# ------------------------------------------------------------------------------------------ model


def build_model_config(table: dict[str, Any]) -> tuple[Any, Path | None, bool]:
    """(HF config, checkpoint dir or None, load weights?) from the [model] table.

    With `path`, the directory's config.json is the base and the other keys override it; weights are
    loaded when the directory holds safetensors, unless `pretrained = false`.
    """
    table = dict(table)
    path = table.pop("path", None)
    pretrained = table.pop("pretrained", None)
    if path:
        directory = Path(path).expanduser()
        if not (directory / "config.json").is_file():
            raise ValueError(f"[model] path={str(directory)!r}: no config.json there; fix: point at a local HF "
                             "checkpoint or config directory")
        config = AutoConfig.from_pretrained(directory)
        for key, value in table.items():
            setattr(config, key, value)
        has_weights = any(directory.glob("*.safetensors"))
        if pretrained and not has_weights:
            raise ValueError(f"[model] pretrained=true but {directory} holds no *.safetensors files")
        return config, directory, has_weights if pretrained is None else bool(pretrained)
    model_type = table.pop("model_type", "llama")
    table.setdefault("use_cache", False)
    return AutoConfig.for_model(model_type, **table), None, False
