"""Shared pieces of the Trainer/TRL tests: a tiny dataset and collator, the training arguments, and
the single-process HF reference each sharded run is compared with (run in the pytest process, which
has no process group, so transformers trains there as one plain process would)."""

from __future__ import annotations

import torch
import transformers

from meshkit.testing.reference import ModelSpec

VOCAB = 96
DENSE = ModelSpec(layers=2, vocab=VOCAB)
MOE = ModelSpec(layers=2, intermediate=16, experts=4, top_k=2, vocab=VOCAB)
LOSS_TOL = 2e-5     # fp32 losses of order 4, logged per step
PARAM_TOL = 2e-5    # after a few AdamW steps at lr 1e-2 with eps 1e-3 (notes: exactness needs eps ~1e-3)


def rows(count: int, seed: int = 0) -> list[dict]:
    """`count` examples of 5..12 tokens, a quarter of the labels ignored (-100)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        n = int(torch.randint(5, 13, (1,), generator=gen))
        ids = torch.randint(1, VOCAB, (n,), generator=gen)
        labels = ids.clone()
        labels[torch.rand(n, generator=gen) < 0.25] = -100
        out.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    return out


def collate(features: list[dict]) -> dict:
    """Right-pad to the longest row: pad id 0, label -100, attention mask 0."""
    longest = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), longest, dtype=torch.long)
    labels = torch.full((len(features), longest), -100, dtype=torch.long)
    mask = torch.zeros(len(features), longest, dtype=torch.long)
    for i, f in enumerate(features):
        n = len(f["input_ids"])
        ids[i, :n] = torch.tensor(f["input_ids"])
        labels[i, :n] = torch.tensor(f["labels"])
        mask[i, :n] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def arguments(output_dir: str, per_device: int, accumulation: int = 1, steps: int = 3, **extra):
    """TrainingArguments of every comparison: AdamW eps 1e-3, clipping at 1.0, weight decay, linear decay."""
    base = dict(output_dir=output_dir, per_device_train_batch_size=per_device,
                gradient_accumulation_steps=accumulation, max_steps=steps, learning_rate=1e-2, adam_epsilon=1e-3,
                weight_decay=0.1, max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to=[], seed=0,
                use_cpu=True, disable_tqdm=True, dataloader_drop_last=True)
    base.update(extra)
    return transformers.TrainingArguments(**base)


def losses(log_history: list[dict]) -> list[float]:
    """The per-step training losses a Trainer logged."""
    return [entry["loss"] for entry in log_history if "loss" in entry]


def reference_run(spec: ModelSpec, data: list[dict], output_dir: str, per_device: int, accumulation: int,
                  steps: int = 3, **extra) -> dict:
    """HF's own Trainer, one process, the global batch per step: its losses, grad norms and weights."""
    from datasets import Dataset

    model = spec.build()
    args = arguments(output_dir, per_device, accumulation, steps, **extra)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Dataset.from_list(data),
                                   data_collator=collate)
    trainer.train()
    norms = [e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e]
    return {"losses": losses(trainer.state.log_history), "norms": norms,
            "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}
