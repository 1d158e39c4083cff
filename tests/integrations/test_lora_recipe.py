"""The recipe with a [peft] table: a LoRA run from a base checkpoint trains only the adapter, and
`--export-hf` writes what PEFT loads (`PeftModel.from_pretrained`) or, with `--merge`, a full model
`from_pretrained` loads alone; both give the same logits."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import torch
import transformers
from peft import PeftModel

from meshkit.testing.reference import ModelSpec

ROOT = Path(__file__).resolve().parents[2]
BASE = ModelSpec(layers=2, vocab=128)
TOML = """
[peft]
method = "lora"
r = 4
alpha = 8
target_modules = ["q_proj", "v_proj", "o_proj", "down_proj"]

[plan]
tp = 2

[train]
steps = 2
seq_len = 32
local_batch = 2
lr = 0.01
warmup_steps = 1
threads = 1
sample_tokens = 0
heartbeat_s = 0
name = "run"
"""


def _recipe(config: str, base: str, log_dir: str, export: str, merge: bool) -> dict:
    if str(ROOT / "recipes") not in sys.path:
        sys.path.insert(0, str(ROOT / "recipes"))
    train_llama, train_config = importlib.import_module("train_llama"), importlib.import_module("train_config")
    args = ["--config", config, "--model-path", base, "--log-dir", log_dir, "--export-hf", export]
    args = train_llama.build_parser().parse_args(args + (["--merge"] if merge else []))
    return train_llama.train(train_config.apply_cli(train_config.load_config(config), args))


def test_lora_recipe_exports_the_adapter_and_the_merged_model(dist, tmp_path):
    BASE.build().save_pretrained(tmp_path / "base")
    (tmp_path / "lora.toml").write_text(TOML)
    for merge, out in ((False, "adapter"), (True, "merged")):
        summary = dist(2).run(_recipe, str(tmp_path / "lora.toml"), str(tmp_path / "base"), str(tmp_path / "runs"),
                              str(tmp_path / out), merge)[0]
        assert summary["last_loss"] == summary["last_loss"]  # finite
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    adapter = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    ids = torch.randint(0, BASE.vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        lora_logits, merged_logits = adapter(ids).logits, merged(ids).logits
        plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")(ids).logits
    assert (lora_logits - merged_logits).abs().max() < 1e-4
    assert (lora_logits - plain).abs().max() > 1e-3  # the adapter trained
