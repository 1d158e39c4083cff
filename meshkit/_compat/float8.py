"""torchao's float8 training, imported only when a plan asks for float8, and the noise its import makes.

torchao is optional: `import meshkit` never imports it, and `Plan(float8=...)` refuses a plan naming
float8 when it is missing (`meshkit.float8.rules`). Where it is installed, transformers imports it
whenever a model is built (its quantizer registry), and that import logs two kinds of lines in every
process that are not about the user's run: "Failed to load .../torchao/_C_*.so" for torchao's CUDA
kernels on a CPU-only torch build (they can never load there; float8 training does not use them),
and torch's deprecation notice for the enums torchao registers with pytree. `quiet_torchao_import`
drops exactly those records with logging filters on the two loggers; every other record, and these
same ones on a CUDA build of torch (where a kernel that fails to load is worth knowing about), passes.
"""

from __future__ import annotations

import importlib
import logging
import sys
from types import ModuleType


class _TorchaoImportNoise(logging.Filter):
    """Drops torchao's expected import-time records (see the module docstring); passes everything else."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "torchao":
            message = record.getMessage()
            torch = sys.modules.get("torch")  # imported by torchao already; this module stays light for `import meshkit`
            cpu_build = torch is not None and torch.version.cuda is None
            return not (cpu_build and message.startswith("Failed to load") and "/torchao/_C_" in message)
        args = record.args if isinstance(record.args, tuple) else ()
        enum_from_torchao = bool(args) and isinstance(args[0], type) and args[0].__module__.startswith("torchao")
        return not (enum_from_torchao and "is an Enum subclass" in str(record.msg))


_FILTER = _TorchaoImportNoise()


def quiet_torchao_import() -> None:
    """Install the filter on torchao's logger and on torch's pytree logger (idempotent). It must run before
    torchao is first imported; importing this module (which `import meshkit` does) runs it."""
    for name in ("torchao", "torch.utils._pytree"):
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)


quiet_torchao_import()  # `import meshkit` reaches here before any model is built (and transformers imports torchao)


def torchao_float8() -> ModuleType:
    """`torchao.float8`, imported now (a plan asked for float8; `Plan` already checked torchao is installed)."""
    return importlib.import_module("torchao.float8")

