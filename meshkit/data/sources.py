"""Document sources: which files `prepare` reads, and how one record becomes one document's tokens.

Reading: INPUT paths are files or directories. In a directory, files matching the text patterns
(`*.txt *.md *.py`, or `--glob`), `*.jsonl` and `*.parquet` are read in sorted order, recursively;
a directory written by `datasets.Dataset.save_to_disk` is read as a whole. A text file is one
document; a jsonl line or a parquet / datasets row is one document. Everything becomes one
`datasets.Dataset` with a `text` column, so tokenization runs through `Dataset.map` (several
processes, a progress bar). Text and jsonl files are decoded here rather than by `load_dataset`, so a
bad byte or a missing field is reported as `file: byte offset` or `file:line`.

Encoding: a `DocumentSource` turns a batch of column values into documents: token ids and, where some
tokens must never be targets (a chat prompt), a 0/1 loss mask. `TEXT` encodes plain text; `chat.CHAT`
reads the `messages` field (`column_value` keeps it as JSON text) and returns the tokens of
`apply_chat_template` with a mask that is 1 on assistant tokens only. The store and the loader honour
any source's mask, so a new kind of supervised data is one more `DocumentSource`.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import numpy as np

__all__ = ["TEXT", "DocumentSource", "Encoded", "find_inputs", "pieces", "read_documents"]

TEXT_PATTERNS = ("*.txt", "*.md", "*.py")
_SKIP_DIRS = {"__pycache__", ".git"}

# One document: its token ids (a list, or an int64 array for a document encoded in pieces; EOS appended
# by `prepare` when missing) and an optional loss mask.
Encoded = tuple["list[int] | np.ndarray", "list[int] | None"]


def _text_value(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{where}: field value is {type(value).__name__}, not a string")
    return value


# Memory bounds of tokenizing: the tokenizer holds hundreds of bytes per token of what one call
# encodes (offsets, token strings), and BPE on one long word grows faster than its length (a
# 256k-character word without a space: 535 MB; 64k: 130 MB), so a 15 MB single line took 2.5 GB.
# A longer text is encoded in pieces of at most PIECE_CHARS, one call at most CALL_CHARS characters.
PIECE_CHARS = 1 << 16
CALL_CHARS = 1 << 18
# Where a long text is cut: before a space or tab that follows a non-space, or before a newline that
# follows a letter or digit. Byte-level BPE pre-tokenizers (GPT-2's, Llama 3's, Qwen's, `prepare`'s
# own) never join characters across these points and read no context behind them, so the pieces'
# tokens are exactly the whole text's. (Not after whitespace: a run of whitespace at the end of a
# piece is split differently, and Llama 3 joins punctuation with the newlines after it.)
_CUT = re.compile(r"(?<=\S)(?=[ \t])|(?<=[^\W_])(?=\n)")


def pieces(text: str) -> list[str]:
    """`text` in pieces of at most `PIECE_CHARS` characters (one piece when it is shorter).

    Each cut is the last boundary (`_CUT`) in the second half of the window, so for byte-level BPE
    tokenizers the tokens are exactly those of the whole text; a window without one (a line of no
    spaces) is cut hard, and a token never spans that cut. Tokenizers that prepend a marker to the
    text (SentencePiece's "▁") may differ by one token at each cut.
    """
    limit = PIECE_CHARS
    out, start = [], 0
    while len(text) - start > limit:
        cut = None
        for cut_match in _CUT.finditer(text, start + limit // 2, start + limit):
            cut = cut_match.start()
        cut = cut if cut is not None and cut > start else start + limit
        out.append(text[start:cut])
        start = cut
    out.append(text[start:])
    return out


def _encode_text(tokenizer: Any, values: Sequence[str]) -> list[Encoded]:
    """Each value's tokens, encoded piecewise in calls of at most CALL_CHARS characters."""
    split = [pieces(v) for v in values]
    flat = [p for ps in split for p in ps]
    ids: list[list[int] | np.ndarray] = []
    call: list[str] = []
    size = 0
    for piece in flat + [None]:
        if piece is None or (call and size + len(piece) > CALL_CHARS):
            encoded = tokenizer(call, add_special_tokens=False)["input_ids"] if call else []
            # A piece's ids as int64 at once: Python ints cost 8-36 bytes each for the whole document.
            ids.extend(np.asarray(row, dtype=np.int64) if len(flat) > len(split) else row for row in encoded)
            call, size = [], 0
        if piece is not None:
            call.append(piece)
            size += len(piece)
    out, i = [], 0
    for ps in split:
        row = np.concatenate(ids[i:i + len(ps)]) if len(ps) > 1 else ids[i]
        out.append((row, None))
        i += len(ps)
    return out


@dataclass(frozen=True)
class DocumentSource:
    """How `prepare` turns records into documents.

    `field`: the jsonl / parquet / datasets column read (None: the `--text-field` option);
    `column_value(value, where)`: the record's value as the string stored in the `text` column, or a
    ValueError naming `where`; `encode(tokenizer, values)`: one `(ids, mask or None)` per value;
    `text_files`: whether plain text files are documents of this source.
    """

    name: str
    encode: Callable[[Any, Sequence[str]], list[Encoded]]
    column_value: Callable[[Any, str], str] = _text_value
    field: str | None = None
    text_files: bool = True


TEXT = DocumentSource("text", _encode_text)


@dataclass(frozen=True)
class Inputs:
    """The files an INPUT list resolved to, by kind, so each kind is read by its own reader."""

    text: list[Path]
    jsonl: list[Path]
    parquet: list[Path]
    saved: list[Path]  # `save_to_disk` directories

    def files(self) -> list[Path]:
        """Every file read, in a fixed order: what the no-op re-run check fingerprints and the worker count sizes."""
        return self.text + self.jsonl + self.parquet + [f for d in self.saved for f in sorted(d.rglob("*")) if f.is_file()]


def _is_saved_dataset(path: Path) -> bool:
    return (path / "dataset_info.json").is_file() and (path / "state.json").is_file()


def find_inputs(paths: Sequence[str | os.PathLike], globs: Sequence[str] | None = None,
                what: str = "INPUT") -> Inputs:
    """Resolve INPUT paths to files by kind; ValueError for a missing path or one that yields no file."""
    patterns = tuple(globs) if globs else TEXT_PATTERNS
    found = Inputs([], [], [], [])
    if not paths:
        raise ValueError(f"{what}: no input given; fix: name files or directories to read")
    for raw in paths:
        path = Path(raw).expanduser()
        if path.is_file():
            _add_file(found, path, explicit=True, patterns=patterns)
        elif path.is_dir():
            if _is_saved_dataset(path):
                found.saved.append(path)
                continue
            before = len(found.files())
            for file in sorted(path.rglob("*")):
                # An empty file inside a directory (a package's __init__.py) is no document; skip it.
                if file.is_file() and file.stat().st_size and not (_SKIP_DIRS & set(file.relative_to(path).parts)):
                    _add_file(found, file, explicit=False, patterns=patterns)
            if len(found.files()) == before:
                raise ValueError(f"{what} {str(path)!r}: no non-empty file matching {' '.join(patterns)}, *.jsonl "
                                 "or *.parquet in this directory; fix: --glob PATTERN, or another directory")
        else:
            raise ValueError(f"{what} {str(path)!r}: no such file or directory")
    return found


def _add_file(found: Inputs, file: Path, explicit: bool, patterns: Sequence[str]) -> None:
    if file.suffix == ".jsonl":
        found.jsonl.append(file)
    elif file.suffix == ".parquet":
        found.parquet.append(file)
    elif explicit or any(file.match(p) for p in patterns):
        found.text.append(file)


def _decode(raw: bytes, where: str, errors: str, start: int = 0) -> str:
    try:
        return raw.decode("utf-8", errors=errors)
    except UnicodeDecodeError as err:
        raise ValueError(f"{where}: not UTF-8 at byte offset {start + err.start} ({raw[err.start:err.start + 4]!r}); "
                         "fix: convert the file to UTF-8, or pass --errors replace") from None


def _text_records(files: list[Path], errors: str) -> Iterator[dict[str, str]]:
    for file in files:
        raw = file.read_bytes()
        if not raw.strip():
            raise ValueError(f"{file}: empty file; fix: remove it from the inputs")
        nul = raw.find(b"\x00")
        if nul >= 0:  # valid UTF-8, so decoding would accept it: binary data, or UTF-16 text
            raise ValueError(f"{file}: binary data, not text (a NUL byte at offset {nul}); fix: remove it from the "
                             "inputs (or narrow --glob), or convert it to UTF-8 if it is UTF-16 text")
        yield {"text": _decode(raw, str(file), errors)}


def _jsonl_records(files: list[Path], field: str, source: DocumentSource, errors: str) -> Iterator[dict[str, str]]:
    for file in files:
        offset, count = 0, 0
        with open(file, "rb") as f:
            for number, line in enumerate(f, start=1):
                where = f"{file}:{number}"
                text = _decode(line, f"{file} (line {number})", errors, offset).strip()
                offset += len(line)
                if not text:
                    continue
                try:
                    record = json.loads(text)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{where}: not a JSON object ({err.msg}); fix: one JSON object per line") from None
                if not isinstance(record, dict) or field not in record:
                    raise ValueError(f"{where}: no field {field!r} in this record; fix: --text-field NAME "
                                     "(the field holding the document)")
                count += 1
                yield {"text": source.column_value(record[field], where)}
        if not count:
            raise ValueError(f"{file}: empty file (no JSON line); fix: remove it from the inputs")


def _generated(gen: Callable[..., Iterator[dict[str, str]]], cache_dir: str, **kwargs: Any) -> datasets.Dataset:
    """`Dataset.from_generator`, with our ValueErrors surfacing as themselves instead of wrapped."""
    features = datasets.Features({"text": datasets.Value("string")})
    try:
        return datasets.Dataset.from_generator(gen, gen_kwargs=kwargs, features=features, cache_dir=cache_dir)
    except datasets.exceptions.DatasetGenerationError as err:
        if isinstance(err.__cause__, ValueError):
            raise err.__cause__ from None
        raise


def _column(ds: datasets.Dataset, field: str, source: DocumentSource, where: str) -> datasets.Dataset:
    if field not in ds.column_names:
        raise ValueError(f"{where}: no column {field!r} (columns: {ds.column_names}); fix: --text-field NAME")
    if len(ds) == 0:
        raise ValueError(f"{where}: no rows; fix: remove it from the inputs")
    ds = ds.select_columns([field])
    if ds.data.column(field).null_count:
        missing = [i for i, v in enumerate(ds[field]) if v is None][:3]
        raise ValueError(f"{where}: row(s) {missing} have no {field!r} value; fix: drop them or --text-field NAME")
    if source.column_value is not _text_value or ds.features[field] != datasets.Value("string"):
        values = [source.column_value(v, f"{where} row {i}") for i, v in enumerate(ds[field])]
        return datasets.Dataset.from_dict({"text": values})
    return ds.rename_column(field, "text") if field != "text" else ds


def read_documents(inputs: Inputs, *, field: str, source: DocumentSource, errors: str,
                   cache_dir: str) -> datasets.Dataset:
    """Every document of `inputs` as one Dataset with a `text` column, in input order."""
    field = source.field or field
    parts: list[datasets.Dataset] = []
    if inputs.text:
        if not source.text_files:
            raise ValueError(f"{inputs.text[0]}: plain text files are not {source.name} documents; fix: give "
                             f"{source.name} data as .jsonl/.parquet")
        parts.append(_generated(_text_records, cache_dir, files=inputs.text, errors=errors))
    if inputs.jsonl:
        parts.append(_generated(_jsonl_records, cache_dir, files=inputs.jsonl, field=field, source=source,
                                errors=errors))
    for file in inputs.parquet:
        ds = datasets.load_dataset("parquet", data_files=[str(file)], split="train", cache_dir=cache_dir)
        parts.append(_column(ds, field, source, str(file)))
    for directory in inputs.saved:
        ds = datasets.load_from_disk(str(directory))
        if isinstance(ds, datasets.DatasetDict):
            raise ValueError(f"{directory}: a DatasetDict with splits {list(ds)}; fix: save_to_disk one split, "
                             "or point at its directory")
        parts.append(_column(ds, field, source, str(directory)))
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
