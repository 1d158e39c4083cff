"""The docs stay true where a machine can tell: docs/architecture.md's tree names every meshkit module
that exists and none that does not, and the self-contained snippet of docs/pipeline_schedules.md runs
as written. (The README's quick start runs in tests/parallel/test_quick_start.py.)"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import meshkit

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = Path(meshkit.__file__).parent


def architecture_tree() -> dict[str, set[str]]:
    """The tree block of docs/architecture.md: each meshkit line's folder (or "" at the top) and its words."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = re.search(r"## The tree\n\n```\n(.*?)```", text, re.S).group(1)
    tree: dict[str, set[str]] = {}
    folder = ""
    for line in block.splitlines():
        if line.startswith(("recipes/", "benchmarks/", "tests/")):
            break
        head = re.match(r"  (\w+)/\s", line + " ")
        if head:
            folder = head.group(1)
        elif not line.startswith("   "):
            folder = ""
        tree.setdefault(folder, set()).update(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", line))
    return tree


def modules_on_disk() -> dict[str, set[str]]:
    """meshkit's modules by folder ("" at the top), one level of packages deep, as the tree shows them."""
    found: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE)
        if len(rel.parts) > 2 or (rel.name == "__init__.py" and len(rel.parts) == 2):
            continue
        folder = rel.parts[0] if len(rel.parts) == 2 else ""
        found.setdefault(folder, set()).add(rel.stem)
    return found


def test_architecture_tree_lists_every_module():
    tree, disk = architecture_tree(), modules_on_disk()
    missing = sorted(f"{folder}/{name}" if folder else name for folder, names in disk.items()
                     for name in names if name not in tree.get(folder, set()) and name != "__init__")
    assert not missing, f"meshkit modules docs/architecture.md's tree does not list: {missing}"
    folders = {f for f in disk if f} - set(tree)
    assert not folders, f"meshkit packages without a line in docs/architecture.md's tree: {sorted(folders)}"


def test_architecture_tree_names_no_missing_file():
    tree = architecture_tree()
    absent_folders = sorted(f for f in tree if f and not (PACKAGE / f).is_dir())
    assert not absent_folders, f"docs/architecture.md's tree lists packages meshkit/ lacks: {absent_folders}"
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = re.search(r"## The tree\n\n```\n(.*?)```", text, re.S).group(1).split("\nrecipes/")[0]
    absent = sorted(name for name in re.findall(r"\b(\w+)\.py\b", block) if not (PACKAGE / f"{name}.py").exists())
    assert not absent, f"docs/architecture.md's tree names files meshkit/ lacks: {absent}"


def test_the_pipeline_schedules_snippet_runs_as_written():
    text = (ROOT / "docs" / "pipeline_schedules.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "docs/pipeline_schedules.md", "exec"), {"__name__": "__main__"})
    printed = out.getvalue()
    assert "zb_h1: p=4 m=8" in printed and printed.count("rank ") >= 4, printed
