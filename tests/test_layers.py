"""`common` is the library the chapters import, in layers, and nothing else: no module
imports one that imports it back, none hides an import of another `common` module inside
a function, none is a command (no `__main__`), none imports the commands (`tools/`), and
every one is reached from a chapter script."""

from __future__ import annotations

import ast
import re

from conftest import REPO

COMMON = REPO / "common"


def imports_of(name: str) -> tuple[set[str], set[str]]:
    """(the `common` modules `name` imports at its top level, those it imports inside a
    function or class)."""
    tree = ast.parse((COMMON / f"{name}.py").read_text())
    top, nested = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            found = {node.module.split(".")[0]} if node.module else {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("common"):
            found = {node.module.split(".")[1]} if "." in node.module else {a.name for a in node.names}
        else:
            continue
        (top if node in tree.body else nested).update(found)
    return top, nested


MODULES = sorted(p.stem for p in COMMON.glob("*.py") if p.stem != "__init__")
GRAPH = {m: imports_of(m) for m in MODULES}
ALL = {m: top | nested for m, (top, nested) in GRAPH.items()}  # wherever the import is


def test_no_common_module_is_imported_inside_a_function():
    hidden = {m: sorted(nested) for m, (_, nested) in GRAPH.items() if nested}
    assert not hidden, f"imports inside functions (they hide the layering): {hidden}"


def test_no_module_imports_one_that_imports_it_back():
    def cycle_from(start):
        path, seen = [], set()

        def visit(m):
            if m in path:
                return path[path.index(m):] + [m]
            if m in seen:
                return None
            seen.add(m)
            path.append(m)
            for n in sorted(ALL[m]):
                found = visit(n)
                if found:
                    return found
            path.pop()
            return None
        return visit(start)

    cycles = [c for c in map(cycle_from, MODULES) if c]
    assert not cycles, f"import circles: {cycles[0]}"


def test_the_library_is_no_command_and_imports_none():
    commands = {m for m in MODULES if "__main__" in (COMMON / f"{m}.py").read_text()}
    assert not commands, f"commands inside common (they belong in tools/): {sorted(commands)}"
    tools = {m for m in MODULES if re.search(r"^\s*(from|import) tools\b", (COMMON / f"{m}.py").read_text(), re.M)}
    assert not tools, f"common modules that import a command: {sorted(tools)}"


def test_every_module_is_reached_from_a_chapter_script():
    """A module no chapter script reaches, directly or through another, is not the
    chapters' library: it belongs with the commands, or nowhere."""
    reached, todo = set(), set()
    for script in REPO.glob("0*/*.py"):
        todo |= {m.split(".")[1] for m in re.findall(r"^from (common\.\w+) import", script.read_text(), re.M)}
    while todo:
        m = todo.pop()
        if m in GRAPH and m not in reached:
            reached.add(m)
            todo |= ALL[m]
    assert set(MODULES) - reached == set(), f"reached by no chapter script: {sorted(set(MODULES) - reached)}"


def dotted(node) -> str | None:
    """`a.b.c` for an attribute chain on a name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else None


def test_no_file_reaches_a_torch_module_it_did_not_import():
    """`torch.distributed.checkpoint.save(...)` works only where something imported
    torch.distributed.checkpoint first. The suite's warm ranks are forks of an interpreter
    that has imported many of torch's modules (tests/warm.py), where a missing import
    would go unseen, and fail for a reader. So every use of a torch
    module through attributes (`torch.x.y`, or `dist.x` after `import torch.distributed
    as dist`) must name a module that the file imports, or that `import torch` loads."""
    import importlib.util
    import subprocess
    import sys
    loaded = set(subprocess.run([sys.executable, "-c", "import sys, torch; print(*sys.modules)"],
                                capture_output=True, text=True, check=True).stdout.split())

    def is_module(name):
        try:
            return importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            return False
    files = [*REPO.glob("0*/*.py"), *COMMON.glob("*.py"), *REPO.glob("tools/*.py")]
    missing = []
    for path in files:
        tree = ast.parse(path.read_text())
        alias, imported = {"torch": "torch"}, set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    imported.add(a.name)
                    if a.asname:
                        alias[a.asname] = a.name
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                imported.add(node.module)
                imported.update(f"{node.module}.{a.name}" for a in node.names)
        for node in ast.walk(tree):
            chain = dotted(node) if isinstance(node, ast.Attribute) else None
            if not chain or chain.split(".")[0] not in alias:
                continue
            parts = [alias[chain.split(".")[0]], *chain.split(".")[1:]]
            for i in range(2, len(parts)):  # each module named on the way to the attribute
                name = ".".join(parts[:i])
                if name.startswith("torch") and name not in loaded and name not in imported \
                        and is_module(name):
                    missing.append(f"{path.relative_to(REPO)}: {chain} needs `import {name}`")
    assert not missing, "\n".join(sorted(set(missing)))
