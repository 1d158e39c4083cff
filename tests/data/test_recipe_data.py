"""The recipe on a token store: trains, evaluates on the held-out split, saves the loader's position
in its checkpoints, and a resume under another plan and dp size continues exactly; a store written by
another tokenizer than the model's is refused."""

from __future__ import annotations

import dataclasses
import importlib.util
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

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


def _run(plan: str, store: str, tmp: str, steps: int, resume: str = "", save_every: int = 0) -> dict:
    module = _recipe()
    run = module.load_config(str(ROOT / "recipes" / "configs" / "debug_cpu.toml"))
    run.plan = __import__("meshkit").Plan.from_string(plan)
    resolved = run.plan.resolve(4)
    dp = resolved.dp_replicate * resolved.dp_shard
    run.data = dataclasses.replace(run.data, synthetic=False, path=store)
    run.train = dataclasses.replace(run.train, steps=steps, seq_len=16, local_batch=4 // dp,
                                    grad_accum=2, threads=1, eval_every=2, eval_batches=1, log_dir=tmp,
                                    name=plan.replace(",", "_") + resume[-1:], save_every=save_every,
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


def test_recipe_trains_on_a_store_and_resumes_under_another_plan(dist, store, tmp_path):
    straight = dist(4).run(_run, "dp_shard=4", store, str(tmp_path), 4, "", 2)
    assert all(r["eval_losses"] == straight[0]["eval_losses"] for r in straight) and sorted(straight[0]["eval_losses"]) == [2, 4]
    resume_dir = tmp_path / "from2"
    resume_dir.mkdir()
    shutil.copytree(tmp_path / "ckpt" / "step-00000002", resume_dir / "step-00000002")
    resumed = dist(4).run(_run, "dp_shard=2,tp=2", store, str(tmp_path), 4, str(resume_dir))
    for r in resumed:
        assert r["last_loss"] == pytest.approx(straight[0]["last_loss"], abs=TOL)
        assert r["eval_losses"][4] == pytest.approx(straight[0]["eval_losses"][4], abs=TOL)


def test_store_from_another_tokenizer_is_refused(tmp_path):
    _recipe()
    data_setup = sys.modules["data_setup"]  # the recipe's sibling module, imported by train_llama

    model_dir = tmp_path / "model"
    train_bpe(["some text to learn a few merges from"] * 3, 300, model_dir)
    store = write_store(tmp_path / "store", [np.array([5, 0])], eos_id=0, vocab_size=300, tokenizer_sha256="abc")
    with pytest.raises(ValueError, match="written by another tokenizer .* than the model's own in"):
        data_setup._check_tokenizer(store, model_dir)
    cfg = data_setup.DataConfig(path="x", synthetic=True)
    with pytest.raises(ValueError, match="synthetic = true with path"):
        data_setup.check_data_config(cfg)
