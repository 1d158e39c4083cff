"""The recipe runs the reliability tests share: one tiny model, its TOML, training it in the worker
pool (the uninterrupted reference), and the model and optimizer tensors of a checkpoint."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "recipes") not in sys.path:
    sys.path.insert(0, str(ROOT / "recipes"))
train_llama = importlib.import_module("train_llama")
train_config = importlib.import_module("train_config")
preflight = importlib.import_module("preflight")

MODEL = """
[model]
hidden_size = 64
intermediate_size = 128
num_hidden_layers = 2
num_attention_heads = 4
num_key_value_heads = 2
vocab_size = 128
max_position_embeddings = 128
"""
# Nine steps of 2 x 4 sequences of 64 tokens: seconds per launch on 2 cores, long enough to kill a rank mid-run.
TRAIN = dict(steps=9, seq_len=64, local_batch=4, lr=0.01, warmup_steps=1, threads=1, log_every=1, save_every=0,
             name="run", heartbeat_s=30, timeout_s=120)


def recipe_toml(plan: str, **train) -> str:
    """The tiny run's config: `plan` is the `[plan]` table's body, `train` overrides `TRAIN`."""
    lines = [f"{k} = {v!r}".replace("'", '"') for k, v in {**TRAIN, **train}.items()]
    return MODEL + f"\n[plan]\n{plan}\n\n[train]\n" + "\n".join(lines) + "\n"


def train_in_pool(config: str, save_dir: str, log_dir: str) -> dict:
    """The recipe's training loop on a pool rank, as the command line would run it (the reference run)."""
    args = train_llama.build_parser().parse_args(["--config", config, "--save-dir", save_dir, "--log-dir", log_dir])
    return train_llama.train(train_config.apply_cli(train_config.load_config(config), args))


def checkpoint_tensors(checkpoint_dir: Path, out: Path) -> dict[str, torch.Tensor]:
    """Every model and optimizer-state tensor of a checkpoint, whole (converted through `out`)."""
    dcp_to_torch_save(str(checkpoint_dir), str(out))
    state = torch.load(out, weights_only=False)
    return {k: v for k, v in state.items() if k.startswith(("model.", "optim.state."))}
