"""The prose names what exists: every autotp module path in a docstring, a comment, a docs page or the README
(``autotp.runtime.kernels``, ``ops/table.py``, ``planning/ilp.Ilp.recompute``) names a module of the package,
and a name after it (a function, a class, a class's attribute) is defined there."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "autotp"
# "passes" stays a start once its modules move to another folder, so that a path through it fails then
SUBPACKAGES = sorted({p.parent.name for p in PACKAGE.glob("*/__init__.py")} | {"passes"})

# A reference starts at a subpackage's name (``runtime.kernels``, ``ops/table.py``) or at ``autotp.``/``autotp/``
# (``autotp.options``): never in the middle of another path (``torch.ops.aten``, ``.../tools/x``, a URL).
_REST = r"(?:/[\w-]+|\.\w+)+/?"  # a folder's or file's name may hold a "-" (topologies/dgx-h100.json)
REFERENCE = re.compile(rf"(?<![\w./\\-])(?P<start>(?:autotp[./])?(?:{'|'.join(SUBPACKAGES)})|autotp){_REST}")
# Not a module: a page's or data file's name (serving.md), beside the folder paths checked as files.
FILE_NAME = re.compile(r"\.(?:md|json|html|ya?ml|svg|txt|toml|csv)$")


@cache
def defined(path: Path) -> dict[str, ast.AST | None]:
    """The names a module defines at its top level (functions, classes, assignments, imports), each with its
    class node where it is one."""
    names: dict[str, ast.AST | None] = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef):
            names[node.name] = node
        for name in _bound(node):
            names.setdefault(name, None)
    return names


def _bound(node: ast.AST) -> list[str]:
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return [node.name]
    if isinstance(node, ast.Import | ast.ImportFrom):
        return [(a.asname or a.name).partition(".")[0] for a in node.names]
    if isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
    if isinstance(node, ast.If | ast.Try):
        return [name for child in ast.iter_child_nodes(node) for name in _bound(child)]
    return []


def _members(cls: ast.ClassDef) -> set[str]:
    """A class's attributes: its body's names and what its methods assign to ``self.``."""
    names = {name for node in cls.body for name in _bound(node)}
    names |= {
        n.attr
        for n in ast.walk(cls)
        if isinstance(n, ast.Attribute)
        and isinstance(n.ctx, ast.Store)
        and isinstance(n.value, ast.Name)
        and n.value.id == "self"
    }
    return names | {n.id for base in cls.bases for n in ast.walk(base) if isinstance(n, ast.Name)} - {"object"}


def problem(reference: str) -> str | None:
    """Why ``reference`` (a path as written in prose) names nothing in the package, or None if it does."""
    written = reference.rstrip("/")
    relative = written.removeprefix("autotp/").removeprefix("autotp.")
    if "/" in written and ((PACKAGE / relative).exists() or (ROOT / written).exists()):
        return None  # a file or folder (topologies/*.json's folder, autotp/ops/)
    parts = re.split(r"[./]", relative.removesuffix(".py")) if relative != "autotp" else []
    where = PACKAGE
    for i, part in enumerate(parts):
        if (where / part / "__init__.py").exists():
            where = where / part
        elif (where / f"{part}.py").exists():
            return _attribute_problem(where / f"{part}.py", parts[i + 1 :])
        else:
            return _attribute_problem(where / "__init__.py", parts[i:])
    return None


def _attribute_problem(module: Path, attributes: list[str]) -> str | None:
    shown = module.relative_to(ROOT).as_posix()
    if not attributes:
        return None
    names = defined(module)
    if attributes[0] not in names:
        kind = "module or name" if module.name == "__init__.py" else "name"
        return f"no {kind} {attributes[0]!r} in {shown}"
    cls = names[attributes[0]]
    if len(attributes) > 1 and isinstance(cls, ast.ClassDef) and attributes[1] not in _members(cls):
        return f"no attribute {attributes[1]!r} of {attributes[0]} in {shown}"
    return None


def stale(text: str, shadowed: frozenset[str] = frozenset()) -> list[str]:
    """Each reference in ``text`` that names nothing, with why. ``shadowed``: the parameters of the function
    whose docstring ``text`` is (where ``options.x`` may be a field of the argument ``options``)."""
    return [
        f"{m.group()}: {why}"
        for m in REFERENCE.finditer(text)
        if m["start"] not in shadowed
        and not ("/" not in m.group() and FILE_NAME.search(m.group()))
        and (why := problem(m.group()))
    ]


def python_prose(path: Path) -> list[tuple[int, str, frozenset[str]]]:
    """(line, text, names the text may use as variables) of each docstring, comment and message (of an assert or
    a raise) of a Python file: a function's docstring may name its parameters."""
    source = path.read_text()
    found = [
        (t.start[0], t.string, frozenset())
        for t in tokenize.generate_tokens(io.StringIO(source).readline)
        if t.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(source)):
        message = node.msg if isinstance(node, ast.Assert) else node.exc if isinstance(node, ast.Raise) else None
        found += (
            [
                (n.lineno, n.value, frozenset())
                for n in ast.walk(message)
                if isinstance(n, ast.Constant) and isinstance(n.value, str)
            ]
            if message
            else []
        )
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                arguments = node.args if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) else None
                names = [a.arg for a in ast.walk(arguments) if isinstance(a, ast.arg)] if arguments else []
                found.append((first.lineno, first.value.value, frozenset(names)))
    return found


def markdown_prose(path: Path) -> list[tuple[int, str, frozenset[str]]]:
    """(line, text) of each line of a Markdown page."""
    return [(number, line, frozenset()) for number, line in enumerate(path.read_text().splitlines(), 1)]


def prose_files() -> list[tuple[Path, list[tuple[int, str, frozenset[str]]]]]:
    python = [
        p
        for folder in ("autotp", "tests", "benchmarks", "scripts", "examples")
        for p in sorted((ROOT / folder).rglob("*.py"))
    ]
    markdown = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return [(p, python_prose(p)) for p in python] + [(p, markdown_prose(p)) for p in markdown]


def test_the_scanner_finds_stale_paths_and_only_those():
    old = (
        "`runtime.dispatch.Dealt`, `passes/semantics.Op` and passes.decompose; see autotp.runtime.dispatch, "
        "passes/semantics.py, autotp/runtime/local_ops.py, `autotp.verify`, `ops.table.NoSuchRow`, "
        "planning/ilp.Ilp.no_such_family"
    )
    assert [s.partition(":")[0] for s in stale(old)] == [
        "runtime.dispatch.Dealt",
        "passes/semantics.Op",
        "passes.decompose",
        "autotp.runtime.dispatch",
        "passes/semantics.py",
        "autotp/runtime/local_ops.py",
        "autotp.verify",
        "ops.table.NoSuchRow",
        "planning/ilp.Ilp.no_such_family",
    ]
    fine = (
        "torch.ops.aten.mm, torch.distributed.tensor.parallel, https://example.com/tools/ops.py, ops. Then "
        "the runtime.\nautotp.runtime.kernels, runtime/collectives.py, `ops/table.py` (rows), "
        "cost_models/topologies/*.json, autotp/ops/, autotp.parallelize, planning/ilp.Ilp.recompute, "
        "`cost_models.memory.memory_limit(topology)`, `autotp/options.py`, tools/hand_plans.json, "
        "transformers/models/llama/modeling_llama.py, x.runtime.dispatch, [Serving](serving.md), "
        "cost_models/topologies/dgx-h100.json"
    )
    assert stale(fine) == []
    assert stale("``planning.memory_limit`` bytes", frozenset({"planning"})) == []  # a parameter's field
    assert stale("``planning.memory_limit`` bytes") != []


def test_every_module_path_in_prose_exists():
    """Docstrings, comments and error messages (autotp, tests, benchmarks, scripts, examples), docs/*.md and the
    README name modules that exist, and names those modules define."""
    bad = [
        f"{path.relative_to(ROOT)}:{line}: {why}"
        for path, texts in prose_files()
        for line, text, shadowed in texts
        for why in stale(text, shadowed)
    ]
    assert not bad, "module paths that name nothing:\n" + "\n".join(bad)
