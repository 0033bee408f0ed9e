"""The package's shape, as docs/development.md states it: folders by stage with imports one way, one op table
(no aten-op group elsewhere, aten ops named only in ops/ and canonicalize/), one base name per module, short files,
a wheel that holds every subpackage, and a layout table that lists every module."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "autotp"

# Highest first: a module may import its own layer and the layers below it, never one above.
LAYERS = [
    ["autotp.tools"],
    ["autotp"],  # the public names (autotp/__init__.py)
    ["autotp.serving"],
    ["autotp.parallel"],
    ["autotp.api"],
    ["autotp.planning"],
    ["autotp.options", "autotp.plan"],
    ["autotp.cost_models"],
    ["autotp.passes"],
    ["autotp.canonicalize"],  # the rewrites into the op table's forms, run by passes/prepared_graph.prepare
    ["autotp.ops"],
    ["autotp.runtime"],
    ["autotp.placement"],
]
OP_TABLE = PACKAGE / "ops" / "table.py"
NAMING_OPS = (PACKAGE / "ops", PACKAGE / "canonicalize")  # the op table and the rewrites into its forms
# Run-time kernels call aten ops (they compute, they match nothing) and sit below the op table they cannot ask.
CALLING_OPS = {
    PACKAGE / "runtime" / "kernels.py": "embedding and _grouped_mm on one rank's rows or experts",
    PACKAGE / "runtime" / "dropout.py": "attention's math kernel, which takes the dropout mask",
}
MOST_LINES = 400


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer(module: str) -> int:
    """The index of the layer ``module`` belongs to: the longest prefix listed."""
    found = [
        (len(prefix), i)
        for i, names in enumerate(LAYERS)
        for prefix in names
        if module == prefix or module.startswith(prefix + ".")
    ]
    assert found, f"{module} is in no layer of LAYERS: add its folder"
    return max(found)[1]


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every autotp module ``path`` imports, lazily imported ones too."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                kept = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*kept, *filter(None, [base])])
            found += [(node.lineno, f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base) for a in node.names]
    return [(line, module) for line, module in found if module == "autotp" or module.startswith("autotp.")]


def test_imports_go_one_way():
    upward = [
        f"{module_name(path)}:{line} imports {target}"
        for path in MODULES.values()
        for line, target in imports(path)
        if layer(target) < layer(module_name(path))
    ]
    assert not upward, "imports against the layer order of docs/development.md:\n" + "\n".join(upward)


def _op_groups(path: Path) -> list[str]:
    """Tuples, lists and sets of two or more ops (aten overloads, FlexAttention, getitem) written in ``path``."""

    def is_op(node) -> bool:
        text = ast.unparse(node)
        return text.startswith(("aten.", "torch.ops.aten.")) or text in (
            "FLEX",
            "GROUPED_MM_FALLBACK",
            "operator.getitem",
        )

    return [
        f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)[:100]}"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.Tuple, ast.List, ast.Set))
        and any(is_op(e) for e in node.elts)
        and sum(is_op(e) or isinstance(e, ast.Starred) for e in node.elts) >= 2
    ]


def test_no_op_group_outside_the_op_table():
    """What an op is lives in ops/table.py (its rows, TAGS, DIM_MAPS); passes ask the table."""
    found = [group for path in MODULES.values() if path != OP_TABLE for group in _op_groups(path)]
    assert not found, "groups of ops outside ops/table.py (make them a tag or a column):\n" + "\n".join(found)
    assert _op_groups(OP_TABLE), "the scan finds the table's own groups"


def _aten_names(path: Path) -> list[str]:
    """Where ``path`` names an aten op: ``aten.view.default``, ``torch.ops.aten.sym_size.int``, ``torch.ops.aten``."""

    def names(node) -> bool:
        return isinstance(node, ast.Attribute) and (
            ast.unparse(node) == "torch.ops.aten" or (isinstance(node.value, ast.Name) and node.value.id == "aten")
        )

    return [
        f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)[:80]}"
        for node in ast.walk(ast.parse(path.read_text()))
        if names(node)
    ]


def test_aten_ops_named_only_by_the_op_table_and_canonicalization():
    """A module elsewhere asks the op table what an op is (its family, its tags) instead of matching op names."""
    found = [
        name
        for path in MODULES.values()
        if not any(path.is_relative_to(d) for d in NAMING_OPS) and path not in CALLING_OPS
        for name in _aten_names(path)
    ]
    assert not found, "aten ops named outside ops/ and canonicalize/ (ask ops/table.py):\n" + "\n".join(found)
    assert _aten_names(OP_TABLE), "the scan finds the table's own names"


def test_module_base_names_are_unique_and_files_short():
    names: dict = {}
    for path in MODULES.values():
        if path.name != "__init__.py":
            names.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert not {n: p for n, p in names.items() if len(p) > 1}
    long = {
        str(p.relative_to(ROOT)): n for p in MODULES.values() if (n := len(p.read_text().splitlines())) > MOST_LINES
    }
    assert not long, f"files over {MOST_LINES} lines: {long}"


def test_the_wheel_holds_every_subpackage(tmp_path):
    """Built as a user's pip builds it, and imported from the wheel alone (an editable install would hide a
    package the wheel lacks): every package folder of the source tree, and the data files."""
    source = tmp_path / "source"  # a fresh tree: a build/ folder left by another build would fill gaps
    shutil.copytree(PACKAGE, source / "autotp", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(source),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("autotp-*.whl")
    unpacked = tmp_path / "unpacked"
    zipfile.ZipFile(wheel).extractall(unpacked)
    packages = sorted(module_name(p) for p in PACKAGE.rglob("__init__.py"))
    data = [
        "autotp/plan.schema.json",
        *(str(p.relative_to(ROOT)) for p in (PACKAGE / "cost_models").glob("topologies/*.json")),
    ]
    installed = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    script = (
        f"import sys; sys.path[:0] = [{str(unpacked)!r}]; sys.path += {installed!r}\n"
        "import importlib\n"
        f"for name in {packages!r}:\n"
        "    module = importlib.import_module(name)\n"
        f"    assert module.__file__.startswith({str(unpacked)!r}), (name, module.__file__)\n"
        "print('imported', len(sys.modules))\n"
    )
    # -S: no site-packages .pth files, so the editable install's finder is not loaded
    result = subprocess.run([sys.executable, "-S", "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    missing = [f for f in data if not (unpacked / f).exists()]
    assert not missing and len(packages) > 5


def _layout_rows() -> dict[str, str]:
    """docs/development.md's layout table: each row's first cell's paths (``autotp/ops/``, ``autotp/api.py``) ->
    the row."""
    text = (ROOT / "docs" / "development.md").read_text().partition("## Layout")[2].partition("\n#")[0]
    rows = [line for line in text.splitlines() if line.startswith("| `autotp")]
    return {path: row for row in rows for path in re.findall(r"`(autotp/[^`]*)`", row.split("|")[1])}


def test_the_layout_table_lists_every_module():
    """Every module appears in docs/development.md's layout table, in its folder's row (``name.py`` or
    ``name``), or as a row of its own at the top level."""
    rows = _layout_rows()
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if path.name == "__init__.py":
            continue
        row = rows.get(relative) or rows.get(path.parent.relative_to(ROOT).as_posix() + "/", "")
        if relative not in rows and not re.search(rf"`{path.stem}(?:\.py)?`", row):
            missing.append(relative)
    assert not missing, "modules docs/development.md's layout table leaves out:\n" + "\n".join(missing)
