"""accelerate's `Accelerator` as a meshkit Trainer drives it: data ranks, not processes.

The Trainer talks to its accelerator for every distributed decision, and accelerate's answers assume
DDP/FSDP over all processes. Under a plan the processes that share a batch (tensor, context and
pipeline peers) are not data ranks, and meshkit has already sharded the model, so:

- models pass through unwrapped (no DDP/FSDP on top of DTensor parameters, no autocast: the plan
  holds the precision);
- dataloaders are sharded over the data ranks (`num_processes` = dp size, `process_index` = dp
  rank), with accelerate's own samplers, so the rows of one optimizer step over all data ranks are
  the rows one process would take for the global batch, and peers load identical rows;
- `backward` divides the loss by the dp size: the Trainer and TRL scale their losses for DDP, which
  averages gradients over the data ranks, and meshkit sums them;
- gathers (metrics, token counts, evaluation outputs) run over the data ranks only, so a peer's
  copy of the same rows is not counted twice.

`MeshkitAccelerator.adopt` turns the Trainer's own accelerator into one (its class is swapped, its
state kept), because the Trainer constructs `Accelerator` itself.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.data_loader import prepare_data_loader
from accelerate.utils import recursively_apply
from torch.distributed.device_mesh import DeviceMesh

from meshkit.mesh import axis


class MeshkitAccelerator(Accelerator):
    """An Accelerator whose processes are grouped into data ranks by a meshkit mesh (module docstring)."""

    meshkit_dp_group: dist.ProcessGroup | None = None
    meshkit_dp_rank: int = 0
    meshkit_dp_size: int = 1

    @classmethod
    def adopt(cls, accelerator: Accelerator, mesh: DeviceMesh) -> MeshkitAccelerator:
        """Make the Trainer's accelerator answer for `mesh`'s data ranks; returns the same object."""
        if type(accelerator) is not Accelerator and not isinstance(accelerator, cls):
            raise ValueError(f"the Trainer built a {type(accelerator).__name__}, not accelerate's Accelerator; a meshkit "
                             "Trainer replaces it; fix: do not override create_accelerator_and_postprocess")
        accelerator.__class__ = cls
        dp = axis(mesh, "dp")
        accelerator.meshkit_dp_group = dp.get_group()
        accelerator.meshkit_dp_rank = dp.get_local_rank()
        accelerator.meshkit_dp_size = dp.size()
        return accelerator

    def prepare_model(self, model, device_placement=None, evaluation_mode=False):
        """Leave the model as meshkit sharded it (no DDP/FSDP wrapper, no device move, no autocast)."""
        return model

    def prepare_data_loader(self, data_loader, device_placement=None, slice_fn_for_dispatch=None):
        """accelerate's sharding of `data_loader`, over the data ranks instead of the processes."""
        if getattr(data_loader, "_is_accelerate_prepared", False):
            if data_loader not in self._dataloaders:
                self._dataloaders.append(data_loader)
            return data_loader
        prepared = prepare_data_loader(
            data_loader, self.device, num_processes=self.meshkit_dp_size, process_index=self.meshkit_dp_rank,
            split_batches=self.split_batches,
            put_on_device=self.device_placement if device_placement is None else device_placement,
            rng_types=self.rng_types.copy(), dispatch_batches=False, even_batches=self.even_batches,
            use_seedable_sampler=self.use_seedable_sampler, data_seed=self.dataloader_config.data_seed,
            non_blocking=self.non_blocking, use_stateful_dataloader=self.use_stateful_dataloader)
        self._dataloaders.append(prepared)
        return prepared

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """Backpropagate the loss as DDP would average it: meshkit sums gradients over data ranks."""
        kwargs.pop("learning_rate", None)
        kwargs.pop("scale_wrt_gas", None)
        (loss / self.meshkit_dp_size).backward(**kwargs)

    def gather(self, tensor):
        """Concatenate every data rank's tensors along dim 0 (scalars become [dp]); peers are not repeated."""
        if self.meshkit_dp_size == 1:
            return tensor

        def one(t: torch.Tensor) -> torch.Tensor:
            t = t.reshape(1) if t.dim() == 0 else t.contiguous()
            parts = [torch.empty_like(t) for _ in range(self.meshkit_dp_size)]
            dist.all_gather(parts, t, group=self.meshkit_dp_group)
            return torch.cat(parts)

        return recursively_apply(one, tensor, error_on_other_type=True)

    def gather_for_metrics(self, input_data, use_gather_object=False):
        """`gather` (objects: every data rank's list concatenated), minus the rows an uneven last batch
        repeated, as accelerate's own does over processes."""
        try:
            recursively_apply(lambda x: x, input_data, error_on_other_type=True)
            tensors = True
        except TypeError:
            tensors = False
        if use_gather_object or not tensors:
            data = self._gather_objects(input_data)
        else:
            data = self.gather(input_data)
        state = self.gradient_state
        if not state.end_of_dataloader or state.remainder <= 0:
            return data
        if use_gather_object or not tensors:
            return data[: state.remainder]
        return recursively_apply(lambda t: t[: state.remainder], data)

    def _gather_objects(self, obj):
        items = obj if isinstance(obj, list) else [obj]
        if self.meshkit_dp_size == 1:
            return items
        parts: list = [None] * self.meshkit_dp_size
        dist.all_gather_object(parts, items, group=self.meshkit_dp_group)
        return [x for part in parts for x in part]
