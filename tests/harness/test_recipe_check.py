"""`recipes/train_llama.py --check --world N`: on this one process, no torchrun and no process group, the
recipe's pre-flight checks (config, plan for N ranks, data stores, save dir) list every problem at once
with exit status 2, or print the plan and the estimate with exit status 0."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch.distributed as dist

from meshkit.data.store import write_store

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "recipes") not in sys.path:
    sys.path.insert(0, str(ROOT / "recipes"))
import train_llama  # noqa: E402  (the recipe's folder is on sys.path, as `python recipes/train_llama.py` has it)

DEBUG = str(ROOT / "recipes" / "configs" / "debug_cpu.toml")


def test_check_prints_the_plan_and_estimate_for_a_good_run(capsys):
    assert train_llama.main(["--config", DEBUG, "--check", "--world", "8"]) == 0
    out = capsys.readouterr().out
    assert "--check: ok for 8 rank(s)" in out and "meshkit: estimate: predicted peak" in out, out
    assert not dist.is_initialized()


def test_check_lists_every_problem_and_exits_2(tmp_path, capsys):
    vocab_too_big = write_store(tmp_path / "store", [np.array([700, 5, 0])], eos_id=0, vocab_size=1000)
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    status = train_llama.main(["--config", DEBUG, "--check", "--world", "6", "--no-synthetic", "--lr", "-1",
                               "--weights", f'{{"{vocab_too_big.path}" = 1, "{tmp_path}/missing" = 1}}',
                               "--save-every", "5", "--save-dir", str(blocker / "ckpt")])
    err = capsys.readouterr().err
    assert status == 2, err
    for expected in ("[train] lr=-1.0: must be > 0",
                     "[plan]",                                     # tp=2 x dp_shard=2 x dp_replicate=2 on 6
                     f"token store '{tmp_path}/missing': no manifest.json",
                     "has a vocabulary of 1000 tokens, the model's embedding 256 rows",
                     "save_dir=", "is not writable"):
        assert expected in err, f"{expected!r} not in:\n{err}"
    assert "--check: " in err and "problem(s) for 6 rank(s)" in err
    assert not dist.is_initialized()
