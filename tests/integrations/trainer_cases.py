"""Shared pieces of the Trainer/TRL tests: a tiny dataset and collator, the training arguments, and
the single-process HF reference each sharded run is compared with (run in the pytest process, which
has no process group, so transformers trains there as one plain process would)."""

from __future__ import annotations

import torch
import transformers

from meshkit.testing.reference import ModelSpec

VOCAB = 96
DENSE = ModelSpec(layers=2, vocab=VOCAB)
MOE = ModelSpec(layers=2, intermediate=16, experts=4, top_k=2, vocab=VOCAB)
LOSS_TOL = 2e-5     # fp32 losses of order 4, logged per step
PARAM_TOL = 2e-5    # after a few AdamW steps at lr 1e-2 with eps 1e-3 (notes: exactness needs eps ~1e-3)
SFT_LOSS_TOL = 1e-4  # TRL's SFT loss moves slightly between splits of one batch (tests/integrations/test_trl.py)
SFT_PARAM_TOL = 3e-4


def rows(count: int, seed: int = 0) -> list[dict]:
    """`count` examples of 5..12 tokens, a quarter of the labels ignored (-100)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        n = int(torch.randint(5, 13, (1,), generator=gen))
        ids = torch.randint(1, VOCAB, (n,), generator=gen)
        labels = ids.clone()
        labels[torch.rand(n, generator=gen) < 0.25] = -100
        out.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    return out


def collate(features: list[dict]) -> dict:
    """Right-pad to the longest row: pad id 0, label -100, attention mask 0."""
    longest = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), longest, dtype=torch.long)
    labels = torch.full((len(features), longest), -100, dtype=torch.long)
    mask = torch.zeros(len(features), longest, dtype=torch.long)
    for i, f in enumerate(features):
        n = len(f["input_ids"])
        ids[i, :n] = torch.tensor(f["input_ids"])
        labels[i, :n] = torch.tensor(f["labels"])
        mask[i, :n] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def arguments(output_dir: str, per_device: int, accumulation: int = 1, steps: int = 3, **extra):
    """TrainingArguments of every comparison: AdamW eps 1e-3, clipping at 1.0, weight decay, linear decay."""
    base = dict(output_dir=output_dir, per_device_train_batch_size=per_device,
                gradient_accumulation_steps=accumulation, max_steps=steps, learning_rate=1e-2, adam_epsilon=1e-3,
                weight_decay=0.1, max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to=[], seed=0,
                use_cpu=True, disable_tqdm=True, dataloader_drop_last=True)
    base.update(extra)
    return transformers.TrainingArguments(**base)


def sft_args(output_dir: str, per_device: int, accumulation: int, **extra):
    """TRL's SFTConfig of every SFT comparison (the same optimizer settings as `arguments`, fp32)."""
    import trl

    return trl.SFTConfig(output_dir=output_dir, per_device_train_batch_size=per_device,
                         gradient_accumulation_steps=accumulation, max_steps=3, learning_rate=1e-2, adam_epsilon=1e-3,
                         max_grad_norm=1.0, logging_steps=1, report_to=[], save_strategy="no", seed=0, use_cpu=True,
                         disable_tqdm=True, dataloader_drop_last=True, bf16=False, **extra)


def losses(log_history: list[dict]) -> list[float]:
    """The per-step training losses a Trainer logged."""
    return [entry["loss"] for entry in log_history if "loss" in entry]


class StopAt(transformers.TrainerCallback):
    """Ends training after `step` optimizer steps of a longer schedule (a run that was interrupted)."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        """Stop once `step` steps are done (the checkpoint of that step is still written)."""
        control.should_training_stop = state.global_step >= self.step


class OwnLoss(transformers.Trainer):
    """A user's `compute_loss` override (HF's loss through the model's own forward, logits checked)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """HF's loss; the logits must come back whole, one row per example, every position."""
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        assert outputs.logits.shape == (*inputs["input_ids"].shape, VOCAB), outputs.logits.shape
        return (loss, outputs) if return_outputs else loss


def reference_run(spec: ModelSpec, data: list[dict], output_dir: str, per_device: int, accumulation: int,
                  steps: int = 3, trainer_cls=transformers.Trainer, eval_data: list[dict] | None = None,
                  **extra) -> dict:
    """HF's own Trainer, one process, the global batch per step: its losses, grad norms and weights."""
    from datasets import Dataset

    model = spec.build()
    args = arguments(output_dir, per_device, accumulation, steps, per_device_eval_batch_size=per_device, **extra)
    trainer = trainer_cls(model=model, args=args, train_dataset=Dataset.from_list(data), data_collator=collate,
                          eval_dataset=None if eval_data is None else Dataset.from_list(eval_data))
    trainer.train()
    norms = [e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e]
    predicted = None if eval_data is None else trainer.predict(Dataset.from_list(eval_data)).predictions
    return {"losses": losses(trainer.state.log_history), "norms": norms,
            "eval": None if eval_data is None else trainer.evaluate()["eval_loss"], "predictions": predicted,
            "eval_rows": eval_data, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}

CHAT_VOCAB = 320
CHAT = ModelSpec(layers=2, vocab=CHAT_VOCAB)
# Assistant turns wrapped in generation tags: TRL's assistant_only_loss reads them from the template.
TEMPLATE = ("{% for m in messages %}{% if m.role == 'assistant' %}<|assistant|>{% generation %}{{ m.content }}"
            "<|end|>{% endgeneration %}{% else %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def make_tokenizer(directory: str):
    """A byte-level BPE (< CHAT_VOCAB tokens) with a pad token and a chat template with generation tags."""
    from meshkit.data.tokenizer import train_bpe

    texts = ["the cat sat on the mat", "a dog ran in the park", "what is two plus two", "four", "it is",
             "name a colour", "blue and green", "plus", "say hello"] * 5
    tok = train_bpe(texts, 300, directory)
    tok.add_special_tokens({"additional_special_tokens": ["<|user|>", "<|assistant|>", "<|end|>"]})
    tok.pad_token = tok.eos_token
    tok.chat_template = TEMPLATE
    tok.save_pretrained(directory)
    return tok


def prompt_completions(count: int) -> list[dict]:
    """Prompt-completion pairs of different lengths (completion-only loss)."""
    return [{"prompt": f"what is {i} plus {i % 3}" + " plus" * (i % 4), "completion": f" it is {i + i % 3} and a cat"}
            for i in range(count)]


def conversations(count: int) -> list[dict]:
    """Chats with one or two assistant turns (assistant-only loss)."""
    out = []
    for i in range(count):
        messages = [{"role": "user", "content": f"what is {i} plus two"}, {"role": "assistant", "content": f"it is {i + 2}"}]
        if i % 2:
            messages += [{"role": "user", "content": "say hello"}, {"role": "assistant", "content": "hello" + " a" * i}]
        out.append({"messages": messages})
    return out


def preferences(count: int) -> list[dict]:
    """Prompt, chosen and rejected completions of different lengths."""
    return [{"prompt": f"what is {i} plus two" + " plus" * (i % 3), "chosen": f" it is {i + 2}",
             "rejected": " a cat sat on the mat" + " a dog" * (i % 2)} for i in range(count)]
