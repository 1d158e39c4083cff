"""`meshkit.integrations.transformers.Trainer` against HF's own Trainer in one plain process on the
global batch: the same logged losses and gradient norms per step and the same weights after the
last step, under tp x FSDP with gradient accumulation (CI), and zero-2, cp, pp, ep, HSDP and tp
without FSDP (slow)."""

from __future__ import annotations

import pytest
from trainer_cases import DENSE, LOSS_TOL, MOE, PARAM_TOL, arguments, collate, losses, reference_run, rows

import meshkit
from meshkit.integrations.transformers import Trainer


def _meshkit_run(plan: str, spec, data: list[dict], output_dir: str, per_device: int, accumulation: int) -> dict:
    from datasets import Dataset

    trainer = Trainer(model=spec.build(), args=arguments(output_dir, per_device, accumulation),
                      train_dataset=Dataset.from_list(data), data_collator=collate, plan=plan)
    trainer.train()
    history = trainer.state.log_history
    state = trainer.parallel_model.full_state_dict()
    return {"losses": losses(history), "norms": [e["grad_norm"] for e in history if "grad_norm" in e],
            "state": state if trainer.is_world_process_zero() else None}


CASES = [  # plan, ranks, model, rows per data rank, accumulation
    ("tp=2,dp_shard=2", 4, DENSE, 2, 2),
    ("dp_shard=2,zero=2", 2, DENSE, 2, 2),
    ("cp=2,dp_shard=2,cp_attention=zigzag", 4, DENSE, 2, 1),
    ("pp=2,dp_shard=2,pp_microbatches=2", 4, DENSE, 2, 2),
    ("dp_shard=2,ep=2", 2, MOE, 2, 1),
    ("dp_replicate=2,dp_shard=2", 4, DENSE, 1, 2),
    ("tp=2", 2, DENSE, 4, 1),
]


@pytest.mark.parametrize("plan, ranks, spec, per_device, accumulation", CASES, ids=[c[0] for c in CASES])
def test_trainer_matches_hf_trainer_on_the_global_batch(dist, tmp_path, plan, ranks, spec, per_device, accumulation):
    dp = meshkit.Plan.from_string(plan).resolve(ranks).dp
    data = rows(per_device * dp * accumulation * 3)
    ref = reference_run(spec, data, str(tmp_path / "ref"), per_device * dp, accumulation)
    results = dist(ranks).run(_meshkit_run, plan, spec, data, str(tmp_path / "mk"), per_device, accumulation)
    for rank, r in enumerate(results):
        assert len(r["losses"]) == len(ref["losses"]) == 3, (r["losses"], ref["losses"])
        worst = max(abs(a - b) for a, b in zip(r["losses"], ref["losses"]))
        assert worst <= LOSS_TOL, f"{plan}, rank {rank}: losses {r['losses']} vs HF {ref['losses']}"
        worst = max(abs(a - b) for a, b in zip(r["norms"], ref["norms"]))
        assert worst <= LOSS_TOL, f"{plan}, rank {rank}: grad norms {r['norms']} vs HF {ref['norms']}"
    state = results[0]["state"]
    worst = max((state[k] - v).abs().max().item() for k, v in ref["state"].items() if v.numel())
    assert worst <= PARAM_TOL, f"{plan}: weights differ from HF's Trainer by {worst:.3g}"
