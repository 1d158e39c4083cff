"""TRL's trainers with `plan=` (`meshkit_trainer(trl.SFTTrainer)` / `DPOTrainer`) against TRL's own
trainer in one plain process on the global batch: SFT with completion-only loss, assistant-only
loss and packing (position ids; documents kept apart under every CP kind), DPO with a reference
model under the same plan.

TRL's SFT loss depends slightly on how one batch is split (measured: up to ~7e-5 in weights between
splits of the same batch in one process, its own behaviour), so SFT is compared at 1e-4 (loss) and
3e-4 (weights) rather than meshkit's exactness tolerances."""

from __future__ import annotations

import pytest
from trainer_cases import (
    CHAT,
    SFT_LOSS_TOL,
    SFT_PARAM_TOL,
    conversations,
    losses,
    make_tokenizer,
    preferences,
    prompt_completions,
    sft_args,
)
from transformers import AutoModelForCausalLM, AutoTokenizer

import meshkit
from meshkit.integrations.transformers import meshkit_trainer


def _sft(plan: str | None, tokenizer_dir: str, data: list[dict], output_dir: str, per_device: int, accumulation: int,
         extra: dict, save_to: str | None = None) -> dict:
    import trl
    from datasets import Dataset
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    cls = trl.SFTTrainer if plan is None else meshkit_trainer(trl.SFTTrainer)
    kwargs = {} if plan is None else {"plan": plan}
    trainer = cls(model=CHAT.build(), args=sft_args(output_dir, per_device, accumulation, **extra),
                  train_dataset=Dataset.from_list(data), processing_class=tok, **kwargs)
    trainer.train()
    if save_to:
        trainer.save_model(save_to)
    history = trainer.state.log_history
    if plan is None:
        state = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    else:
        state = trainer.parallel_model.full_state_dict()  # collective: every rank gathers
    return {"losses": losses(history), "accuracy": [e["mean_token_accuracy"] for e in history if "loss" in e],
            "tokens": [e["num_tokens"] for e in history if "loss" in e], "state": state}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tok")
    make_tokenizer(str(directory))
    return str(directory)


SFT_CASES = [  # plan, ranks, data, rows per data rank, accumulation, SFTConfig extras
    ("tp=2,dp_shard=2", 4, "completion", 2, 2, {}),
    ("cp=2,tp=2,cp_attention=zigzag", 4, "chat", 2, 1, {"assistant_only_loss": True}),
    ("cp=2,dp_shard=2,cp_attention=ulysses", 4, "completion", 2, 1, {"packing": True, "max_length": 64}),
    ("cp=2,dp_shard=2,cp_attention=ring", 4, "chat", 2, 1, {"packing": True, "max_length": 64,
                                                             "assistant_only_loss": True}),
]


@pytest.mark.parametrize("plan, ranks, kind, per_device, accumulation, extra", SFT_CASES,
                         ids=[f"{c[0]}-{c[2]}{'-packed' if c[5].get('packing') else ''}" for c in SFT_CASES])
def test_sft_matches_trl_on_the_global_batch(dist, tmp_path, tokenizer_dir, plan, ranks, kind, per_device,
                                             accumulation, extra):
    dp = meshkit.Plan.from_string(plan).resolve(ranks).dp
    count = per_device * dp * accumulation * 3 * (4 if extra.get("packing") else 1)
    data = prompt_completions(count) if kind == "completion" else conversations(count)
    ref = _sft(None, tokenizer_dir, data, str(tmp_path / "ref"), per_device * dp, accumulation, extra)
    export = str(tmp_path / "export")
    results = dist(ranks).run(_sft, plan, tokenizer_dir, data, str(tmp_path / "mk"), per_device, accumulation, extra,
                              save_to=export)
    for rank, r in enumerate(results):
        assert len(r["losses"]) == len(ref["losses"]) == 3, (r["losses"], ref["losses"])
        worst = max(abs(a - b) for a, b in zip(r["losses"], ref["losses"]))
        assert worst <= SFT_LOSS_TOL, f"{plan}, rank {rank}: losses {r['losses']} vs TRL {ref['losses']}"
        assert r["tokens"] == ref["tokens"], f"{plan}, rank {rank}: num_tokens {r['tokens']} vs TRL {ref['tokens']}"
        worst = max(abs(a - b) for a, b in zip(r["accuracy"], ref["accuracy"]))
        assert worst <= 1e-6, f"{plan}, rank {rank}: token accuracy {r['accuracy']} vs TRL {ref['accuracy']}"
    state = results[0]["state"]
    worst = max((state[k] - v).abs().max().item() for k, v in ref["state"].items() if v.numel())
    assert worst <= SFT_PARAM_TOL, f"{plan}: weights differ from TRL's by {worst:.3g}"
    # save_model: the weights from_pretrained loads, and the tokenizer with its chat template beside them
    loaded = AutoModelForCausalLM.from_pretrained(export).state_dict()
    assert max((loaded[k] - v).abs().max().item() for k, v in state.items() if v.numel()) == 0
    assert AutoTokenizer.from_pretrained(export).chat_template == AutoTokenizer.from_pretrained(tokenizer_dir).chat_template


def _dpo(plan: str | None, tokenizer_dir: str, data: list[dict], output_dir: str, per_device: int) -> dict:
    import trl
    from datasets import Dataset
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    cls = trl.DPOTrainer if plan is None else meshkit_trainer(trl.DPOTrainer)
    kwargs = {} if plan is None else {"plan": plan}
    args = trl.DPOConfig(output_dir=output_dir, per_device_train_batch_size=per_device, max_steps=3, learning_rate=1e-2,
                         adam_epsilon=1e-3, max_grad_norm=1.0, logging_steps=1, report_to=[], save_strategy="no", seed=0,
                         use_cpu=True, disable_tqdm=True, dataloader_drop_last=True, bf16=False, beta=0.5)
    # The reference: the same initial weights, frozen; under the plan it is parallelized like the policy.
    trainer = cls(model=CHAT.build(), ref_model=CHAT.build(), args=args, train_dataset=Dataset.from_list(data),
                  processing_class=tok, **kwargs)
    trainer.train()
    history = trainer.state.log_history
    keys = ("loss", "rewards/margins", "logps/chosen", "rewards/accuracies")
    logged = {k: [e[k] for e in history if "loss" in e] for k in keys}
    if plan is None:
        state = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    else:
        state = trainer.parallel_model.full_state_dict()
        assert trainer.ref_parallel_model.plan == trainer.parallel_model.plan
    return {"logged": logged, "state": state}


@pytest.mark.parametrize("plan, ranks", [("tp=2,dp_shard=2", 4), ("cp=2,dp_shard=2,cp_attention=zigzag", 4)],
                         ids=["tp=2,dp_shard=2", "cp=2,dp_shard=2,cp_attention=zigzag"])
def test_dpo_with_a_reference_model_under_the_same_plan_matches_trl(dist, tmp_path, tokenizer_dir, plan, ranks):
    dp = meshkit.Plan.from_string(plan).resolve(ranks).dp
    data = preferences(2 * dp * 3)
    ref = _dpo(None, tokenizer_dir, data, str(tmp_path / "ref"), 2 * dp)
    results = dist(ranks).run(_dpo, plan, tokenizer_dir, data, str(tmp_path / "mk"), 2)
    for rank, r in enumerate(results):
        for key, values in ref["logged"].items():
            assert len(values) == 3, (key, values)
            worst = max(abs(a - b) for a, b in zip(r["logged"][key], values))
            assert worst <= 1e-4, f"{plan}, rank {rank}: {key} {r['logged'][key]} vs TRL {values}"
    state = results[0]["state"]
    worst = max((state[k] - v).abs().max().item() for k, v in ref["state"].items() if v.numel())
    assert worst <= SFT_PARAM_TOL, f"{plan}: weights differ from TRL's by {worst:.3g}"
