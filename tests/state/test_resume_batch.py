"""A checkpoint records the run's global batch, sequence length and plan; the recipe refuses to resume
it with another global batch (naming both) unless told to, and logs the first step after a resume."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import meshkit
from meshkit.state.run_record import resume_problem, run_record, with_run_record

ROOT = Path(__file__).resolve().parents[2]


def test_resume_problem_names_both_batches():
    saved = with_run_record({"data": 7}, run_record(meshkit.Plan(dp_shard=4), 4, 2, 2, 64))
    assert saved["data"] == 7 and saved["run"]["global_batch"] == 16 and saved["run"]["plan"]["dp_shard"] == 4
    halved = run_record(meshkit.Plan(tp=2, dp_shard=2), 2, 2, 2, 64)
    problem = resume_problem(saved, halved)
    assert "global batch 16 sequences (dp 4 x local_batch 2 x grad_accum 2)" in problem
    assert "global batch 8 sequences (dp 2 x local_batch 2 x grad_accum 2)" in problem
    assert "--allow-batch-change" in problem
    assert resume_problem(saved, halved, allow_change=True) is None
    assert resume_problem(saved, run_record(meshkit.Plan(tp=2, dp_shard=2), 2, 4, 2, 64)) is None
    assert "seq len" in resume_problem(saved, run_record(meshkit.Plan(dp_shard=4), 4, 2, 2, 32))
    assert resume_problem({"no": "record"}, halved) is None and resume_problem(None, halved) is None


def _recipe():
    if str(ROOT / "recipes") not in sys.path:
        sys.path.insert(0, str(ROOT / "recipes"))
    spec = importlib.util.spec_from_file_location("train_llama", ROOT / "recipes" / "train_llama.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_llama"] = module
    spec.loader.exec_module(module)
    return module


def _train(plan: str, directory: str, steps: int, local_batch: int, resume: bool, allow: bool = False) -> dict:
    module = _recipe()
    run = module.load_config(str(ROOT / "recipes" / "configs" / "debug_cpu.toml"))
    run.plan = meshkit.Plan.from_string(plan)
    run.train = dataclasses.replace(run.train, steps=steps, seq_len=16, local_batch=local_batch, grad_accum=1,
                                    threads=1, eval_every=0, log_every=10, log_dir=f"{directory}/runs",
                                    name=plan.replace(",", "_"), save_every=2, save_dir=f"{directory}/ckpt",
                                    resume=f"{directory}/ckpt" if resume else "", allow_batch_change=allow)
    return module.train(run)


def test_resume_with_another_global_batch_is_refused(dist, tmp_path):
    pool = dist(2)
    pool.run(_train, "dp_shard=2", str(tmp_path), 2, 2, False)  # global batch 2 x 2 = 4, saved at step 2
    for o in pool.run_raw(_train, "tp=2", str(tmp_path), 3, 2, True, timeout=60.0):  # dp 1: global batch 2
        assert not o.ok and o.exc_type == "ValueError", f"rank {o.rank}: {o.exc_type}: {o.message}"
        assert "global batch 4 sequences" in o.message and "global batch 2 sequences" in o.message, o.message
    resumed = pool.run_raw(_train, "tp=2", str(tmp_path), 3, 4, True)  # local batch doubled: 4 again
    assert all(o.ok for o in resumed), [o.message for o in resumed]
    assert "step 3/3" in resumed[0].output, "the first step after a resume is not logged"


def test_recipe_checks_the_sequence_length_at_startup(dist, tmp_path):
    for o in dist(2).run_raw(_train_bad_seq, str(tmp_path), 15, timeout=60.0):
        assert not o.ok and o.exc_type == "ValueError", f"rank {o.rank}: {o.exc_type}: {o.message}"
        assert "seq_len=15" in o.message and "multiple of 2" in o.message, o.message
        assert "step 1" not in o.output


def _train_bad_seq(directory: str, seq_len: int) -> dict:
    module = _recipe()
    run = module.load_config(str(ROOT / "recipes" / "configs" / "debug_cpu.toml"))
    run.plan = meshkit.Plan.from_string("tp=2")
    run.train = dataclasses.replace(run.train, steps=1, seq_len=seq_len, local_batch=2, grad_accum=1, threads=1,
                                    eval_every=0, log_dir=f"{directory}/runs", name="bad")
    return module.train(run)
