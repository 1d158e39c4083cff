"""PEFT LoRA models through the HF stack with `plan=`: a `PeftModel` given to meshkit's Trainer, to
`meshkit_trainer(trl.SFTTrainer)` (or a LoraConfig as TRL's `peft_config=`) and to
`meshkit_trainer(trl.DPOTrainer)` (the reference is the policy with its adapter disabled, as TRL
does without a reference model) trains as the same trainer does in one plain process on the global
batch: the same losses per step, the same adapter weights, the base untouched and frozen;
`save_model` writes the adapter as `PeftModel.save_pretrained` does, which `PeftModel.from_pretrained`
loads onto the base model; a `save_steps` checkpoint resumes under another plan and world size; TRL
DPO's second adapter is refused with the way out."""

from __future__ import annotations

import json
import os

import pytest
import torch
from trainer_cases import (
    CHAT,
    LOSS_TOL,
    PARAM_TOL,
    SFT_LOSS_TOL,
    SFT_PARAM_TOL,
    VOCAB,
    StopAt,
    arguments,
    collate,
    losses,
    make_tokenizer,
    preferences,
    prompt_completions,
    reference_run,
    rows,
    sft_args,
)

import meshkit
from meshkit.integrations.transformers import Trainer, meshkit_trainer
from meshkit.testing.reference import LoraSpec, ModelSpec

LORA = ModelSpec(layers=2, vocab=VOCAB, lora=LoraSpec())  # B drawn non-zero: A's gradient counts from step 1
CHAT_LORA = ModelSpec(layers=CHAT.layers, vocab=CHAT.vocab, lora=LoraSpec())


def _trainable(model: torch.nn.Module) -> list[str]:
    return sorted(n for n, p in model.named_parameters() if p.requires_grad)


def _check_adapter_export(directory: str, spec: ModelSpec, trained: dict[str, torch.Tensor]) -> None:
    """`directory` holds what PeftModel.save_pretrained writes (no base weights), and
    PeftModel.from_pretrained on the untrained base model gives back `trained`, base and adapter."""
    from peft import PeftModel

    files = set(os.listdir(directory))
    assert {"adapter_config.json", "adapter_model.safetensors"} <= files, files
    assert not files & {"model.safetensors", "model.safetensors.index.json"}, f"base weights written: {files}"
    with open(os.path.join(directory, "adapter_config.json")) as f:
        config = json.load(f)
    assert config["peft_type"] == "LORA" and config["r"] == spec.lora.r, config
    base = ModelSpec(**{**spec.__dict__, "lora": None}).build()
    loaded = PeftModel.from_pretrained(base, directory).state_dict()
    assert loaded.keys() == trained.keys()
    worst = max((loaded[k] - v).abs().max().item() for k, v in trained.items() if v.numel())
    assert worst == 0, f"the exported adapter differs from the trained one by {worst:.3g}"


def _trainer_run(plan: str, data: list[dict], output_dir: str, per_device: int, accumulation: int,
                 export: str) -> dict:
    from datasets import Dataset

    model = LORA.build()
    trainer = Trainer(model=model, args=arguments(output_dir, per_device, accumulation),
                      train_dataset=Dataset.from_list(data), data_collator=collate, plan=plan)
    trainer.train()
    trainer.save_model(export)
    history = trainer.state.log_history
    optimized = sum(p.numel() for g in trainer.optimizer.param_groups for p in g["params"])
    adapters = sum(p.numel() for n, p in trainer.parallel_model.named_parameters() if "lora_" in n)
    return {"losses": losses(history), "norms": [e["grad_norm"] for e in history if "grad_norm" in e],
            "trainable": _trainable(model), "optimized_is_adapters": optimized == adapters,
            "state": trainer.parallel_model.full_state_dict()}


TRAINER_CASES = [  # plan, ranks, rows per data rank, accumulation
    ("tp=2,dp_shard=2", 4, 2, 2),
    ("pp=2,dp_shard=2,pp_microbatches=2", 4, 2, 1),
]


@pytest.mark.parametrize("plan, ranks, per_device, accumulation", TRAINER_CASES, ids=[c[0] for c in TRAINER_CASES])
def test_trainer_trains_a_peft_model_as_hf_trainer_does(dist, tmp_path, plan, ranks, per_device, accumulation):
    dp = meshkit.Plan.from_string(plan).resolve(ranks).dp
    data = rows(per_device * dp * accumulation * 3)
    ref = reference_run(LORA, data, str(tmp_path / "ref"), per_device * dp, accumulation)
    export = str(tmp_path / "adapter")
    results = dist(ranks).run(_trainer_run, plan, data, str(tmp_path / "mk"), per_device, accumulation, export)
    frozen_ref = _trainable(LORA.build())
    for rank, r in enumerate(results):
        assert len(r["losses"]) == len(ref["losses"]) == 3, (r["losses"], ref["losses"])
        worst = max(abs(a - b) for a, b in zip(r["losses"], ref["losses"]))
        assert worst <= LOSS_TOL, f"{plan}, rank {rank}: losses {r['losses']} vs HF {ref['losses']}"
        worst = max(abs(a - b) for a, b in zip(r["norms"], ref["norms"]))
        assert worst <= LOSS_TOL, f"{plan}, rank {rank}: grad norms {r['norms']} vs HF {ref['norms']}"
        assert r["trainable"] == frozen_ref, f"rank {rank}: the trainable set changed"
        assert r["optimized_is_adapters"], f"rank {rank}: the optimizer holds more than the adapters"
    state = results[0]["state"]
    assert state.keys() == ref["state"].keys()
    worst = max((state[k] - v).abs().max().item() for k, v in ref["state"].items() if v.numel())
    assert worst <= PARAM_TOL, f"{plan}: weights differ from HF's Trainer by {worst:.3g}"
    initial = LORA.build().state_dict()
    assert any((ref["state"][k] - v).abs().max() > 1e-3 for k, v in initial.items() if "lora_" in k)
    assert all(torch.equal(state[k], v) for k, v in initial.items() if "lora_" not in k), "a base weight moved"
    _check_adapter_export(export, LORA, state)


def _resumable_run(plan: str, data: list[dict], output_dir: str, stop_at: int, resume: str | None = None) -> dict:
    from datasets import Dataset

    args = arguments(output_dir, 2, steps=4, save_strategy="steps", save_steps=2)
    trainer = Trainer(model=LORA.build(), args=args, train_dataset=Dataset.from_list(data), data_collator=collate,
                      plan=plan, callbacks=[StopAt(stop_at)])
    trainer.train(resume_from_checkpoint=resume)
    return {"losses": losses(trainer.state.log_history), "state": trainer.parallel_model.full_state_dict()}


def test_a_lora_trainer_checkpoint_resumes_under_another_plan(dist, tmp_path):
    """checkpoint-2 of a tp x fsdp run on 4 ranks (adapter, its AdamW state, the scheduler) resumed by
    fsdp on 2 ranks: steps 3-4 and the adapter land on HF's uninterrupted single-process run."""
    data = rows(4 * 4)
    ref = reference_run(LORA, data, str(tmp_path / "ref"), per_device=4, accumulation=1, steps=4)
    dist(4).run(_resumable_run, "tp=2,dp_shard=2", data, str(tmp_path / "run"), 2)
    folder = str(tmp_path / "run" / "checkpoint-2")
    second = dist(2).run(_resumable_run, "dp_shard=2", data, str(tmp_path / "run"), 4, resume=folder)
    for rank, r in enumerate(second):
        assert r["losses"] == pytest.approx(ref["losses"], abs=LOSS_TOL), (rank, r["losses"], ref["losses"])
    worst = max((second[0]["state"][k] - v).abs().max().item() for k, v in ref["state"].items() if v.numel())
    assert worst <= PARAM_TOL, f"resumed weights differ from the uninterrupted HF run by {worst:.3g}"


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tok")
    make_tokenizer(str(directory))
    return str(directory)


def _sft(plan: str | None, tokenizer_dir: str, data: list[dict], output_dir: str, per_device: int, wrap: str,
         extra: dict, save_to: str | None = None) -> dict:
    import trl
    from datasets import Dataset
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    cls = trl.SFTTrainer if plan is None else meshkit_trainer(trl.SFTTrainer)
    kwargs = {} if plan is None else {"plan": plan}
    if wrap == "peft_config":  # TRL wraps the HF model itself
        model, kwargs["peft_config"] = CHAT.build(), CHAT_LORA.lora.config()
        torch.manual_seed(1)
    else:
        model = CHAT_LORA.build()
    trainer = cls(model=model, args=sft_args(output_dir, per_device, 1, **extra), train_dataset=Dataset.from_list(data),
                  processing_class=tok, **kwargs)
    trainer.train()
    if save_to:
        trainer.save_model(save_to)
    if plan is None:
        state = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    else:
        state = trainer.parallel_model.full_state_dict()
    return {"losses": losses(trainer.state.log_history), "trainable": _trainable(trainer.model), "state": state}


SFT_CASES = [  # plan, ranks, how the adapter arrives, SFTConfig extras
    ("tp=2,dp_shard=2", 4, "model", {}),
    ("cp=2,tp=2,cp_attention=zigzag", 4, "peft_config", {"packing": True, "max_length": 64}),
]


@pytest.mark.parametrize("plan, ranks, wrap, extra", SFT_CASES,
                         ids=[f"{c[0]}-{c[2]}{'-packed' if c[3].get('packing') else ''}" for c in SFT_CASES])
def test_sft_trains_a_peft_model_as_trl_does(dist, tmp_path, tokenizer_dir, plan, ranks, wrap, extra):
    from peft import PeftModel
    from transformers import AutoTokenizer

    dp = meshkit.Plan.from_string(plan).resolve(ranks).dp
    data = prompt_completions(2 * dp * 3 * (4 if extra.get("packing") else 1))
    ref = _sft(None, tokenizer_dir, data, str(tmp_path / "ref"), 2 * dp, wrap, extra)
    export = str(tmp_path / "adapter")
    results = dist(ranks).run(_sft, plan, tokenizer_dir, data, str(tmp_path / "mk"), 2, wrap, extra, save_to=export)
    for rank, r in enumerate(results):
        worst = max(abs(a - b) for a, b in zip(r["losses"], ref["losses"]))
        assert len(r["losses"]) == 3 and worst <= SFT_LOSS_TOL, f"{plan}, rank {rank}: {r['losses']} vs {ref['losses']}"
        assert r["trainable"] == ref["trainable"] and all("lora_" in n for n in r["trainable"]), r["trainable"]
    state = results[0]["state"]
    assert state.keys() == ref["state"].keys()
    worst = max((state[k] - v).abs().max().item() for k, v in ref["state"].items() if v.numel())
    assert worst <= SFT_PARAM_TOL, f"{plan}: weights differ from TRL's by {worst:.3g}"
    _check_adapter_export(export, CHAT_LORA, state)
    assert isinstance(PeftModel.from_pretrained(CHAT.build(), export), PeftModel)
    assert AutoTokenizer.from_pretrained(export).chat_template == AutoTokenizer.from_pretrained(tokenizer_dir).chat_template


def _dpo(plan: str | None, tokenizer_dir: str, data: list[dict], output_dir: str, per_device: int,
         wrap: str = "peft_config") -> dict:
    import trl
    from datasets import Dataset
    from transformers import AutoTokenizer

    cls = trl.DPOTrainer if plan is None else meshkit_trainer(trl.DPOTrainer)
    kwargs = {} if plan is None else {"plan": plan}
    args = trl.DPOConfig(output_dir=output_dir, per_device_train_batch_size=per_device, max_steps=3, learning_rate=1e-2,
                         adam_epsilon=1e-3, max_grad_norm=1.0, logging_steps=1, report_to=[], save_strategy="no", seed=0,
                         use_cpu=True, disable_tqdm=True, dataloader_drop_last=True, bf16=False, beta=0.5)
    if wrap == "peft_config":  # TRL wraps the model; the reference is the base (the adapter disabled)
        model, kwargs["peft_config"] = CHAT.build(), CHAT_LORA.lora.config()
        torch.manual_seed(1)
    else:  # a PeftModel and no reference: TRL copies the adapter into a second one, "ref"
        model = CHAT_LORA.build()
    trainer = cls(model=model, args=args, train_dataset=Dataset.from_list(data),
                  processing_class=AutoTokenizer.from_pretrained(tokenizer_dir), **kwargs)
    trainer.train()
    history = trainer.state.log_history
    logged = {k: [e[k] for e in history if "loss" in e] for k in ("loss", "rewards/margins", "logps/chosen")}
    if plan is None:
        return {"logged": logged, "state": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}}
    return {"logged": logged, "state": trainer.parallel_model.full_state_dict()}


def test_dpo_trains_a_peft_model_against_its_disabled_adapter_as_trl_does(dist, tmp_path, tokenizer_dir):
    """`peft_config=`: TRL wraps the model, and the reference is the base model (the adapter disabled
    through PEFT's own switch, which meshkit's sharded LoRA layers honour)."""
    data = preferences(2 * 2 * 3)
    ref = _dpo(None, tokenizer_dir, data, str(tmp_path / "ref"), 4)
    results = dist(4).run(_dpo, "tp=2,dp_shard=2", tokenizer_dir, data, str(tmp_path / "mk"), 2)
    for rank, r in enumerate(results):
        for key, values in ref["logged"].items():
            worst = max(abs(a - b) for a, b in zip(r["logged"][key], values))
            assert len(values) == 3 and worst <= 1e-4, f"rank {rank}: {key} {r['logged'][key]} vs TRL {values}"
    state = results[0]["state"]
    assert state.keys() == ref["state"].keys()
    worst = max((state[k] - v).abs().max().item() for k, v in ref["state"].items() if v.numel())
    assert worst <= SFT_PARAM_TOL, f"weights differ from TRL's by {worst:.3g}"


def test_dpo_refuses_the_second_reference_adapter_with_the_way_out(dist, tmp_path, tokenizer_dir):
    """TRL's DPOTrainer copies a PeftModel's adapter into an adapter "ref" when no reference model is
    given; meshkit trains one adapter per model, so every rank refuses with what works instead."""
    outcomes = dist(2).run(_refused, _dpo, "dp_shard=2", tokenizer_dir, preferences(4), str(tmp_path / "mk"), 2,
                           "model")
    for message in outcomes:
        assert "'ref'" in message and "peft_config=" in message, message


def _refused(fn, *args) -> str:
    with pytest.raises(ValueError) as caught:
        fn(*args)
    return str(caught.value)
