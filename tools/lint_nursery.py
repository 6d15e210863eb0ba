"""A lint check for ``except SomeError:`` around a nursery (``make lint``): a trap that cost a day.

Trio's nurseries raise strict exception groups: whatever fails inside ``async with trio.open_nursery()`` (a
child task, or the block's own body) leaves it wrapped in a ``BaseExceptionGroup``. So in::

    try:
        async with trio.open_nursery() as n:
            ...
            await request()          # raises PeerUnavailable
    except PeerUnavailable:          # never runs: the error arrives as ExceptionGroup([PeerUnavailable])
        ...

the handler never catches an error raised inside the nursery (jobs/shadow.py's keep request did exactly
that: a refused keep ended the epoch, "pipeline broken"). The same holds for an ``@asynccontextmanager`` of
the checked tree whose body opens a nursery around its ``yield`` (``open_replica_averager``,
``open_libp2p_transport`` ...): the caller's block runs inside that nursery. This check flags each handler
of a ``try`` whose body enters such a context (outside nested functions) unless the handler catches groups:
``BaseExceptionGroup``, ``ExceptionGroup``, ``Exception``, ``BaseException`` or a bare ``except`` (alone or
in a tuple), or is an ``except*`` (not available before Python 3.11, which this project still supports).

Fix a hit by raising out of the nursery (keep the error in a variable, raise it after the block) or by
catching the group and unwrapping it (``fusionp2p.errors.leaf_errors``). A handler that is right as it
stands (it catches what is raised before or after the nursery) takes a reviewed comment on its ``except``
line, or alone on the line above it: ``# nursery-ok: <why>``.

``python tools/lint_nursery.py PATH ...`` (files or folders): one line a hit, exit status 1 if any.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

ALLOW = "# nursery-ok:"
CODE = "NUR001"
# handlers that catch an exception group too (Exception: an ExceptionGroup of Exceptions)
GROUP_CATCHERS = frozenset({"BaseExceptionGroup", "ExceptionGroup", "Exception", "BaseException"})
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)


@dataclass(frozen=True, kw_only=True, slots=True)
class Hit:
    path: str
    line: int
    caught: str
    opener: str
    opened_at: int

    def __str__(self) -> str:
        return (f"{self.path}:{self.line}: {CODE} `except {self.caught}` never sees what is raised inside "
                f"`{self.opener}()` (line {self.opened_at}): it arrives as an exception group; catch the group, "
                f"raise out of the nursery, or mark the line `{ALLOW} <why>`")


def _name(call: ast.Call) -> str:
    f = call.func
    if isinstance(f, ast.Attribute):
        return f.attr
    return f.id if isinstance(f, ast.Name) else ""


def _walk_here(nodes: Iterable[ast.AST], *, into: bool = False) -> Iterator[ast.AST]:
    """Every statement and ``async with`` item under *nodes* that runs in their frame (nested functions and
    classes left out; *into*: yielded and walked too). Expressions are not walked: no nursery opens there,
    and they are most of a tree's nodes."""
    stack = list(nodes)
    while stack:
        node = stack.pop()
        if isinstance(node, _SCOPES) and not into:
            continue
        yield node
        stack.extend(c for c in ast.iter_child_nodes(node) if isinstance(c, ast.stmt | ast.excepthandler | ast.match_case))


def _opened(body: Sequence[ast.stmt], openers: frozenset[str]) -> list[tuple[str, int]]:
    """The nursery contexts *body* enters: ``open_nursery()`` and the calls named in *openers*."""
    out = []
    for node in _walk_here(body):
        if isinstance(node, ast.AsyncWith):
            for item in node.items:
                e = item.context_expr
                if isinstance(e, ast.Call) and (_name(e) == "open_nursery" or _name(e) in openers):
                    out.append((_name(e), node.lineno))
    return sorted(out, key=lambda o: o[1])


def _catches_groups(t: ast.expr | None) -> bool:
    if t is None:
        return True
    if isinstance(t, ast.Tuple):
        return any(_catches_groups(e) for e in t.elts)
    name = t.attr if isinstance(t, ast.Attribute) else t.id if isinstance(t, ast.Name) else ""
    return name in GROUP_CATCHERS


def _allowed(lines: Sequence[str], line: int) -> bool:
    """The reviewed comment on the handler's line *line* (1-based), or alone on the line above it."""
    above = lines[line - 2].strip() if line >= 2 else ""
    return ALLOW in lines[line - 1] or above.startswith(ALLOW)


def nursery_openers(trees: Iterable[ast.Module]) -> frozenset[str]:
    """Names of the ``@asynccontextmanager`` functions in *trees* whose body opens a nursery, directly or
    through another of them (by name: a lint, not a resolver)."""
    acms: dict[str, list[ast.AsyncFunctionDef]] = {}
    for tree in trees:
        for node in _walk_here(tree.body, into=True):
            if isinstance(node, ast.AsyncFunctionDef) and any(
                    "asynccontextmanager" in ast.unparse(d) for d in node.decorator_list):
                acms.setdefault(node.name, []).append(node)
    found: frozenset[str] = frozenset()
    while True:
        more = frozenset(n for n, defs in acms.items() if any(_opened(d.body, found) for d in defs))
        if more == found:
            return found
        found = more


def check_tree(tree: ast.Module, lines: Sequence[str], path: str, openers: frozenset[str] = frozenset()
               ) -> list[Hit]:
    """The hits of one parsed module (*lines*: its source lines, for the allow comments)."""
    hits = []
    for node in _walk_here(tree.body, into=True):
        if not isinstance(node, ast.Try) or not node.handlers:   # ast.TryStar (except*) sees groups
            continue
        opened = _opened(node.body, openers)
        if not opened:
            continue
        for h in node.handlers:
            if _catches_groups(h.type) or _allowed(lines, h.lineno):
                continue
            assert h.type is not None
            hits.append(Hit(path=path, line=h.lineno, caught=ast.unparse(h.type), opener=opened[0][0],
                            opened_at=opened[0][1]))
    return hits


def check_source(src: str, path: str = "<string>", openers: frozenset[str] | None = None) -> list[Hit]:
    """The hits of one module's source; *openers* None: those the module itself defines."""
    tree = ast.parse(src, filename=path)
    return check_tree(tree, src.splitlines(), path, nursery_openers([tree]) if openers is None else openers)


def python_files(paths: Iterable[str]) -> list[Path]:
    out: list[Path] = []
    for p in map(Path, paths):
        out.extend(sorted(p.rglob("*.py")) if p.is_dir() else [p])
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print("usage: python tools/lint_nursery.py PATH ... (files or folders of Python code)", file=sys.stderr)
        return 2
    sources = {p: p.read_text() for p in python_files(args)}
    trees = {p: ast.parse(src, filename=str(p)) for p, src in sources.items()}
    openers = nursery_openers(trees.values())   # across the tree: a context opened in one module, used in another
    hits = [h for p, t in trees.items() for h in check_tree(t, sources[p].splitlines(), str(p), openers)]
    for h in hits:
        print(h)
    return 1 if hits else 0


if __name__ == "__main__":
    sys.exit(main())
