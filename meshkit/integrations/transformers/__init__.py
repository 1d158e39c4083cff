"""meshkit under transformers' `Trainer` and TRL's trainers: `plan=` on any Trainer subclass.

    from meshkit.integrations.transformers import Trainer, meshkit_trainer
    trainer = Trainer(model=model, args=TrainingArguments(...), train_dataset=ds, plan=meshkit.Plan(tp=2, dp_shard=-1))
    SFTTrainer = meshkit_trainer(trl.SFTTrainer)

Modules: `trainer` (the subclass factory: model, data ranks, loss, optimizer), `accelerator` (accelerate
answering for data ranks), `batches` (a collator's batch as meshkit's step takes it), `fused_head`
(TRL's fused-LM-head call on meshkit's forward), `checkpoints` (meshkit checkpoints inside the
Trainer's folders, HF weights out), `arguments` (the plan, and the training arguments a plan refuses).
"""

import transformers

from meshkit.integrations.transformers.arguments import PlanArguments
from meshkit.integrations.transformers.trainer import meshkit_trainer

Trainer = meshkit_trainer(transformers.Trainer)

__all__ = ["PlanArguments", "Trainer", "meshkit_trainer"]
