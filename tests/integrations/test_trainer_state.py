"""A meshkit Trainer's checkpoints and refusals: `save_steps` checkpoints resumed under another plan
and world size land on the uninterrupted single-process HF run; `save_model` writes a directory
`from_pretrained` loads (with the tokenizer: tests/integrations/test_trl.py); a plan that does not fit the world, DeepSpeed/FSDP
arguments beside `plan=`, and a `compute_loss` override under pp > 1 are refused on every rank
before any collective."""

from __future__ import annotations

import os

import pytest
import torch
import transformers
from trainer_cases import (
    DENSE,
    LOSS_TOL,
    PARAM_TOL,
    StopAt,
    arguments,
    collate,
    losses,
    reference_run,
    rows,
)

from meshkit.integrations.transformers import Trainer, meshkit_trainer


def _train(plan: str, data: list[dict], output_dir: str, per_device: int, stop_at: int = 4, resume: str | None = None,
           save_to: str | None = None) -> dict:
    from datasets import Dataset

    args = arguments(output_dir, per_device, steps=4, save_strategy="steps", save_steps=2)
    trainer = Trainer(model=DENSE.build(), args=args, train_dataset=Dataset.from_list(data), data_collator=collate,
                      plan=plan, callbacks=[StopAt(stop_at)])
    trainer.train(resume_from_checkpoint=resume)
    if save_to:
        trainer.save_model(save_to)
    return {"losses": losses(trainer.state.log_history), "state": trainer.parallel_model.full_state_dict(),
            "step": trainer.state.global_step}


def test_resume_under_another_plan_and_world_size_lands_on_the_uninterrupted_run(dist, tmp_path):
    """4 ranks (tp x fsdp, 2 rows per data rank) save at step 2; 2 ranks (fsdp, 2 rows per data rank)
    resume from checkpoint-2 and train to step 4: losses of steps 3-4 and the final weights equal one
    process running HF's Trainer for 4 steps on the same global batches; `save_model` exports them."""
    data = rows(4 * 4)
    ref = reference_run(DENSE, data, str(tmp_path / "ref"), per_device=4, accumulation=1, steps=4)
    first = dist(4).run(_train, "tp=2,dp_shard=2", data, str(tmp_path / "run"), 2, stop_at=2)
    folder = tmp_path / "run" / "checkpoint-2"
    assert (folder / "trainer_state.json").is_file() and (folder / "meshkit" / ".metadata").is_file(), \
        sorted(os.listdir(folder))
    assert first[0]["losses"] == pytest.approx(ref["losses"][:2], abs=LOSS_TOL)
    export = str(tmp_path / "export")
    second = dist(2).run(_train, "dp_shard=2", data, str(tmp_path / "run"), 2, resume=str(folder), save_to=export)
    for rank, r in enumerate(second):
        assert r["step"] == 4
        # The first two entries come from the checkpoint's trainer_state.json, the last two were trained here.
        assert r["losses"] == pytest.approx(ref["losses"], abs=LOSS_TOL), (rank, r["losses"], ref["losses"])
    worst = max((second[0]["state"][k] - v).abs().max().item() for k, v in ref["state"].items())
    assert worst <= PARAM_TOL, f"resumed weights differ from the uninterrupted HF run by {worst:.3g}"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(export)
    worst = max((loaded.state_dict()[k] - v).abs().max().item() for k, v in ref["state"].items())
    assert worst <= PARAM_TOL, f"the exported model differs from HF's trained one by {worst:.3g}"


class _OwnLoss(transformers.Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


def _refused(plan: str, case: str, output_dir: str) -> None:
    from datasets import Dataset

    args = arguments(output_dir, 2)
    cls = transformers.Trainer
    if case == "deepspeed":
        args.deepspeed = "ds_config.json"  # set after construction: deepspeed itself is not installed here
    elif case == "fsdp":
        args = arguments(output_dir, 2, fsdp="full_shard")
    elif case == "compute_loss":
        cls = _OwnLoss
    meshkit_trainer(cls)(model=DENSE.build(), args=args, train_dataset=Dataset.from_list(rows(8)),
                         data_collator=collate, plan=plan)


@pytest.mark.parametrize("plan, case, expected", [
    ("tp=3", "fits", "tp=3"),
    ("dp_shard=2", "deepspeed", "deepspeed="),
    ("dp_shard=2", "fsdp", "fsdp="),
    ("pp=2", "compute_loss", "_OwnLoss.compute_loss"),
])
def test_bad_input_is_refused_on_every_rank_before_any_collective(dist, tmp_path, plan, case, expected):
    for o in dist(2).run_raw(_refused, plan, case, str(tmp_path), timeout=60.0):
        assert not o.ok and o.exc_type in ("ValueError", "PlanError"), f"rank {o.rank}: {o.exc_type}: {o.message}"
        assert expected in o.message and "fix" in o.message, o.message


def _collate_odd_on_rank_1(features: list[dict]) -> dict:
    batch = collate(features)
    if torch.distributed.get_rank() == 1:
        batch["token_type_ids"] = torch.zeros_like(batch["input_ids"])
    return batch


def _bad_batch_on_one_rank(output_dir: str) -> None:
    from datasets import Dataset

    Trainer(model=DENSE.build(), args=arguments(output_dir, 2), train_dataset=Dataset.from_list(rows(16)),
            data_collator=_collate_odd_on_rank_1, plan="tp=2,dp_shard=2").train()


def test_a_batch_only_one_rank_cannot_run_is_refused_on_every_rank(dist, tmp_path):
    """Data ranks load different rows, so one rank's bad batch must stop all of them before the step."""
    for o in dist(4).run_raw(_bad_batch_on_one_rank, str(tmp_path), timeout=120.0):
        assert not o.ok and o.exc_type == "ValueError", f"rank {o.rank}: {o.exc_type}: {o.message}"
        assert "rank 1: the batch holds ['token_type_ids']" in o.message, o.message
