"""meshkit.data: text corpora to packed, resumable batches whose order does not depend on the plan.

    python -m meshkit.data prepare INPUT... --output DIR (--tokenizer DIR | --vocab-size N)
    store = meshkit.data.TokenStore(DIR)
    loader = pm.dataloader(store, seq_len=..., global_batch=..., seed=...)   # or PackedLoader(...)
    for input_ids, labels, position_ids in loader: ...

Modules, one concept each: `sources` (which files, how a record becomes a document), `tokenizer`
(load a local HF tokenizer, train a byte-level BPE), `prepare` (the atomic writer and its CLI in
`__main__`), `store` (`TokenStore`, memory-mapped), `packing` (rows of a split as a pure function of
(seed, epoch, index)), `blend` (sources mixed by weight), `loader` (`PackedLoader`: batches of one dp
rank, state_dict, background prefetch).

Supervised fine-tuning hook: a store may hold a per-token loss mask (`loss_mask.bin`, 0 = never a
target), written by any `sources.DocumentSource` whose `encode` returns masks; the loader turns mask 0
into label -100. A chat source adds a module `meshkit/data/chat.py` defining a `DocumentSource` (field
`messages`, encoded with `apply_chat_template`, mask 1 on assistant tokens) and a `--chat` flag in
`__main__` passing it as `prepare(..., source=CHAT)`; nothing else changes.

Only the reading side is imported here (`TokenStore`, `PackedLoader`, `PackedRows`, `BlendedRows`): a training process
never pays for `datasets`. `prepare` lives in `meshkit.data.prepare`.
"""

from meshkit.data.blend import BlendedRows
from meshkit.data.loader import PackedLoader
from meshkit.data.packing import PackedRows
from meshkit.data.store import TokenStore

__all__ = ["BlendedRows", "PackedLoader", "PackedRows", "TokenStore"]
