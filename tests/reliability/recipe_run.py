"""The recipe runs the reliability tests share: one tiny model, its TOML, training it in the worker
pool (the uninterrupted reference), and the model and optimizer tensors of a checkpoint."""

from __future__ import annotations

import importlib
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "recipes") not in sys.path:
    sys.path.insert(0, str(ROOT / "recipes"))
train_llama = importlib.import_module("train_llama")
train_config = importlib.import_module("train_config")
preflight = importlib.import_module("preflight")

MODEL = """
[model]
hidden_size = 64
intermediate_size = 128
num_hidden_layers = 2
num_attention_heads = 4
num_key_value_heads = 2
vocab_size = 128
max_position_embeddings = 128
"""
# Nine steps of 2 x 4 sequences of 64 tokens: seconds per launch on 2 cores, long enough to kill a rank mid-run.
TRAIN = dict(steps=9, seq_len=64, local_batch=4, lr=0.01, warmup_steps=1, threads=1, log_every=1, save_every=0,
             name="run", heartbeat_s=30, timeout_s=120)


def recipe_toml(plan: str, **train) -> str:
    """The tiny run's config: `plan` is the `[plan]` table's body, `train` overrides `TRAIN`."""
    lines = [f"{k} = {v!r}".replace("'", '"') for k, v in {**TRAIN, **train}.items()]
    return MODEL + f"\n[plan]\n{plan}\n\n[train]\n" + "\n".join(lines) + "\n"


def train_in_pool(config: str, save_dir: str, log_dir: str) -> dict:
    """The recipe's training loop on a pool rank, as the command line would run it (the reference run)."""
    args = train_llama.build_parser().parse_args(["--config", config, "--save-dir", save_dir, "--log-dir", log_dir])
    return train_llama.train(train_config.apply_cli(train_config.load_config(config), args))


def checkpoint_tensors(checkpoint_dir: Path, out: Path) -> dict[str, torch.Tensor]:
    """Every model and optimizer-state tensor of a checkpoint, whole (converted through `out`)."""
    dcp_to_torch_save(str(checkpoint_dir), str(out))
    state = torch.load(out, weights_only=False)
    return {k: v for k, v in state.items() if k.startswith(("model.", "optim.state."))}


def free_port() -> int:
    """A TCP port nothing listens on now (torchrun's store: concurrent tests must not share 29500)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rendezvous_flags(rendezvous: str) -> list[str]:
    """torchrun's flags for a single-node job on a port of its own: the default static rendezvous, or c10d."""
    port = free_port()
    if rendezvous == "static":
        return ["--master-port", str(port)]
    return ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"test-{port}"]


def torchrun_env(**extra: str) -> dict[str, str]:
    """The test's environment for a torchrun launch, without TORCH_DISABLE_SHARE_RDZV_TCP_STORE unless given."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **extra}
    if "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in extra:
        env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    return env


def start_torchrun(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.Popen:
    """`python -m torch.distributed.run ARGS` in a session of its own, output (both streams) piped."""
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def finish(launcher: subprocess.Popen, timeout: float) -> tuple[int | None, str]:
    """(exit status or None when it ran past `timeout`, output). A launcher past its time is killed
    with its whole session: SIGKILL of the agent alone would leave its workers running."""
    try:
        output, _ = launcher.communicate(timeout=timeout)
        return launcher.returncode, output
    except subprocess.TimeoutExpired:
        os.killpg(launcher.pid, signal.SIGKILL)
        output, _ = launcher.communicate()
        return None, output
