"""A meshkit Trainer's checkpoints: meshkit's own inside Trainer's `checkpoint-N` folders, HF weights out.

- `save_steps` checkpoints: the Trainer still writes its `checkpoint-N` folder with its own files
  (`trainer_state.json`, the per-rank RNG states, TRL's model card); model, optimizer and scheduler
  go into `checkpoint-N/meshkit/`, a `meshkit.state.checkpoint` (DCP keyed by HF names, every rank
  writing its shards), which resumes under any plan and world size. With `save_only_model=True` the
  folder holds the HF weights instead, as the Trainer's would (no resume then, as in the Trainer).
- `resume_from_checkpoint`: the model, optimizer and scheduler come back together once the Trainer
  has built its optimizer and scheduler; a folder with HF weights only loads the weights.
- `save_model(dir)`: HF safetensors, generation config and the tokenizer (`processing_class`, or the
  collator's) through `pm.save_hf_checkpoint(dir, tokenizer=...)` (rank 0 assembles and writes;
  `from_pretrained` loads it as it is), and the training arguments beside them, as the Trainer's
  `_save` writes them. A LoRA model writes its adapter (`PeftModel.from_pretrained` loads it).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from transformers.trainer import TRAINING_ARGS_NAME
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

from meshkit.state import checkpoint

MESHKIT_DIR = "meshkit"  # the meshkit checkpoint inside a Trainer checkpoint folder
_HF_WEIGHTS = (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, "adapter_model.safetensors")


def _inner(optimizer: Any) -> Any:
    """The torch optimizer inside accelerate's wrapper."""
    return getattr(optimizer, "optimizer", optimizer)


def save_training_state(trainer: Any, output_dir: str) -> None:
    """Model, optimizer and scheduler of a `save_steps` checkpoint (every rank calls it)."""
    os.makedirs(output_dir, exist_ok=True)
    args = trainer.args
    global_batch = args.per_device_train_batch_size * args.gradient_accumulation_steps * trainer.parallel_model.dp_size
    checkpoint.save(os.path.join(output_dir, MESHKIT_DIR), trainer.parallel_model, _inner(trainer.optimizer),
                    scheduler=trainer.lr_scheduler, step=trainer.state.global_step, global_batch=global_batch)


def has_training_state(folder: str) -> bool:
    """Whether a Trainer checkpoint folder holds a meshkit checkpoint (model, optimizer, scheduler)."""
    return os.path.isdir(os.path.join(folder, MESHKIT_DIR))


def load_training_state(trainer: Any, folder: str) -> None:
    """Restore model, optimizer and scheduler from `folder` under this run's plan (every rank)."""
    trainer.parallel_model.load_checkpoint(os.path.join(folder, MESHKIT_DIR), _inner(trainer.optimizer),
                                           scheduler=trainer.lr_scheduler)


def load_model_weights(trainer: Any, folder: str) -> None:
    """Load the weights of a folder holding HF weights only (`save_only_model`); a meshkit checkpoint
    is left to `load_training_state`, which needs the optimizer."""
    if has_training_state(folder):
        return
    if not any((Path(folder) / name).is_file() for name in _HF_WEIGHTS):
        raise ValueError(f"resume_from_checkpoint={folder!r} holds neither a meshkit checkpoint ({MESHKIT_DIR}/) nor "
                         "HF weights; fix: a checkpoint-N folder a meshkit Trainer wrote")
    trainer.parallel_model.load_hf_checkpoint(folder)


def save_model(trainer: Any, output_dir: str) -> None:
    """HF weights, tokenizer and training arguments in `output_dir` (every rank calls it; rank 0 writes)."""
    tokenizer = trainer.processing_class
    if tokenizer is None:
        tokenizer = getattr(trainer.data_collator, "tokenizer", None)
    trainer.parallel_model.save_hf_checkpoint(output_dir, tokenizer=tokenizer)
    if trainer.args.should_save:
        torch.save(trainer.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
