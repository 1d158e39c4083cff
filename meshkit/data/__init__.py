"""meshkit.data: text corpora to packed, resumable batches whose order does not depend on the plan.

    python -m meshkit.data prepare INPUT... --output DIR (--tokenizer DIR | --vocab-size N)
    python -m meshkit.data info DIR
    store = meshkit.data.TokenStore(DIR)
    loader = pm.dataloader(store, seq_len=..., global_batch=..., seed=...)   # or PackedLoader(...)
    for input_ids, labels, position_ids in loader: ...

Modules, one concept each: `sources` (which files, how a record becomes a document), `chat` (chat
records through the tokenizer's template, with assistant-only loss masks), `tokenizer` (load a local
HF tokenizer, train a byte-level BPE), `prepare` (the atomic writer; its CLI in `__main__`), `store`
(`TokenStore`, memory-mapped), `info` (what `info` prints), `packing` (rows of a split as a pure
function of (seed, epoch, index)), `blend` (sources mixed by weight), `loader` (`PackedLoader`:
batches of one dp rank, state_dict, background prefetch).

A store may hold a per-token loss mask (`loss_mask.bin`, 0 = never a target), written by any
`sources.DocumentSource` whose `encode` returns masks (`chat.CHAT` does); the loader turns mask 0 into
label -100.

The names below resolve on first use, like `meshkit`'s own: `TokenStore` costs numpy, `PackedLoader`
adds torch, and nothing here imports `datasets` (only `prepare` does).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from meshkit.data.blend import BlendedRows
    from meshkit.data.loader import PackedLoader
    from meshkit.data.packing import PackedRows
    from meshkit.data.store import TokenStore

_HOMES = {"BlendedRows": "meshkit.data.blend", "PackedLoader": "meshkit.data.loader",
          "PackedRows": "meshkit.data.packing", "TokenStore": "meshkit.data.store"}

__all__ = ["BlendedRows", "PackedLoader", "PackedRows", "TokenStore"]


def __getattr__(name: str) -> Any:
    """A public name, imported from its home module the first time it is asked for."""
    if name not in _HOMES:
        raise AttributeError(f"module 'meshkit.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})
