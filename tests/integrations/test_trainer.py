"""`meshkit.integrations.transformers.Trainer` against HF's own Trainer in one plain process on the
global batch: the same logged losses and gradient norms per step, the same evaluation loss and the
same weights after the last step, under tp x FSDP with gradient accumulation (CI), and zero-2, cp,
pp, ep, HSDP, tp without FSDP, a meta-device model and `model_init` (slow); a user's `compute_loss`
override and label smoothing through the model's own forward (tp x cp in CI, zero-1 and tp alone
slow); TensorBoard logging."""

from __future__ import annotations

import os

import pytest
import torch
import transformers
from trainer_cases import (
    DENSE,
    LOSS_TOL,
    MOE,
    PARAM_TOL,
    OwnLoss,
    arguments,
    collate,
    losses,
    reference_run,
    rows,
)

import meshkit
from meshkit.integrations.transformers import Trainer, meshkit_trainer


def _meshkit_run(plan: str, spec, data: list[dict], output_dir: str, per_device: int, accumulation: int,
                 trainer_cls=transformers.Trainer, eval_data: list[dict] | None = None, init: str = "model",
                 **extra) -> dict:
    from datasets import Dataset

    args = arguments(output_dir, per_device, accumulation, per_device_eval_batch_size=per_device, **extra)
    model = {"model": spec.build()} if init != "model_init" else {"model_init": lambda: spec.build()}
    if init == "meta":  # weights from a save_pretrained directory, loaded shard by shard
        if torch.distributed.get_rank() == 0:  # one writer: a rank reading while another rewrites finds no file
            spec.build().save_pretrained(os.path.join(output_dir, "initial"))
        torch.distributed.barrier()
        model = {"model": spec.build(device="meta"), "load_weights": os.path.join(output_dir, "initial")}
    trainer = meshkit_trainer(trainer_cls)(args=args, train_dataset=Dataset.from_list(data), data_collator=collate,
                                           eval_dataset=None if eval_data is None else Dataset.from_list(eval_data),
                                           plan=plan, **model)
    trainer.train()
    history = trainer.state.log_history
    predicted = None if eval_data is None else trainer.predict(Dataset.from_list(eval_data)).predictions
    return {"losses": losses(history), "norms": [e["grad_norm"] for e in history if "grad_norm" in e],
            "eval": None if eval_data is None else trainer.evaluate()["eval_loss"], "predictions": predicted,
            "state": trainer.parallel_model.full_state_dict()}


def _compare(plan: str, ref: dict, results: list[dict]) -> None:
    for rank, r in enumerate(results):
        assert len(r["losses"]) == len(ref["losses"]) == 3, (r["losses"], ref["losses"])
        worst = max(abs(a - b) for a, b in zip(r["losses"], ref["losses"]))
        assert worst <= LOSS_TOL, f"{plan}, rank {rank}: losses {r['losses']} vs HF {ref['losses']}"
        worst = max(abs(a - b) for a, b in zip(r["norms"], ref["norms"]))
        assert worst <= LOSS_TOL, f"{plan}, rank {rank}: grad norms {r['norms']} vs HF {ref['norms']}"
        if ref["eval"] is not None:
            assert abs(r["eval"] - ref["eval"]) <= LOSS_TOL, f"{plan}, rank {rank}: eval {r['eval']} vs HF {ref['eval']}"
            # predict: every row's logits at its real positions (batches pad to different lengths per split)
            for i, row in enumerate(ref["eval_rows"]):
                n = len(row["input_ids"])
                worst = abs(r["predictions"][i, :n] - ref["predictions"][i, :n]).max()
                assert worst <= 1e-4, f"{plan}, rank {rank}: predicted logits of row {i} differ by {worst:.3g}"
    state = results[0]["state"]
    worst = max((state[k] - v).abs().max().item() for k, v in ref["state"].items() if v.numel())
    assert worst <= PARAM_TOL, f"{plan}: weights differ from HF's Trainer by {worst:.3g}"


CASES = [  # plan, ranks, model, rows per data rank, accumulation, how the model arrives
    ("tp=2,dp_shard=2", 4, DENSE, 2, 2, "model"),
    ("dp_shard=2,zero=2", 2, DENSE, 2, 2, "model"),
    ("cp=2,dp_shard=2,cp_attention=zigzag", 4, DENSE, 2, 1, "model"),
    ("pp=2,dp_shard=2,pp_microbatches=2", 4, DENSE, 2, 2, "model"),
    ("dp_shard=2,ep=2", 2, MOE, 2, 1, "model"),
    ("dp_replicate=2,dp_shard=2", 4, DENSE, 1, 2, "model_init"),
    ("tp=2", 2, DENSE, 4, 1, "meta"),
    ("dp_replicate=2", 2, DENSE, 2, 2, "meta"),  # DDP: nothing sharded
]


@pytest.mark.parametrize("plan, ranks, spec, per_device, accumulation, init", CASES, ids=[c[0] for c in CASES])
def test_trainer_matches_hf_trainer_on_the_global_batch(dist, tmp_path, plan, ranks, spec, per_device, accumulation,
                                                        init):
    dp = meshkit.Plan.from_string(plan).resolve(ranks).dp
    data, eval_data = rows(per_device * dp * accumulation * 3), rows(per_device * dp * 2, seed=1)
    ref = reference_run(spec, data, str(tmp_path / "ref"), per_device * dp, accumulation, eval_data=eval_data)
    results = dist(ranks).run(_meshkit_run, plan, spec, data, str(tmp_path / "mk"), per_device, accumulation,
                              eval_data=eval_data, init=init)
    _compare(plan, ref, results)


OWN_LOSS = [  # plan, ranks, rows per data rank, accumulation, what replaces the Trainer's loss
    ("cp=2,tp=2,cp_attention=zigzag", 4, 2, 2, "compute_loss"),
    ("dp_shard=2,zero=1", 2, 2, 2, "compute_loss"),
    ("tp=2", 2, 2, 1, "label_smoothing"),
    ("dp_replicate=2", 2, 2, 2, "compute_loss"),  # DDP around the model's own forward and the caller's loss
]


@pytest.mark.parametrize("plan, ranks, per_device, accumulation, kind", OWN_LOSS, ids=[c[0] for c in OWN_LOSS])
def test_a_loss_of_ones_own_runs_through_the_models_forward(dist, tmp_path, plan, ranks, per_device, accumulation,
                                                            kind):
    """HF's compute_loss semantics (num_items_in_batch, its process-count scaling) through meshkit's
    forward inside pm.backward_context(): the same run as HF's Trainer with the same override."""
    dp = meshkit.Plan.from_string(plan).resolve(ranks).dp
    data, eval_data = rows(per_device * dp * accumulation * 3), rows(per_device * dp * 2, seed=1)
    cls, extra = (OwnLoss, {}) if kind == "compute_loss" else (transformers.Trainer, {"label_smoothing_factor": 0.1})
    ref = reference_run(DENSE, data, str(tmp_path / "ref"), per_device * dp, accumulation, trainer_cls=cls,
                        eval_data=eval_data, **extra)
    results = dist(ranks).run(_meshkit_run, plan, DENSE, data, str(tmp_path / "mk"), per_device, accumulation,
                              trainer_cls=cls, eval_data=eval_data, **extra)
    _compare(plan, ref, results)


def _logged_to_tensorboard(output_dir: str) -> list[str]:
    from datasets import Dataset

    os.environ["TENSORBOARD_LOGGING_DIR"] = os.path.join(output_dir, "tb")  # the pool restores the environment
    args = arguments(output_dir, 2, report_to=["tensorboard"])
    trainer = Trainer(model=DENSE.build(), args=args, train_dataset=Dataset.from_list(rows(12)),
                      data_collator=collate, plan="dp_shard=2")
    trainer.train()
    written = os.path.isdir(os.path.join(output_dir, "tb"))
    return sorted(os.listdir(os.path.join(output_dir, "tb"))) if trainer.is_world_process_zero() or written else []


def test_tensorboard_logging_writes_from_rank_0(dist, tmp_path):
    first, second = dist(2).run(_logged_to_tensorboard, str(tmp_path))
    assert len(first) == 1 and first[0].startswith("events.out.tfevents"), first
    assert second == first, "rank 1 wrote a log of its own"


def _sampler_run(plan: str | None, data: list[dict], output_dir: str) -> list[float]:
    from datasets import Dataset

    # Two epochs, rows grouped by length, an uneven last batch (accelerate pads it as for DDP).
    args = arguments(output_dir, 2, steps=-1, num_train_epochs=2, train_sampling_strategy="group_by_length",
                     dataloader_drop_last=False)
    kwargs = dict(model=DENSE.build(), args=args, train_dataset=Dataset.from_list(data), data_collator=collate)
    trainer = Trainer(plan=plan, **kwargs) if plan else transformers.Trainer(**kwargs)
    trainer.train()
    return losses(trainer.state.log_history)


def test_samplers_epochs_and_uneven_batches_follow_hf_ddp(dist, tmp_path):
    """group_by_length, epochs and a short last batch: the same rows per step as HF's own Trainer with
    DDP over the same two processes (a single process groups lengths by other megabatches)."""
    data = rows(18)
    ddp = dist(2).run(_sampler_run, None, data, str(tmp_path / "ddp"))
    mine = dist(2).run(_sampler_run, "dp_shard=2", data, str(tmp_path / "mk"))
    assert len(ddp[0]) == 10, ddp[0]  # 18 rows / (2 x 2) -> 5 steps per epoch
    for rank in range(2):
        assert mine[rank] == pytest.approx(ddp[rank], abs=LOSS_TOL), (mine[rank], ddp[rank])
