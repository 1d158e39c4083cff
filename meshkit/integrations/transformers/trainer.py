"""`meshkit_trainer(cls)`: any `transformers.Trainer` subclass (TRL's SFTTrainer, DPOTrainer, yours)
with `plan=`, training a model meshkit parallelized.

The subclass keeps the Trainer's loop, callbacks, logging, evaluation and checkpoint folders, and
replaces the parts that assume DDP over every process:

- the model is parallelized after the parent's `__init__` (TRL has then patched or wrapped it);
  `model_init` models on every (re)initialisation; a meta-device model is initialised as HF would
  (`pm.init_weights(args.seed)`) or loaded from `load_weights=<dir>`. A DPO reference model is
  parallelized under the same plan and mesh. The accelerator never wraps them (`accelerator.py`).
- data: accelerate's samplers over the data ranks only; `per_device_train_batch_size` is rows per
  data rank, the global batch per_device x dp x gradient accumulation.
- the loss: `num_items_in_batch` is counted over the whole accumulation window on every data rank
  (one all-reduce), so the loss is the global token mean whatever the split. With the Trainer's own
  `compute_loss` a step is `pm.forward_backward` (every plan, no logits materialised beyond the
  loss); an overridden `compute_loss`, `compute_loss_func` or label smoothing runs the model's own
  forward inside `pm.backward_context()` (pp = 1; refused under pp > 1, where no rank holds the
  logits). The losses logged equal one process running HF's Trainer on the global batch.
- clipping with the global norm (`pm.clip_grad_norm_`), the optimizer over `pm.parameters()` with
  the Trainer's weight-decay groups, DeepSeek-V3 router biases updated after each optimizer step.
- checkpoints and `save_model`: `checkpoints.py`.
- PEFT LoRA: a PeftModel (or TRL's `peft_config=`) trains its adapter only, under PEFT's names; TRL
  DPO's second `ref` adapter, which meshkit cannot hold beside the trained one, is refused (docs/lora.md).
"""

from __future__ import annotations

import functools
import inspect
import os
from typing import Any

import torch
import torch.distributed as dist
import transformers
from torch import nn
from transformers.trainer_callback import TrainerCallback
from transformers.trainer_optimizer import is_optimizer_factory

import meshkit
from meshkit.inference.hf_forward import parallel_model_of
from meshkit.integrations.transformers import arguments as arguments_lib
from meshkit.integrations.transformers import checkpoints
from meshkit.integrations.transformers.accelerator import MeshkitAccelerator
from meshkit.integrations.transformers.batches import batch_problem, step_batch
from meshkit.integrations.transformers.fused_head import FusedHeadForward
from meshkit.mesh import axis, require_launcher, world_size_from_env
from meshkit.parallel_model import ParallelModel
from meshkit.step.consensus import raise_if_any
from meshkit.step.loss import IGNORE_INDEX


@functools.cache
def meshkit_trainer(cls: type) -> type:
    """`cls` (a `transformers.Trainer` subclass) with `plan=`: its model trained under a meshkit Plan.

    `meshkit_trainer(trl.SFTTrainer)(model=..., args=SFTConfig(...), plan=meshkit.Plan(cp=2, tp=2))`.
    Extra keywords: `plan` (a Plan, `"tp=2,dp_shard=-1"`, a TOML path, or `PlanArguments`) and
    `load_weights` (a `save_pretrained` directory for a meta-device model). See the module docstring.
    """
    if not (isinstance(cls, type) and issubclass(cls, transformers.Trainer)):
        raise TypeError(f"meshkit_trainer: {cls!r} is not a transformers.Trainer subclass")
    if issubclass(cls, MeshkitTrainerMixin):
        return cls
    return type(cls.__name__, (MeshkitTrainerMixin, cls), {"__module__": __name__, "__qualname__": cls.__name__})


class MeshkitTrainerMixin:
    """The Trainer methods a plan changes; `meshkit_trainer` puts it before the Trainer class."""

    parallel_model: ParallelModel

    def __init__(self, *args: Any, plan: Any = None, load_weights: str | None = None, **kwargs: Any):
        """Check the plan and the arguments on every rank, build the mesh, then the parent's `__init__`."""
        plan = arguments_lib.plan_from(plan)
        named = inspect.signature(super().__init__).bind_partial(*args, **kwargs).arguments
        model = named.get("model")
        problems = arguments_lib.argument_problems(named.get("args"), plan)
        own_loss = self._uses_own_loss(named.get("compute_loss_func"), named.get("args"))
        if plan.pp > 1 and own_loss:
            problems.append(f"pp={plan.pp} with {own_loss}: a pipeline never gathers the logits an arbitrary loss "
                            "needs (each rank holds some layers); fix: the Trainer's own loss (meshkit runs it through "
                            "the pipeline schedule), or pp=1")
        if problems:
            raise ValueError("meshkit Trainer: the training arguments do not fit plan=:\n  - " + "\n  - ".join(problems))
        require_launcher(plan)
        config = model.config if isinstance(model, nn.Module) else None
        self._meshkit_plan = plan.validate(config, world_size_from_env())  # every rank, before any collective
        self._meshkit_mesh = meshkit.init_mesh(self._meshkit_plan)
        self._meshkit_load = load_weights
        self._meshkit_own_loss = own_loss
        super().__init__(*args, **kwargs)
        if getattr(self, "parallel_model", None) is None or self.parallel_model.model is not self.model:
            self.parallel_model = self._parallelize(self.model, trainable=True)
        ref = getattr(self, "ref_model", None)
        if isinstance(ref, nn.Module):
            self.ref_parallel_model = self._parallelize(ref, trainable=False)
        self.model_wrapped = self.model
        self.callback_handler.model = self.model
        self.add_callback(_RouterBiasUpdate(self))
        if self.optimizer is not None:
            self._check_optimizer(self.optimizer)

    def _uses_own_loss(self, compute_loss_func: Any, args: Any) -> str | None:
        """Which loss of the user's (or of a trainer library) replaces the Trainer's, if any."""
        if type(self).compute_loss is not transformers.Trainer.compute_loss:
            return f"{type(self).__name__}.compute_loss"
        if compute_loss_func is not None:
            return "compute_loss_func"
        if getattr(args, "label_smoothing_factor", 0):
            return "label_smoothing_factor"
        return None

    # ------------------------------------------------------------------ the model
    def _parallelize(self, model: nn.Module, trainable: bool) -> ParallelModel:
        pm = parallel_model_of(model)
        if pm is not None:
            if pm.plan != self._meshkit_plan:
                raise ValueError(f"the model was parallelized under {pm.plan.describe()}, the trainer's plan is "
                                 f"{self._meshkit_plan.describe()}; fix: pass the same plan, or an unparallelized model")
        else:
            adapters = list(getattr(model, "peft_config", None) or {})
            if "ref" in adapters and len(adapters) > 1:
                raise ValueError(
                    f"the PeftModel holds the adapters {adapters}: TRL's DPOTrainer copies a PeftModel's adapter into "
                    "'ref' to serve as the reference when no ref_model is given, and meshkit trains one adapter per "
                    "model; fix: pass the base model with peft_config=LoraConfig(...) (the reference is then the base "
                    "model: the adapter disabled)")
            meta = any(p.is_meta for p in model.parameters())
            self._meshkit_plan = arguments_lib.plan_for_arguments(self._meshkit_plan, self.args)
            pm = meshkit.parallelize(model, self._meshkit_plan, mesh=self._meshkit_mesh)
            if meta and self._meshkit_load:
                pm.load_hf_checkpoint(self._meshkit_load)
            elif meta:
                pm.init_weights(self.args.seed)
        if pm.plan.pp == 1:
            model.forward = FusedHeadForward(pm)  # after TRL's own patch: its fused head cannot run on shards
        # The plan recomputes (plan_for_arguments); HF's checkpointing of the blocks meshkit drives stays off.
        model.activation_checkpointing_enable = model.gradient_checkpointing_enable = _recompute_is_the_plans
        if not trainable:
            pm.eval()
        return pm

    def call_model_init(self, trial: Any = None) -> nn.Module:
        """The parent's `model_init` model, parallelized (at construction and on every `train()`)."""
        model = super().call_model_init(trial)
        self.parallel_model = self._parallelize(model, trainable=True)
        return model

    def create_accelerator_and_postprocess(self) -> None:
        """The parent's accelerator, answering for the plan's data ranks (accelerator.py)."""
        super().create_accelerator_and_postprocess()
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise ValueError("the accelerate config enables DeepSpeed or FSDP, and a meshkit plan shards the model "
                             "itself; fix: launch with torchrun (or an accelerate config without them)")
        MeshkitAccelerator.adopt(self.accelerator, self._meshkit_mesh)

    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        """meshkit placed each shard itself."""

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> nn.Module:
        """No DataParallel, DDP or compile wrapper: the plan is the whole layout."""
        return model

    def get_tp_size(self) -> int:
        """How many processes share one data rank's batch (pp x cp x tp): where the Trainer and TRL divide
        process counts by their tensor-parallel size, they mean this."""
        return dist.get_world_size() // axis(self._meshkit_mesh, "dp").size()

    # ------------------------------------------------------------------ the step
    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device) -> torch.Tensor | None:
        """Valid targets of the accumulation window over every data rank (the global loss denominator).

        With the Trainer's own loss the window's batches are also checked here (`batches.batch_problem`),
        before any collective of the step: the verdict rides on the count's all-reduce (over the world,
        then divided by the processes that share a batch), and only a bad window costs a second one.
        """
        problem = None
        if not self._meshkit_own_loss:
            problem = next(filter(None, (batch_problem(b, need_labels=True) for b in batch_samples)), None)
        labelled = bool(batch_samples) and ("labels" in batch_samples[0] or "shift_labels" in batch_samples[0])
        local = sum(int(((b["shift_labels"] if "shift_labels" in b else b["labels"][..., 1:]) != IGNORE_INDEX).sum())
                    for b in batch_samples) if labelled and problem is None else 0
        pm = self.parallel_model
        both = torch.tensor([local, problem is not None], dtype=torch.int64, device=pm.device)
        if dist.get_world_size() > 1:
            dist.all_reduce(both)
        if int(both[1]):
            raise_if_any(problem, device=pm.device)
        return torch.div(both[0], self.get_tp_size(), rounding_mode="floor").to(device) if labelled else None

    def training_step(self, model: nn.Module, inputs: dict, num_items_in_batch: Any = None) -> torch.Tensor:
        """One microbatch: `pm.forward_backward` for the Trainer's own loss, else the parent's step on the
        model's forward inside `pm.backward_context()`. Returns the loss as the Trainer logs it."""
        pm = self.parallel_model
        last = bool(self.accelerator.sync_gradients)
        if self._meshkit_own_loss:
            with pm.backward_context(last_microbatch=last):
                return super().training_step(model, inputs, num_items_in_batch)
        model.train()
        if callable(getattr(self.optimizer, "train", None)):
            self.optimizer.train()
        batch = step_batch(self._prepare_inputs(inputs), pm.plan)  # checked with the window's count
        denominator = None if num_items_in_batch is None else float(num_items_in_batch)
        loss = pm.forward_backward(batch.input_ids, batch.labels, position_ids=batch.position_ids,
                                   loss_denominator=denominator, last_microbatch=last)
        return loss.detach().to(self.args.device)

    def prediction_step(self, model: nn.Module, inputs: dict, prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None):
        """The Trainer's own loss: `pm.evaluate` (the global batch's loss) and `pm.forward` logits, any plan."""
        if self._meshkit_own_loss:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        pm = self.parallel_model
        inputs, batch = self._step_batch(inputs, need_labels=False)
        with torch.no_grad():
            loss = None if batch.labels is None else pm.evaluate(batch.input_ids, batch.labels,
                                                                 position_ids=batch.position_ids)
            logits = None
            if not prediction_loss_only:
                logits = pm.forward(batch.input_ids, batch.position_ids, gather=True)[:batch.rows, :batch.seq]
        labels = [inputs.get(name) for name in self.label_names or []]
        labels = None if not labels or any(x is None for x in labels) else labels[0] if len(labels) == 1 \
            else tuple(labels)
        return (loss, logits, labels)

    def _step_batch(self, inputs: dict, need_labels: bool):
        inputs = self._prepare_inputs(inputs)
        pm = self.parallel_model
        raise_if_any(batch_problem(inputs, need_labels), device=pm.device)  # data ranks see different rows
        return inputs, step_batch(inputs, pm.plan)

    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        """Clip with the true global norm (every axis, each shard once); returns the norm before clipping."""
        return self.parallel_model.clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        """The global gradient norm (no clipping)."""
        return self.parallel_model.grad_norm() if grad_norm is None else grad_norm

    # ------------------------------------------------------------------ the optimizer
    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """The Trainer's optimizer (class, options, weight-decay groups) over this rank's `pm.parameters()`."""
        if self.optimizer is not None:
            self._check_optimizer(self.optimizer)
            return self.optimizer
        pm = self.parallel_model
        decay = set(self.get_decay_parameter_names(self.model))
        named = [(n, p) for n, p in pm.named_parameters() if p.requires_grad]
        groups = [{"params": [p for n, p in named if n in decay], "weight_decay": self.args.weight_decay},
                  {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
        if self.optimizer_cls_and_kwargs is not None:
            optimizer_cls, kwargs = self.optimizer_cls_and_kwargs
        else:
            optimizer_cls, kwargs = self.get_optimizer_cls_and_kwargs(self.args, self.model)
        problem = arguments_lib.optimizer_problem(kwargs, self.args.optim)
        if problem is None and is_optimizer_factory(optimizer_cls):
            problem = f"optim={self.args.optim!r} is an optimizer factory that walks the model itself; fix: optim='adamw_torch'"
        if problem:
            raise ValueError(problem)
        self.optimizer = optimizer_cls(groups, **kwargs)
        return self.optimizer

    def _check_optimizer(self, optimizer: Any) -> None:
        held = {id(p) for p in self.parallel_model.parameters()}
        inner = getattr(optimizer, "optimizer", optimizer)
        if any(id(p) not in held for g in inner.param_groups for p in g["params"]):
            raise ValueError("optimizers=(opt, ...) holds parameters that are not the parallelized model's (an "
                             "optimizer built before parallelize keeps the unsharded tensors); fix: build it over "
                             "pm.parameters() after meshkit.parallelize, or let the Trainer build it")

    # ------------------------------------------------------------------ checkpoints
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Model, optimizer and scheduler as a meshkit checkpoint in `checkpoint-N/meshkit`."""
        checkpoints.save_training_state(self, output_dir)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        """HF weights of a `save_only_model` folder; a meshkit checkpoint loads with its optimizer."""
        checkpoints.load_model_weights(self, resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """Model, optimizer and scheduler of a meshkit checkpoint, under this run's plan and world size."""
        if checkpoint is not None and checkpoints.has_training_state(checkpoint):
            checkpoints.load_training_state(self, checkpoint)

    def _load_best_model(self) -> None:
        """The best checkpoint's weights (its optimizer state too: training is over)."""
        best = self.state.best_model_checkpoint
        if checkpoints.has_training_state(best):
            checkpoints.load_training_state(self, best)
        else:
            checkpoints.load_model_weights(self, best)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """HF safetensors + tokenizer + training arguments (every rank calls it; rank 0 writes).

        A `save_steps` checkpoint keeps the model in its meshkit checkpoint instead, unless
        `save_only_model` asks for HF weights there.
        """
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if _internal_call and not self.args.save_only_model:
            os.makedirs(output_dir, exist_ok=True)
            return
        checkpoints.save_model(self, output_dir)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)


def _recompute_is_the_plans(*args: Any, **kwargs: Any) -> None:
    """Stands in for HF's `activation_checkpointing_enable` on a parallelized model: the plan decides."""


class _RouterBiasUpdate(TrainerCallback):
    """DeepSeek-V3 router-bias balancing after each optimizer step (a no-op for other models)."""

    def __init__(self, trainer: MeshkitTrainerMixin):
        self.trainer = trainer

    def on_optimizer_step(self, args, state, control, **kwargs):
        """Step every MoE layer's selection bias from the window's routing counts."""
        self.trainer.parallel_model.update_expert_biases()
