"""`python -m meshkit.data info DIR`: what a token store holds, what a loss will count, whether it is intact.

Before a fine-tune a user wants three answers a manifest alone does not give: is there a loss mask
(a chat store's), how many tokens will actually be targets (a document's first token never is; with
a mask only its 1s are), and do the files still match their checksums. The store is opened without
verifying, so a store whose checksums fail is still described, every failing file named, with exit
status 2 (a missing or truncated file is refused as `TokenStore` refuses it, naming every such file).
Imports numpy and the store only: no torch, no datasets.
"""

from __future__ import annotations

import numpy as np

from meshkit.data.store import SPLITS, TokenStore

__all__ = ["describe", "main", "targets"]


def targets(store: TokenStore, split: str) -> int:
    """Tokens of `split` that carry a label: mask 1 (every token without a mask), minus each
    document's first token (context only in every packed row). Rows of seq_len drop one more per
    row from the loss: a row's first token has nothing before it to predict it from."""
    docs = store.split_documents(split)
    offsets = np.asarray(store.offsets)
    starts, stops = offsets[docs], offsets[docs + 1]
    if store.loss_mask is None:
        return int((stops - starts).sum()) - len(docs)
    mask = np.asarray(store.loss_mask)
    counted = np.concatenate([[0], np.cumsum(mask != 0, dtype=np.int64)])
    return int((counted[stops] - counted[starts]).sum()) - int((mask[starts] != 0).sum())


def describe(store: TokenStore, problems: list[str]) -> str:
    """The report `info` prints: sizes, tokenizer, loss mask and targets per split, checksums."""
    m = store.manifest
    lines = [f"{store.path}: {store.num_documents} documents, {store.num_tokens:,} tokens ({store.dtype.name}), "
             f"vocab {store.vocab_size}, eos id {store.eos_id}, tokenizer sha256 {store.tokenizer_hash[:12]} "
             f"({'saved in tokenizer/' if store.has_tokenizer() else 'not saved with the store'})"]
    if store.loss_mask is None:
        lines.append("  loss mask: none (every token but a document's first is a target)")
    else:
        lines.append("  loss mask: present (loss_mask.bin: only tokens marked 1, e.g. a chat's assistant turns, "
                     "are targets)")
    for split in SPLITS:
        info = store.split_info(split)
        count = targets(store, split)
        share = f" ({100 * count / info.tokens:.1f}%)" if info.tokens else ""
        lines.append(f"  {split}: {info.documents} documents, {info.tokens:,} tokens, {count:,} targets{share}")
    checked = ", ".join(sorted(m.get("files", {})))
    lines.append(f"  checksums: {'FAILED: ' + '; '.join(problems) if problems else 'ok'} (sha256 of {checked})")
    return "\n".join(lines)


def main(directory: str) -> int:
    """Print the report; 0 when every file matches the manifest, 2 otherwise (or when it does not open)."""
    store = TokenStore(directory, verify=False)
    problems = store.file_problems(verify=True)
    print(describe(store, problems))
    return 2 if problems else 0
