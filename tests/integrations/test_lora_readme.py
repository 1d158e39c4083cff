"""The README's LoRA section is a complete program: run as written on 4 ranks (tp=2 x pp=2) against a
`save_pretrained` base directory, it trains the adapter and writes what `PeftModel.from_pretrained`
loads; the loaded adapter changes the base model's logits (it trained) and its tensors are PEFT's."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from meshkit.testing.reference import ModelSpec

README = Path(__file__).resolve().parents[2] / "README.md"


def lora_code() -> str:
    """The first python block under the README's "## LoRA (PEFT)" heading."""
    text = README.read_text()
    return re.search(r"```python\n(.*?)```", text[text.index("## LoRA (PEFT)"):], re.S).group(1)


def _run(code: str, base_dir: str, out_dir: str) -> None:
    sys.argv = ["lora.py", base_dir, out_dir]
    exec(compile(code, "README.md LoRA", "exec"), {"__name__": "__main__"})


def test_the_lora_section_runs_as_written(dist, tmp_path):
    code = lora_code()
    assert "--nproc-per-node 4" in code and "pm.load_hf_checkpoint(base_dir)" in code
    ModelSpec(layers=2, vocab=512, heads=4, kv_heads=2, head_dim=16, intermediate=64).build().save_pretrained(
        tmp_path / "base")
    outcomes = dist(4).run_raw(_run, code, str(tmp_path / "base"), str(tmp_path / "out"))
    assert all(o.ok for o in outcomes), "\n".join(f"rank {o.rank}: {o.message}\n{o.traceback}" for o in outcomes)
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval()
    ids = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = base(ids).logits
        after = PeftModel.from_pretrained(base, tmp_path / "out").eval()(ids).logits
    assert (after - before).abs().max() > 1e-4
