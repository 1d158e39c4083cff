"""meshkit: every parallelism of the Ultrascale Playbook for unmodified Hugging Face Llama-family models.

Public API, exactly what the README and the error messages name: `Plan` (and its `PlanError`),
`init_mesh`, `parallelize`, `ParallelModel`, `fuse_optimizer_into_backward`, the `MoE` layer a dense model's MLPs can be swapped for,
and `checkpoint` (training checkpoints: `meshkit.checkpoint.save` / `load`). The estimator and the
plan search are commands: `python -m meshkit.estimate`, `python -m meshkit.plan_search`.
"""

from meshkit import checkpoint
from meshkit.compose import parallelize
from meshkit.expert_parallel import MoE
from meshkit.mesh import init_mesh
from meshkit.parallel_model import ParallelModel
from meshkit.plan import Plan, PlanError
from meshkit.zero.fused import fuse_optimizer_into_backward

__all__ = ["MoE", "ParallelModel", "Plan", "PlanError", "checkpoint", "fuse_optimizer_into_backward", "init_mesh",
           "parallelize"]
__version__ = "0.1.0"
