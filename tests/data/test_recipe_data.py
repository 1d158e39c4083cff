"""The recipe on a token store: trains, evaluates on the held-out split, saves the loader's position
in its checkpoints, and a resume under another plan and dp size continues exactly; a store written by
another tokenizer than the model's is refused."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from meshkit.data.store import write_store
from meshkit.data.tokenizer import train_bpe

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 256  # debug_cpu.toml's model
TOL = 1e-5


def _recipe():
    """recipes/train_llama.py as a module, with its folder on sys.path as `python recipes/...` has it."""
    if str(ROOT / "recipes") not in sys.path:
        sys.path.insert(0, str(ROOT / "recipes"))
    spec = importlib.util.spec_from_file_location("train_llama", ROOT / "recipes" / "train_llama.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_llama"] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def _run(plan: str, store: str, tmp: str, steps: int, resume: str = "", save_every: int = 0, name: str = "") -> dict:
    module = _recipe()
    run = module.load_config(str(ROOT / "recipes" / "configs" / "debug_cpu.toml"))
    run.plan = __import__("meshkit").Plan.from_string(plan)
    resolved = run.plan.resolve(4)
    dp = resolved.dp_replicate * resolved.dp_shard
    run.data = dataclasses.replace(run.data, synthetic=False, path=store)
    run.train = dataclasses.replace(run.train, steps=steps, seq_len=16, local_batch=4 // dp,
                                    grad_accum=2, threads=1, eval_every=2, eval_batches=1, log_dir=tmp,
                                    name=name, save_every=save_every,
                                    save_dir=f"{tmp}/ckpt", resume=resume, warmup_steps=1)
    return module.train(run)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    rng = np.random.default_rng(0)
    docs = [np.append(rng.integers(1, VOCAB, n - 1), 0) for n in rng.integers(3, 40, 40)]
    split = (np.arange(40) % 5 == 4).astype(np.uint8)
    path = tmp_path_factory.mktemp("store")
    write_store(path, docs, eos_id=0, vocab_size=VOCAB, split_ids=split)
    return str(path)


def _scalars(run_dir: Path, tag: str) -> dict[int, list[float]]:
    """Every value TensorBoard shows for `tag` in one run directory, by step (purged events dropped)."""
    events = EventAccumulator(str(run_dir))
    events.Reload()
    found: dict[int, list[float]] = {}
    for e in events.Scalars(tag):
        found.setdefault(e.step, []).append(e.value)
    return found


def test_recipe_trains_on_a_store_and_resumes_under_another_plan(dist, store, tmp_path):
    """...and continues the same TensorBoard run and loss curve: the resumed launch (no --name) logs
    into the first launch's run directory, TensorBoard shows every step once (the first launch's steps
    past the checkpoint replaced), and the loss history behind loss.png starts at step 1."""
    straight = dist(4).run(_run, "dp_shard=4", store, str(tmp_path), 4, "", 2, "mine")
    assert all(r["eval_losses"] == straight[0]["eval_losses"] for r in straight) and sorted(straight[0]["eval_losses"]) == [2, 4]
    resume_dir = tmp_path / "from2"
    resume_dir.mkdir()
    shutil.copytree(tmp_path / "ckpt" / "step-00000002", resume_dir / "step-00000002")
    resumed = dist(4).run(_run, "dp_shard=2,tp=2", store, str(tmp_path), 4, str(resume_dir))
    for r in resumed:
        assert r["last_loss"] == pytest.approx(straight[0]["last_loss"], abs=TOL)
        assert r["eval_losses"][4] == pytest.approx(straight[0]["eval_losses"][4], abs=TOL)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir() and (p / "loss.png").is_file()) == ["mine"]
    history = resumed[0]["loss_history"]
    assert sorted(history) == [1, 2, 3, 4] and history[1] == straight[0]["first_loss"]
    shown = _scalars(tmp_path / "mine", "train/loss")
    assert sorted(shown) == [1, 2, 3, 4] and all(len(v) == 1 for v in shown.values()), shown
    assert shown[4][0] == pytest.approx(resumed[0]["last_loss"], abs=1e-6)


def test_store_from_another_tokenizer_is_refused(tmp_path):
    _recipe()
    data_setup = sys.modules["data_setup"]  # the recipe's sibling module, imported by train_llama

    model_dir = tmp_path / "model"
    train_bpe(["some text to learn a few merges from"] * 3, 300, model_dir)
    store = write_store(tmp_path / "store", [np.array([5, 0])], eos_id=0, vocab_size=300, tokenizer_sha256="abc")
    problems = data_setup._tokenizer_problems({"store": store}, model_dir)
    assert len(problems) == 1 and re.search("written by another tokenizer .* than the model's own in", problems[0])
    cfg = data_setup.DataConfig(path="x", synthetic=True)
    with pytest.raises(ValueError, match="synthetic = true with path"):
        data_setup.check_data_config(cfg)
