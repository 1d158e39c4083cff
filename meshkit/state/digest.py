"""SHA-256 of a file, read in chunks: the checksum of every checkpoint file and token-store file.

A leaf (hashlib only), so the light `meshkit.data` import and the checkpoint manifest share it.
`hashlib.file_digest` would do the same but needs Python 3.11, and meshkit supports 3.10.
"""

from __future__ import annotations

import hashlib
import os

_CHUNK = 1 << 20


def file_digest(path: str | os.PathLike) -> str:
    """Hex SHA-256 of the file at `path`, read 1 MiB at a time (files may be larger than memory)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()
