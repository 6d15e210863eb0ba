"""Architecture rules, checked on the source: pure packages stay pure; only net/ imports libp2p; no pickle."""

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "fusionp2p"
PURE = ["wire", "graph", "plan", "compress", "average"]
FORBIDDEN_IN_PURE = {"trio", "libp2p", "socket", "asyncio", "subprocess", "multiaddr"}


def imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module.split(".")[0])
    return out


def py_files(*dirs: Path) -> list[Path]:
    return sorted(p for d in dirs for p in d.rglob("*.py"))


@pytest.mark.parametrize("pkg", PURE)
def test_pure_packages_do_no_io(pkg: str) -> None:
    bad = {str(p.relative_to(ROOT)): sorted(imports(p) & FORBIDDEN_IN_PURE) for p in py_files(PKG / pkg)}
    assert {k: v for k, v in bad.items() if v} == {}


def test_only_net_imports_libp2p() -> None:
    offenders = [str(p.relative_to(ROOT)) for p in py_files(PKG, ROOT / "node", ROOT / "bootstrap")
                 if "libp2p" in imports(p) and (PKG / "net") not in p.parents]
    assert offenders == []


def test_no_pickle_on_peer_paths() -> None:
    offenders = []
    for p in py_files(PKG, ROOT / "node", ROOT / "bootstrap"):
        src = p.read_text()
        if "pickle" in imports(p) or "marshal" in imports(p):
            offenders.append(f"{p.relative_to(ROOT)}: imports pickle/marshal")
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "load" and getattr(node.func.value, "id", "") == "torch":
                kws = {k.arg: k.value for k in node.keywords}
                if not (isinstance(kws.get("weights_only"), ast.Constant) and kws["weights_only"].value is True):
                    offenders.append(f"{p.relative_to(ROOT)}:{node.lineno}: torch.load without weights_only=True")
    assert offenders == []


# Layers, from the bottom (docs/architecture.md "Layers"). A module imports only from its own layer or
# below; `testing` is the test kit, which the product never imports.
LAYERS: list[set[str]] = [
    {"errors", "types", "device", "sizes", "threads"},
    {"wire", "graph", "plan", "compress", "average", "data", "models"},   # pure cores (+ data, models)
    {"net", "testbed"},
    {"swarm"},
    {"train", "parallel", "jobs"},
    {"ops"},                                                              # dashboard, /api, /metrics
    {"sdk"},
    {"cli"},
    {"testing"},
]
# Imports allowed to run up the layers (the issue allows at most one): none.
ALLOWED_UP: set[tuple[str, str]] = set()


@functools.cache
def _imports() -> dict[str, list[tuple[str, tuple[str, ...]]]]:
    """Every module of the package by dotted name: the package modules it imports, each with the names
    imported from it (() for a plain ``import``); parsed and walked once for all the tests here."""
    out: dict[str, list[tuple[str, tuple[str, ...]]]] = {}
    for p in py_files(PKG):
        parts = p.relative_to(ROOT).with_suffix("").parts
        found = out.setdefault(".".join(parts[:-1] if parts[-1] == "__init__" else parts), [])
        for node in ast.walk(ast.parse(p.read_text(), filename=str(p))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith("fusionp2p"):
                found.append((node.module, tuple(a.name for a in node.names)))
            elif isinstance(node, ast.Import):
                found.extend((a.name, ()) for a in node.names if a.name.startswith("fusionp2p"))
    return out


def _module_edges() -> dict[str, set[str]]:
    return {mod: {m for m, _ in found} for mod, found in _imports().items()}


def _top(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else ""


def _layer(pkg: str) -> int:
    for i, layer in enumerate(LAYERS):
        if pkg in layer:
            return i
    return -1


def test_every_package_has_a_layer() -> None:
    pkgs = {_top(m) for m in _module_edges()} - {""}
    assert sorted(p for p in pkgs if _layer(p) < 0) == []


def test_no_import_runs_up_the_layers() -> None:
    up = sorted((a, b) for a, bs in _module_edges().items() for b in bs
                if _top(a) and _top(b) and _layer(_top(b)) > _layer(_top(a)) and (a, b) not in ALLOWED_UP)
    assert up == []


def test_no_import_cycle_between_packages() -> None:
    graph: dict[str, set[str]] = {}
    for a, bs in _module_edges().items():
        for b in bs:
            if _top(a) and _top(b) and _top(a) != _top(b) and (a, b) not in ALLOWED_UP:
                graph.setdefault(_top(a), set()).add(_top(b))
    assert _cycle(graph) is None

def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of *graph* (a path that returns to its first node), None when it has none."""
    seen: dict[str, int] = {}   # 1 on the stack, 2 done

    def visit(n: str, path: list[str]) -> list[str] | None:
        seen[n] = 1
        for m in sorted(graph.get(n, ())):
            if seen.get(m) == 1:   # m is on the path: the cycle runs from it to n and back
                stack = [*path, n]
                return [*stack[stack.index(m):], m]
            if m not in seen and (cyc := visit(m, [*path, n])):
                return cyc
        seen[n] = 2
        return None

    for n in sorted(graph):
        if n not in seen and (cyc := visit(n, [])):
            return cyc
    return None


def test_no_import_cycle_between_modules() -> None:
    """Module by module, every import counted (under TYPE_CHECKING and inside functions too): a cycle is a
    piece both sides need, to be moved down into a module of its own (jobs/accepted.py, jobs/shadow_config.py)."""
    mods = _imports()

    def target(name: str) -> str:   # the module an import loads: the name itself, else its package
        while name not in mods and "." in name:
            name = name.rsplit(".", 1)[0]
        return name

    graph = {mod: {target(f"{m}.{n}" if n else m) for m, names in found for n in names or ("",)} - {mod}
             for mod, found in mods.items()}
    assert _cycle(graph) is None
