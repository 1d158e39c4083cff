"""The README's memory-options matrix stays true: a column says "tested" exactly when a test runs that
option under that axis (`offload`: tests/data_parallel/test_offload_axes.py, FSDP alone in test_offload.py;
`offload="nvme"`, `activation_offload`, `float8`: the plans of their own test modules, read by axis)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.data_parallel.test_activation_offload import OFFLOAD_PLANS as ACTIVATION_PLANS
from tests.data_parallel.test_nvme import NVME_PLANS
from tests.data_parallel.test_offload_axes import OFFLOAD_PLANS
from tests.float8.test_float8 import PLANS as FLOAT8_PLANS

README = Path(__file__).resolve().parents[2] / "README.md"
COLUMNS = {"FSDP": "dp_shard=", "TP": "tp=", "CP": "cp=", "PP": "pp=", "EP": "ep=", "HSDP": "dp_replicate=",
           "bf16": "param_dtype=bfloat16"}


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


def _row(prefix: str) -> tuple[list[str], list[str]]:
    header, body = _memory_table()
    return header, next(cells for first, cells in body.items() if first.startswith(prefix))


def test_offload_row_says_what_the_tests_run():
    header, row = _row("`offload` (")
    assert row[header.index("FSDP")] == "tested"
    for column in ("TP", "CP", "PP", "EP", "HSDP"):
        cell = row[header.index(column)]
        if column in OFFLOAD_PLANS:
            assert cell == "tested", f"offload x {column}: test_offload_axes runs it, README says {cell!r}"
        else:
            assert not cell.startswith("tested"), f"offload x {column}: no test runs it, README says {cell!r}"


@pytest.mark.parametrize("prefix, plans", [
    ('`offload="nvme"`', [plan for plan, _, _ in NVME_PLANS.values()]),
    ("`activation_offload`", [plan for plan, _ in ACTIVATION_PLANS.values()]),
    ("`float8`", [plan for plan, _ in FLOAT8_PLANS.values()]),
])
def test_new_memory_rows_say_what_their_tests_run(prefix, plans):
    header, row = _row(prefix)
    for column, marker in COLUMNS.items():
        cell, ran = row[header.index(column)], any(marker in plan for plan in plans)
        assert cell.startswith("tested") == ran, f"{prefix} x {column}: tests run it: {ran}, README says {cell!r}"
