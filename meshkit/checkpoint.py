"""`meshkit.checkpoint`, the documented name of training checkpoints; the code is `meshkit.state.checkpoint`."""

from meshkit.state.checkpoint import FORMAT_VERSION, is_checkpoint, latest, load, save, step_dir, verify

__all__ = ["FORMAT_VERSION", "is_checkpoint", "latest", "load", "save", "step_dir", "verify"]
