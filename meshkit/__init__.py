"""meshkit: every parallelism of the Ultrascale Playbook for unmodified Hugging Face Llama-family models.

Public API: `Plan`, `init_mesh`, `parallelize`, `ParallelModel`.
"""

from meshkit.mesh import init_mesh
from meshkit.parallel_model import ParallelModel
from meshkit.parallelize import parallelize
from meshkit.plan import Plan, PlanError

__all__ = ["ParallelModel", "Plan", "PlanError", "init_mesh", "parallelize"]
__version__ = "0.1.0"
