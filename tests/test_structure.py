"""The package layout keeps its rules: no import cycle among specdec/, drafters/,
verify_kernels/, server/ and experiments/, and no module imports another module's private
(underscore) name. Checked on the sources' import statements (top-level and inside functions
alike)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("specdec", "drafters", "verify_kernels", "server", "experiments")


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for p in sorted((ROOT / pkg).rglob("*.py")):
            parts = p.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def imports(name: str, path: Path, mods: dict[str, Path]) -> list[tuple[str, str]]:
    """(module imported, name imported from it or '') for every import of our modules."""
    found = []
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                if full in mods:
                    found.append((full, ""))
                elif base in mods:
                    found.append((base, alias.name))
        elif isinstance(node, ast.Import):
            found += [(a.name, "") for a in node.names if a.name in mods]
    return [(m, n) for m, n in found if m != name]


def test_no_import_cycles():
    mods = modules()
    graph = {m: {t for t, _ in imports(m, p, mods)} for m, p in mods.items()}
    cycles = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                cycles.append(path[path.index(t):] + [t])
            elif t not in state:
                visit(t)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_no_private_names_imported_across_modules():
    mods = modules()
    private = [f"{m} imports {t}.{n}" for m, p in mods.items()
               for t, n in imports(m, p, mods) if n.startswith("_")]
    assert not private, "\n".join(private)


def test_the_checker_sees_a_cycle(tmp_path, monkeypatch):
    """The checks can fail: a made-up pair of modules importing each other is a cycle."""
    pkg = tmp_path / "specdec"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from specdec.b import _x\n")
    (pkg / "b.py").write_text("def f():\n    from specdec import a\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    mods = modules()
    assert ("specdec.b", "_x") in imports("specdec.a", mods["specdec.a"], mods)
    assert ("specdec.a", "") in imports("specdec.b", mods["specdec.b"], mods)
