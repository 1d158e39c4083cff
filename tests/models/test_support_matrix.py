"""The README's model-family table stays true: one row per supported model type, every cell "tested"
(a case of tests/models/test_families.py), "refused..." where meshkit refuses the family under that
shape (only LoRA does: `families.plan_refusal`), or "n/a (dense)" in the EP column of a dense family."""

from __future__ import annotations

from pathlib import Path

from test_families import PLANS

from meshkit.models.llama import SUPPORTED_MODEL_TYPES
from meshkit.testing.families import FAMILY_FIELDS, MOE_KINDS, plan_refusal

README = Path(__file__).resolve().parents[2] / "README.md"
COLUMNS = {"TP/SP x FSDP": ("tp",), "CP ring, zigzag": ("ring", "zigzag"), "CP ulysses": ("ulysses",),
           "PP x FSDP": ("pp",), "EP x FSDP": ("ep",), "LoRA (TP/SP x FSDP)": ("lora",)}
ELSEWHERE = ("mixtral", "qwen3_moe")  # MoE models tested in tests/expert_parallel


def _family_table() -> tuple[list[str], dict[str, list[str]]]:
    lines = README.read_text().split("### Model families", 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[start:]:  # the first table after the heading, up to its end
        if not line.startswith("|"):
            break
        rows.append(line)
    header = [c.strip() for c in rows[0].strip("|").split("|")]
    body = {}
    for line in rows[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        body[cells[0]] = cells
    return header, body


def test_every_family_has_a_row_and_every_row_a_family():
    _, body = _family_table()
    families = {t for t in SUPPORTED_MODEL_TYPES if t not in ELSEWHERE}
    assert set(body) == families, f"README rows {sorted(body)} vs supported types {sorted(families)}"
    assert set(FAMILY_FIELDS) == families, "every supported type needs a tiny config in meshkit/testing/families.py"


def test_cells_say_what_the_tests_run():
    header, body = _family_table()
    for kind, cells in body.items():
        for column, shapes in COLUMNS.items():
            cell = cells[header.index(column)]
            if shapes == ("ep",) and kind not in MOE_KINDS:
                assert cell == "n/a (dense)", f"{kind} x {column}: a dense model has no experts, README says {cell!r}"
                continue
            for shape in shapes:
                assert shape in PLANS, column
                if plan_refusal(kind, shape) is not None:
                    assert cell.startswith("refused"), f"{kind} x {column}: meshkit refuses it, README says {cell!r}"
                else:
                    assert cell == "tested", f"{kind} x {column}: the family test runs it, README says {cell!r}"
