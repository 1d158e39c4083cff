"""meshkit: every parallelism of the Ultrascale Playbook for unmodified Hugging Face Llama-family models.

Public API, exactly what the README and the error messages name: `Plan` (and its `PlanError`),
`init_mesh`, `parallelize`, `ParallelModel`, `fuse_optimizer_into_backward`, and the `MoE` layer a
dense model's MLPs can be swapped for. Training checkpoints are `meshkit.state.checkpoint` (`save`,
`load`, `latest`, `verify`), HF weights `meshkit.state.hf_checkpoint`; the estimator and the plan
search are commands: `python -m meshkit.estimate`, `python -m meshkit.estimate.search`.
"""

from meshkit.compose import parallelize
from meshkit.data_parallel.fused import fuse_optimizer_into_backward
from meshkit.expert_parallel import MoE
from meshkit.mesh import init_mesh
from meshkit.parallel_model import ParallelModel
from meshkit.plan import Plan, PlanError

__all__ = ["MoE", "ParallelModel", "Plan", "PlanError", "fuse_optimizer_into_backward", "init_mesh", "parallelize"]
__version__ = "0.1.0"
