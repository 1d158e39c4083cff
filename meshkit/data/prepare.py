"""`prepare`: text in, token store out (`python -m meshkit.data prepare`; see `meshkit.data.store`).

The steps: resolve INPUT paths (`sources.find_inputs`), read every document into one
`datasets.Dataset` (`sources.read_documents`), load the tokenizer or train a byte-level BPE on the
training documents, tokenize with `Dataset.map` over several processes (its progress bar), and write
the flat token array, offsets, split ids, tokenizer and manifest.

Why a temporary directory: everything is written under `.<output>.tmp-<host>-<pid>` next to the
output and renamed into place only when complete, so an interrupted prepare leaves the old store (or
nothing), never half a store; the next prepare of the same output removes the temporaries of a
prepare that no longer runs. The tokenizing worker processes die with their parent (Linux:
PR_SET_PDEATHSIG), so a killed prepare leaves no worker behind holding gigabytes. Why a fingerprint
of the inputs: re-running with unchanged inputs and options is a no-op, so a recipe or Makefile can
call prepare unconditionally; a store whose checksums fail is never "up to date", it is written again.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import shutil
import signal
import socket
import sys
import time
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import numpy as np
from tqdm import tqdm

from meshkit.data import sources, store
from meshkit.data import tokenizer as tokenizers_lib
from meshkit.data.sources import TEXT, DocumentSource
from meshkit.data.store import FORMAT_VERSION, TokenStore

__all__ = ["PrepareResult", "prepare"]

ERRORS = ("strict", "replace")


@dataclass(frozen=True)
class PrepareResult:
    """What `prepare` did, so the CLI and callers can report a no-op re-run apart from a fresh write."""

    path: Path
    skipped: bool  # the store was already up to date
    manifest: dict[str, Any]


def _check_options(tokenizer, vocab_size, val, val_fraction, errors, workers) -> None:
    if (tokenizer is None) == (vocab_size is None):
        raise ValueError("prepare: give exactly one of --tokenizer DIR (an existing HF tokenizer) or "
                         "--vocab-size N (train a byte-level BPE on the input)")
    if val and val_fraction:
        raise ValueError("prepare: --val and --val-fraction both given; fix: one way to hold documents out")
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"prepare: --val-fraction {val_fraction}: must be in [0, 1)")
    if errors not in ERRORS:
        raise ValueError(f"prepare: --errors {errors!r}: one of {list(ERRORS)}")
    if workers < 1:
        raise ValueError(f"prepare: --workers {workers}: must be >= 1")


def _fingerprint(found: sources.Inputs, val_found: sources.Inputs | None, options: dict[str, Any]) -> str:
    """Paths, sizes and modification times of every input file, and the options: cheap to recompute."""
    def stats(inputs):
        return [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in inputs.files()]

    blob = json.dumps({"inputs": stats(found), "val": stats(val_found) if val_found else None, **options},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def _up_to_date(output: Path, fingerprint: str, progress: bool) -> dict[str, Any] | None:
    """The store's manifest when it was written from these inputs and options and still verifies.

    Checksums are checked (seconds per GB): a store damaged since it was written must be written
    again, not reported "up to date".
    """
    if not (output / store.MANIFEST).is_file():
        return None
    try:
        manifest = json.loads((output / store.MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("inputs_fingerprint") != fingerprint:
        return None
    try:
        return TokenStore(output, verify=True).manifest
    except ValueError as err:
        if progress:
            print(f"prepare: the existing store does not verify ({err}); writing it again", file=sys.stderr,
                  flush=True)
        return None


def _encode_batch(batch: dict[str, list], tok: Any, source: DocumentSource, eos_id: int) -> dict[str, list]:
    """One `Dataset.map` batch: each document's token ids (EOS-terminated) and loss mask ([] for none)."""
    ids_out, masks_out = [], []
    for ids, mask in source.encode(tok, batch["text"]):
        ids = np.asarray(ids, dtype=np.int64)  # 8 bytes a token, not a Python int object each (one huge line)
        mask = None if mask is None else list(mask)
        if mask is not None and len(mask) != len(ids):
            raise ValueError(f"document source {source.name!r}: a mask of {len(mask)} for {len(ids)} tokens")
        if not len(ids) or ids[-1] != eos_id:
            ids = np.append(ids, eos_id)
            if mask is not None:
                mask.append(1)
        ids_out.append(ids)
        masks_out.append(mask or [])
    return {"input_ids": ids_out, "loss_mask": masks_out}


def prepare(
    inputs: Sequence[str | os.PathLike],
    output: str | os.PathLike,
    *,
    tokenizer: str | os.PathLike | None = None,
    vocab_size: int | None = None,
    val: Sequence[str | os.PathLike] | None = None,
    val_fraction: float = 0.0,
    text_field: str = "text",
    globs: Sequence[str] | None = None,
    errors: str = "strict",
    workers: int = 1,
    seed: int = 0,
    source: DocumentSource = TEXT,
    progress: bool = True,
) -> PrepareResult:
    """Write the token store of `inputs` to `output`; a no-op when it is up to date. See the module doc.

    Held-out documents: `val_fraction` picks that share of the documents by a permutation seeded by
    `seed` (deterministic), or `val` names separate inputs. Every bad input raises ValueError before
    anything is written to `output`.
    """
    _check_options(tokenizer, vocab_size, val, val_fraction, errors, workers)
    found = sources.find_inputs(inputs, globs)
    val_found = sources.find_inputs(val, globs, what="--val") if val else None
    tok = tokenizers_lib.load_tokenizer(tokenizer) if tokenizer is not None else None
    output = Path(output).expanduser()
    options = {"tokenizer": tokenizers_lib.tokenizer_hash(tok) if tok else None, "vocab_size": vocab_size,
               "val_fraction": val_fraction, "text_field": text_field, "globs": list(globs or []),
               "errors": errors, "seed": seed, "source": source.name, "format": FORMAT_VERSION}
    fingerprint = _fingerprint(found, val_found, options)
    manifest = _up_to_date(output, fingerprint, progress)
    if manifest is not None:
        return PrepareResult(output, True, manifest)
    if output.exists() and not (output / store.MANIFEST).is_file() and any(output.iterdir()):
        raise ValueError(f"--output {str(output)!r}: exists and is not a token store; fix: name a new directory "
                         "(prepare replaces only a directory it wrote)")

    output.parent.mkdir(parents=True, exist_ok=True)
    for stale in remove_stale_temporaries(output):
        if progress:
            print(f"prepare: removed {stale} (left by a prepare that no longer runs)", file=sys.stderr, flush=True)
    tmp = output.parent / f".{output.name}.tmp-{_ME}"
    shutil.rmtree(tmp, ignore_errors=True)
    work = tmp / ".work"
    work.mkdir(parents=True)
    bars_were_off = datasets.is_progress_bar_enabled() is False
    if not progress:
        datasets.disable_progress_bars()
    try:
        manifest = _write(found, val_found, tmp, work, tok, vocab_size, text_field, errors, workers, seed,
                          val_fraction, source, progress)
        manifest["inputs_fingerprint"] = fingerprint
        (tmp / store.MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
        shutil.rmtree(work)
        _swap_into_place(tmp, output)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if not progress and not bars_were_off:
            datasets.enable_progress_bars()
    return PrepareResult(output, False, manifest)


def _swap_into_place(tmp: Path, output: Path) -> None:
    """Rename the finished store over `output`; an older store is moved aside first, then deleted."""
    old = None
    if output.exists():
        old = output.parent / f".{output.name}.old-{_ME}"
        output.rename(old)
    tmp.rename(output)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _write(found, val_found, tmp: Path, work: Path, tok, vocab_size, text_field, errors, workers, seed,
           val_fraction, source, progress) -> dict[str, Any]:
    read = dict(field=text_field, source=source, errors=errors, cache_dir=str(work / "cache"))
    docs = sources.read_documents(found, **read)
    n_train_inputs = len(docs)
    if val_found is not None:
        docs = datasets.concatenate_datasets([docs, sources.read_documents(val_found, **read)])
    split_ids = _split_ids(len(docs), n_train_inputs, val_fraction, seed)  # before any tokenizing
    if tok is None:
        texts = ([p for text in batch["text"] for p in sources.pieces(text)]  # bounded memory, as tokenizing
                 for batch in docs.select(range(n_train_inputs)).iter(batch_size=1000))
        if progress:  # seconds per MiB of input, silent otherwise: say what runs before the tokenize bar
            print(f"prepare: training a byte-level BPE of {vocab_size} tokens on the {n_train_inputs} input "
                  f"documents", file=sys.stderr, flush=True)
        tok = tokenizers_lib.train_bpe(texts, vocab_size, tmp / store.TOKENIZER, show_progress=progress,
                                       length=n_train_inputs)
    else:
        tok.save_pretrained(str(tmp / store.TOKENIZER))
    text_bytes = sum(f.stat().st_size for inputs in (found, val_found) if inputs for f in inputs.files())
    processes = tokenizing_processes(workers, text_bytes)
    if processes < workers and progress:
        print(f"prepare: {text_bytes / 2**20:.1f} MiB of input: tokenizing in {processes} process"
              f"{'es' if processes > 1 else ''}, not {workers} (starting one costs more than its share of "
              f"under {BYTES_PER_PROCESS / 2**20:.0f} MiB saves; the tokenizer's own threads still run)",
              file=sys.stderr, flush=True)
    if processes > 1:  # one process per worker; Rust threads inside each would oversubscribe the cores
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    eos_id = int(tok.eos_token_id)
    with _workers_die_with_this_process():
        encoded = docs.map(_encode_batch, batched=True, batch_size=256, num_proc=processes if processes > 1 else None,
                           remove_columns=["text"], fn_kwargs={"tok": tok, "source": source, "eos_id": eos_id},
                           cache_file_name=str(work / "tokenized.arrow"), desc="tokenize")

    vocab = len(tok)
    dtype = store.token_dtype(vocab)
    lengths = np.zeros(len(encoded), dtype=np.int64)
    has_mask = any(len(chunk.flatten()) for chunk in encoded.data.column("loss_mask").chunks)
    row = 0
    with open(tmp / store.TOKENS, "wb") as tokens_f, \
            open(tmp / store.LOSS_MASK, "wb") if has_mask else open(os.devnull, "wb") as mask_f:
        batches = encoded.with_format("arrow").iter(batch_size=4096)
        for batch in tqdm(batches, total=-(-len(encoded) // 4096), desc="write", disable=not progress):
            ids = batch.column("input_ids").combine_chunks()
            flat = ids.flatten().to_numpy(zero_copy_only=False)
            count = ids.value_lengths().to_numpy(zero_copy_only=False)
            lengths[row:row + len(count)] = count
            row += len(count)
            if flat.size and int(flat.max()) >= vocab:
                raise ValueError(f"document source {source.name!r}: token id {int(flat.max())} >= vocabulary {vocab}")
            flat.astype(dtype).tofile(tokens_f)
            if has_mask:
                masks = batch.column("loss_mask").to_pylist()
                for n, mask in zip(count, masks):
                    np.asarray(mask or np.ones(n), dtype=np.uint8).tofile(mask_f)
    return store.finish_store(
        tmp, lengths, split_ids, dtype=dtype, eos_id=eos_id,
        vocab_size=vocab, tokenizer_sha256=tokenizers_lib.tokenizer_hash(tok), has_mask=has_mask,
        source=source.name, created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))


# Input per tokenizing process below which one more process costs more than it saves, measured by
# `python -m benchmarks.data --scaling` (benchmarks/results/data_scaling.md).
BYTES_PER_PROCESS = 2**20


def tokenizing_processes(workers: int, text_bytes: int) -> int:
    """How many of `workers` processes to tokenize `text_bytes` of input with.

    Each process `datasets.map` starts re-imports the libraries and unpickles the tokenizer (about a
    second), while one process tokenizes roughly a megabyte a second. Measured on 2 quiet cores
    (benchmarks/results/data_scaling.md), a second process was 1.09x one at 1 MB of stdlib source,
    0.71x at 0.3 MB and 1.43-1.55x from 4 to 30 MB; so each process gets at least BYTES_PER_PROCESS
    (1 MiB) of input, and below that the work stays in this process.
    """
    return max(1, min(workers, text_bytes // BYTES_PER_PROCESS))


def _split_ids(n_docs: int, n_train_inputs: int, val_fraction: float, seed: int) -> np.ndarray:
    """0 = train, 1 = val per document: `--val` documents come after the training inputs' documents."""
    ids = np.zeros(n_docs, dtype=np.uint8)
    ids[n_train_inputs:] = store.SPLITS["val"]
    if val_fraction:
        k = round(val_fraction * n_train_inputs)
        if k == 0 or k == n_train_inputs:
            raise ValueError(f"--val-fraction {val_fraction} of {n_train_inputs} documents holds out {k}; fix: a "
                             "fraction that leaves documents on both sides, or --val INPUT")
        chosen = np.random.default_rng(seed).permutation(n_train_inputs)[:k]
        ids[chosen] = store.SPLITS["val"]
    if not (ids == store.SPLITS["train"]).any():
        raise ValueError("prepare: no training document left; fix: more inputs or a smaller --val-fraction")
    return ids


# ------------------------------------------------------------------- processes and temporaries

_ME = f"{socket.gethostname()}-{os.getpid()}"  # temporaries are named by host and pid: whose they are
PR_SET_PDEATHSIG = 1
_WATCHED: list[int] = []  # while non-empty: the pid whose death ends every process forked from it
_HOOKED: list[bool] = []  # the at-fork hook is registered (once per process)


@contextmanager
def _workers_die_with_this_process():
    """Every process forked meanwhile (`Dataset.map`'s worker pool and its manager) gets SIGKILL when
    this process dies, so a killed prepare leaves no tokenizing worker behind (Linux; elsewhere a
    no-op). Python's at-fork hook cannot be removed, so it is registered once and acts only inside."""
    if not sys.platform.startswith("linux"):
        yield
        return
    if not _HOOKED:
        os.register_at_fork(after_in_child=_die_with_parent)
        _HOOKED.append(True)
    _WATCHED[:] = [os.getpid()]
    try:
        yield
    finally:
        _WATCHED.clear()


def _die_with_parent() -> None:
    if not _WATCHED or os.getpid() == _WATCHED[0]:
        return
    parent = _WATCHED[0]
    _WATCHED.clear()  # the child's own forks are its business
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died between the fork and the prctl
        os._exit(1)


def remove_stale_temporaries(output: str | os.PathLike) -> list[str]:
    """Remove the temporary and moved-aside directories of `output` left by prepares of this host that
    no longer run (killed midway); return what was removed. Those of live prepares, and of other hosts
    (whose processes cannot be checked from here), are left alone."""
    output = Path(output)
    removed = []
    host = socket.gethostname()
    for kind in ("tmp", "old"):
        for path in output.parent.glob(f".{output.name}.{kind}-*"):
            owner = path.name[len(f".{output.name}.{kind}-"):]
            owner_host, _, pid = owner.rpartition("-")
            if not pid.isdigit() or owner_host not in ("", host) or _running(int(pid)):
                continue
            shutil.rmtree(path, ignore_errors=True)
            removed.append(str(path))
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
