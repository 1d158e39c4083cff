"""`meshkit.data` is light to import and `python -m meshkit.data info` says what a fine-tune needs: no
torch (let alone torch.distributed.checkpoint) or datasets on import; the loss mask, the number of
targets (against a one-pass loader's labels) and the checksums, with exit status 2 on a damaged store."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import torch

from meshkit.data import PackedLoader
from meshkit.data.packing import IGNORE
from meshkit.data.store import TOKENS, write_store

HEAVY = ("torch", "datasets", "transformers")


def _store(path, masked: bool):
    rng = np.random.default_rng(1)
    docs = [np.append(rng.integers(1, 300, n - 1), 0) for n in rng.integers(2, 30, 25)]
    masks = [rng.integers(0, 2, len(d)) for d in docs] if masked else None
    return write_store(path, docs, eos_id=0, vocab_size=300, split_ids=(np.arange(25) % 4 == 3).astype(np.uint8),
                       loss_masks=masks)


def _info(store_dir) -> tuple[int, str, list[str]]:
    """Run `python -m meshkit.data info` in a fresh interpreter; (status, output, heavy modules it imported)."""
    code = ("import runpy, sys, json\n"
            f"sys.argv = ['meshkit.data', 'info', {str(store_dir)!r}]\n"
            "try:\n    runpy.run_module('meshkit.data', run_name='__main__')\n"
            "except SystemExit as e:\n    status = e.code\n"
            f"print(json.dumps([status, sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})]))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    status, heavy = json.loads(out.stdout.strip().splitlines()[-1])
    return status, out.stdout + out.stderr, heavy


def test_importing_meshkit_data_pulls_no_torch_or_datasets():
    code = f"import meshkit.data, sys; print(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_info_reports_mask_targets_and_checksums(tmp_path):
    for masked in (True, False):
        store = _store(tmp_path / f"s{masked}", masked)
        status, output, heavy = _info(store.path)
        assert status == 0 and not heavy, (status, heavy, output)
        assert ("loss mask: present" if masked else "loss mask: none") in output, output
        for split in ("train", "val"):  # every target a one-pass loader produces, counted from its labels
            loader = PackedLoader(store, seq_len=8, global_batch=4, split=split, repeat=False, prefetch=0)
            labels = torch.cat([b[1] for b in loader])
            info = store.split_info(split)
            assert f"{split}: {info.documents} documents, {info.tokens:,} tokens, " \
                   f"{int((labels != IGNORE).sum()):,} targets" in output, output
        assert "checksums: ok" in output
    tokens = store.path / TOKENS
    data = bytearray(tokens.read_bytes())
    data[3] ^= 0xFF  # same size, other content
    tokens.write_bytes(bytes(data))
    status, output, _ = _info(store.path)
    assert status == 2 and "checksums: FAILED: tokens.bin's sha256 does not match" in output, output
