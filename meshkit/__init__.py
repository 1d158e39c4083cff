"""meshkit: every parallelism of the Ultrascale Playbook for unmodified Hugging Face Llama-family models.

Public API, exactly what the README and the error messages name: `Plan` (and its `PlanError`),
`init_mesh`, `parallelize`, `ParallelModel`, `fuse_optimizer_into_backward`, and the `MoE` layer a
dense model's MLPs can be swapped for. Training checkpoints are `meshkit.state.checkpoint` (`save`,
`load`, `latest`, `verify`), HF weights `meshkit.state.hf_checkpoint`; the estimator and the plan
search are commands: `python -m meshkit.estimate`, `python -m meshkit.estimate.search`.

The names resolve on first use (PEP 562), so `import meshkit.data` (a tokenizing process, `python -m
meshkit.data info`) does not pay for DTensor, FSDP and torch.distributed.checkpoint, which the
parallel API imports; `import meshkit` followed by any of the names behaves as an eager import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# First: filters the log lines torchao's import prints, before any meshkit module imports transformers'
# modeling code, which imports torchao (see meshkit._compat.float8; it imports neither torch nor torchao).
from meshkit._compat import float8 as _torchao_import_noise  # noqa: F401, I001

if TYPE_CHECKING:
    from meshkit.compose import parallelize
    from meshkit.data_parallel.fused import fuse_optimizer_into_backward
    from meshkit.expert_parallel import MoE
    from meshkit.mesh import init_mesh
    from meshkit.parallel_model import ParallelModel
    from meshkit.plan import Plan, PlanError

_HOMES = {"parallelize": "meshkit.compose", "fuse_optimizer_into_backward": "meshkit.data_parallel.fused",
          "MoE": "meshkit.expert_parallel", "init_mesh": "meshkit.mesh", "ParallelModel": "meshkit.parallel_model",
          "Plan": "meshkit.plan", "PlanError": "meshkit.plan"}

__all__ = ["MoE", "ParallelModel", "Plan", "PlanError", "fuse_optimizer_into_backward", "init_mesh", "parallelize"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """A public name, imported from its home module the first time it is asked for."""
    if name not in _HOMES:
        raise AttributeError(f"module 'meshkit' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})
