"""The house rules a machine can check: a short top level, short files, names every OS can check out,
one home per definition, and nothing that needs a newer Python than pyproject.toml promises."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "meshkit"
# Device names Windows refuses as a file's stem, whatever the extension (`aux.py` cannot be checked out).
RESERVED = {"con", "prn", "aux", "nul", *(f"com{i}" for i in range(1, 10)), *(f"lpt{i}" for i in range(1, 10))}


def _python_files(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py") if ".venv" not in p.parts)


def test_top_level_holds_at_most_twelve_modules():
    modules = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(modules) <= 12, f"meshkit/ has {len(modules)} top-level modules (at most 12): {modules}"


def test_no_meshkit_file_is_over_450_lines():
    long = {str(p.relative_to(ROOT)): n for p in _python_files("meshkit")
            if (n := len(p.read_text().splitlines())) > 450}
    assert not long, f"split these by concept: {long}"


def test_test_modules_have_unique_names():
    """pytest imports test files by basename (no packages under tests/): two of one name stop the whole
    suite at collection (tests/dryrun/test_families.py once shadowed tests/models/test_families.py)."""
    names = defaultdict(list)
    for p in _python_files("tests"):
        if p.name.startswith("test_"):
            names[p.name].append(str(p.relative_to(ROOT)))
    assert not {n: ps for n, ps in names.items() if len(ps) > 1}


def test_no_file_name_is_reserved_on_windows():
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    files = tracked or [str(p.relative_to(ROOT)) for p in _python_files("meshkit", "tests", "recipes", "benchmarks")]
    bad = [f for f in files if any(part.split(".")[0].lower() in RESERVED for part in Path(f).parts)]
    assert not bad, f"names Windows cannot check out: {bad}"


def _module_level_definitions(path: Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name) and t.id.isupper())
    return names


# Names that several modules define for concepts of their own, each meaning something else.
SAME_NAME_OTHER_CONCEPT = {
    "main": "each command's entry point",
    "build_parser": "each command's flags",
    "render": "the estimate report vs the plan-search table",
    "prepare": "a token store (data/prepare.py) vs one step's batch (step/batch.py)",
    "FORMAT_VERSION": "the token store's format vs the training checkpoint's",
    "MANIFEST": "the file name of a token store's manifest vs a checkpoint's (two formats)",
    "K": "a local alias of pipeline.actions.ActionKind",
}


def test_public_definitions_have_one_home():
    """A public function, class or constant is defined in one meshkit module: a second definition
    under the same name drifts from the first (`attention_dims` and `DTYPES` once did)."""
    homes: dict[str, list[str]] = defaultdict(list)
    for path in _python_files("meshkit"):
        for name in _module_level_definitions(path):
            if not name.startswith("_") and name not in SAME_NAME_OTHER_CONCEPT:
                homes[name].append(str(path.relative_to(ROOT)))
    twice = {name: where for name, where in homes.items() if len(where) > 1}
    assert not twice, f"defined in more than one module: {twice}"


def test_no_module_only_re_exports():
    """One concept, one import path: a module whose body is nothing but imports (and `__all__`) is a
    second name for code that lives elsewhere. Package `__init__` files may gather their package's API."""
    second_names = []
    for path in _python_files("meshkit"):
        if path.name in ("__init__.py", "__main__.py"):
            continue
        body = [n for n in ast.parse(path.read_text()).body
                if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
        imports = [n for n in body if isinstance(n, (ast.Import, ast.ImportFrom))]
        rest = [n for n in body if n not in imports and not (
            isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets))]
        if imports and not rest:
            second_names.append(str(path.relative_to(ROOT)))
    assert not second_names, f"modules that only re-export: {second_names}"


def test_runs_on_the_oldest_python_pyproject_allows():
    """vermin reads every module's syntax and standard-library calls against the `requires-python`
    floor (hashlib.file_digest, for one, needs 3.11); version-guarded imports (tomllib) are honoured."""
    floor = re.search(r'requires-python\s*=\s*">=(\d+\.\d+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    vermin = Path(sys.executable).with_name("vermin")
    if not vermin.exists():
        pytest.fail(f"vermin is not installed beside {sys.executable}; it is a dev dependency (make venv)")
    out = subprocess.run([str(vermin), f"-t={floor}-", "--violations", "--no-tips", "--eval-annotations",
                          "meshkit", "recipes", "benchmarks", "tests"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, f"needs a newer Python than {floor}:\n{out.stdout}{out.stderr}"
