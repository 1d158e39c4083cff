"""The README's memory-options matrix stays true for `offload`: a column says "tested" exactly when
tests/data_parallel/test_offload_axes.py runs offload under that axis (FSDP alone: tests/data_parallel/test_offload.py)."""

from __future__ import annotations

from pathlib import Path

from tests.data_parallel.test_offload_axes import OFFLOAD_PLANS

README = Path(__file__).resolve().parents[2] / "README.md"


def _memory_table() -> tuple[list[str], dict[str, list[str]]]:
    """(header, first cell -> cells) of the first table after "Memory options" in the README."""
    lines = README.read_text().split("Memory options", 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows[0], {cells[0]: cells for cells in rows[2:]}


def test_offload_row_says_what_the_tests_run():
    header, body = _memory_table()
    row = next(cells for first, cells in body.items() if first.startswith("`offload`"))
    assert row[header.index("FSDP")] == "tested"
    for column in ("TP", "CP", "PP", "EP", "HSDP"):
        cell = row[header.index(column)]
        if column in OFFLOAD_PLANS:
            assert cell == "tested", f"offload x {column}: test_offload_axes runs it, README says {cell!r}"
        else:
            assert not cell.startswith("tested"), f"offload x {column}: no test runs it, README says {cell!r}"
