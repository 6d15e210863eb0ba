"""Architecture rules, checked on the source: pure packages stay pure; only net/ imports libp2p; no pickle."""

import ast
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
