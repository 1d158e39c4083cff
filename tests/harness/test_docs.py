"""The docs stay true where a machine can tell: docs/architecture.md's tree names every meshkit module
that exists and none that does not, the self-contained snippet of docs/pipeline_schedules.md runs
as written, every documented recipe and data command parses (and the recipe's own pre-flight passes
its preset at the launched world size), snippets compile and name real API, and the plan reference
and the recipe's preset table name every field with its default. (The README's quick start runs in
tests/parallel/test_quick_start.py.)"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import io
import re
import shlex
import sys
from pathlib import Path

import meshkit
from meshkit.plan import CP_ATTENTION

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


# ------------------------------------------------------------------ the commands and tables users copy

DOCS = [ROOT / "README.md", ROOT / "recipes" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def shell_commands(path: Path) -> list[str]:
    """Every command line in the file's ```bash blocks, continuation lines joined, comments dropped."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", path.read_text(), re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        commands += [line.split(" #")[0].strip() for line in joined.splitlines()
                     if line.strip() and not line.lstrip().startswith("#")]
    return commands


def preset_commands(path: Path) -> list[str]:
    """The commands in a preset's header comment (`#   torchrun ...`, continuation lines joined)."""
    header = "\n".join(line[1:] for line in path.read_text().splitlines() if line.startswith("#"))
    return [line.strip() for line in re.sub(r"\\\n\s*", " ", header).splitlines() if "torchrun" in line]


def recipe_commands() -> list[tuple[str, str]]:
    """(file, command) for every documented `torchrun ... recipes/train_llama.py ...` line: the docs' and
    each preset's own header."""
    documented = [(path.name, c) for path in DOCS for c in shell_commands(path) if "recipes/train_llama.py" in c]
    presets = sorted((ROOT / "recipes" / "configs").glob("*.toml"))
    return documented + [(path.name, c) for path in presets for c in preset_commands(path)]


def test_every_preset_is_in_the_recipe_readme_and_names_its_command():
    readme = (ROOT / "recipes" / "README.md").read_text()
    for path in sorted((ROOT / "recipes" / "configs").glob("*.toml")):
        assert f"`{path.name}`" in readme, f"recipes/README.md does not name the preset {path.name}"
        assert any(f"configs/{path.name}" in c for c in preset_commands(path)), f"{path.name}: no launch command"


def _recipe_modules():
    if str(ROOT / "recipes") not in sys.path:
        sys.path.insert(0, str(ROOT / "recipes"))
    return importlib.import_module("train_config"), importlib.import_module("preflight")


def test_every_documented_recipe_command_parses_and_its_config_passes_the_preflight():
    """The flags exist, the preset loads, and the plan fits the launched world (pp, batch, seq_len):
    what the recipe checks before it starts a process group, for each command as a user pastes it
    (a `--dry-run` command's world is its `--world`)."""
    commands = recipe_commands()
    assert len(commands) >= 17, commands
    train_config, preflight = _recipe_modules()
    for where, command in commands:
        words = shlex.split(command)
        launcher, args = words[:words.index("recipes/train_llama.py")], words[words.index("recipes/train_llama.py") + 1:]
        parsed = train_config.build_parser().parse_args(args)
        if parsed.check or parsed.dry_run:  # one process, N ranks checked or simulated (no torchrun)
            assert "torchrun" not in " ".join(launcher) and parsed.world, (where, command)
            per_node, nodes = parsed.world, 1
        else:
            assert "torchrun" in " ".join(launcher), (where, command)
            per_node = int(launcher[launcher.index("--nproc-per-node") + 1])
            nodes = int(launcher[launcher.index("--nnodes") + 1].split(":")[0]) if "--nnodes" in launcher else 1
        run = train_config.apply_cli(train_config.load_config(str(ROOT / parsed.config)), parsed)
        if "path" in run.model and not Path(run.model["path"]).is_dir():
            continue  # a placeholder checkpoint directory (/path/to/model): the flags parsed, nothing to load
        model_config, _, _ = train_config.build_model_config(run.model)
        try:
            preflight.check_config(run, model_config, per_node * nodes)
        except ValueError as err:
            raise AssertionError(f"{where}: `{command}`:\n{err}") from None


def test_every_documented_data_command_parses():
    parser = importlib.import_module("meshkit.data.__main__").build_parser()
    commands = [(p.name, c) for p in DOCS for c in shell_commands(p) if "-m meshkit.data " in c]
    assert commands
    for where, command in commands:
        words = shlex.split(command)
        try:
            parser.parse_args(words[words.index("meshkit.data") + 1:])
        except SystemExit:
            raise AssertionError(f"{where}: `{command}` does not parse") from None


def test_every_documented_benchmark_module_exists():
    names = {m for p in DOCS for m in re.findall(r"python -m (benchmarks(?:\.\w+)*)", p.read_text())}
    assert names
    missing = sorted(n for n in names if importlib.util.find_spec(n) is None)
    assert not missing, f"documented `python -m` benchmark modules that do not exist: {missing}"


def test_python_snippets_compile_and_name_real_api():
    """Every ```python block of the README and docs/ compiles (except signature listings), and every
    `pm.<name>`, `meshkit.<name>`, `checkpoint.<name>` it uses exists."""
    for path in DOCS:
        for code in re.findall(r"```python\n(.*?)```", path.read_text(), re.S):
            if re.search(r"\) -> ", code):  # a listing of signatures (docs/context_parallel.md), not a program
                continue
            compile(code, str(path), "exec")
            for name in re.findall(r"\bpm\.(\w+)", code):
                assert hasattr(meshkit.ParallelModel, name), f"{path.name}: pm.{name} does not exist"
            for name in re.findall(r"\bmeshkit\.(\w+)", code):
                assert hasattr(meshkit, name) or importlib.util.find_spec(f"meshkit.{name}"), \
                    f"{path.name}: meshkit.{name} does not exist"
            for name in re.findall(r"(?<![\w.])checkpoint\.(\w+)", code):
                assert hasattr(meshkit.state.checkpoint, name), f"{path.name}: checkpoint.{name} does not exist"


def _field_default(field: dataclasses.Field) -> object:
    return field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default


def _toml_text(value: object) -> str:
    """A default as the README's plan reference writes it: TOML booleans, quoted strings, None, ()."""
    if isinstance(value, bool):
        return str(value).lower()
    return f'"{value}"' if isinstance(value, str) else repr(value)


def test_readme_plan_reference_lists_every_plan_field_with_its_default():
    text = (ROOT / "README.md").read_text()
    table = text[text.index("## Plan reference"):text.index("### Choosing a context-parallel kind")]
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(\w+)` \| `?([^|`]*)`? \|", table, re.M)}
    fields = {f.name: _toml_text(_field_default(f)) for f in dataclasses.fields(meshkit.Plan)}
    assert sorted(rows) == sorted(fields), (sorted(set(fields) - set(rows)), sorted(set(rows) - set(fields)))
    wrong = {name: (rows[name], fields[name]) for name in fields if rows[name].strip() != fields[name]}
    assert not wrong, f"README plan reference defaults (README, meshkit.Plan): {wrong}"


def test_recipe_readme_lists_every_preset_key():
    """recipes/README.md's table of presets names every [plan], [train] and [data] key the recipe reads."""
    train_config, _ = _recipe_modules()
    rows = {m.group(1): set(re.findall(r"`(\w+)`", m.group(2)))
            for m in re.finditer(r"^\| `\[(\w+)\]`\s*\| (.*)$", (ROOT / "recipes" / "README.md").read_text(), re.M)}
    for table, cls in (("plan", meshkit.Plan), ("train", train_config.TrainConfig), ("data", train_config.DataConfig)):
        missing = sorted({f.name for f in dataclasses.fields(cls)} - rows[table])
        assert not missing, f"recipes/README.md's [{table}] row does not name {missing}"
    assert set(CP_ATTENTION) <= rows["plan"], f"recipes/README.md's [plan] row lacks cp kinds of {CP_ATTENTION}"
