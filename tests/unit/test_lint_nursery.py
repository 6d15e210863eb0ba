"""tools/lint_nursery.py: ``except SomeError:`` around a nursery body is flagged; group handlers, ``except*``,
broad handlers, nested functions and reviewed lines are not; the tree itself is clean."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
import trio

from tools.lint_nursery import check_source, main

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

ROOT = Path(__file__).resolve().parents[2]


def hits(src: str) -> list[tuple[int, str, str]]:
    return [(h.line, h.caught, h.opener) for h in check_source(textwrap.dedent(src))]


def test_the_trap_is_real_on_this_trio() -> None:
    """The premise: an error raised inside a nursery does not reach ``except ThatError``."""
    caught: list[str] = []

    async def fails() -> None:
        raise KeyError("x")

    async def main_() -> None:
        try:
            async with trio.open_nursery() as n:
                n.start_soon(fails)
        except KeyError:   # nursery-ok: the trap itself, shown to be one
            caught.append("bare")
        except BaseExceptionGroup as group:
            caught.append(type(group.exceptions[0]).__name__)

    trio.run(main_)
    assert caught == ["KeyError"]


def test_a_specific_handler_around_a_nursery_is_flagged() -> None:
    assert hits("""
        async def f():
            try:
                async with trio.open_nursery() as n:
                    await g()
            except (KeyError, trio.TooSlowError):
                pass
            except ValueError:
                pass
    """) == [(6, "(KeyError, trio.TooSlowError)", "open_nursery"), (8, "ValueError", "open_nursery")]


def test_a_nursery_among_several_contexts_or_deeper_in_the_body_is_flagged() -> None:
    assert hits("""
        async def f():
            try:
                with trio.fail_after(5):
                    if x:
                        async with open_thing(), trio.open_nursery() as n:
                            pass
            except OSError:
                pass
    """) == [(8, "OSError", "open_nursery")]


@pytest.mark.parametrize("handler", ["BaseExceptionGroup as g", "ExceptionGroup", "(KeyError, BaseExceptionGroup)",
                                     "Exception as exc", "BaseException", ""])
def test_handlers_that_catch_the_group_pass(handler: str) -> None:
    assert hits(f"""
        async def f():
            try:
                async with trio.open_nursery() as n:
                    pass
            except {handler}:
                pass
    """) == []


@pytest.mark.skipif(sys.version_info < (3, 11), reason="except* is Python 3.11 syntax")
def test_except_star_passes() -> None:
    assert hits("""
        async def f():
            try:
                async with trio.open_nursery() as n:
                    pass
            except* KeyError:
                pass
    """) == []


def test_what_is_not_a_nursery_here_passes() -> None:
    assert hits("""
        async def f():
            try:
                async with open_stream() as s:       # not a nursery
                    pass
                async def later():                   # runs elsewhere
                    async with trio.open_nursery():
                        pass
                nursery.start_soon(later)
            except KeyError:
                pass
        async def g():
            async with trio.open_nursery():
                try:                                  # the try is inside the nursery: errors arrive bare
                    await h()
                except KeyError:
                    pass
    """) == []


def test_a_reviewed_handler_passes_and_only_that_one() -> None:
    assert hits("""
        async def f():
            try:
                async with trio.open_nursery() as n:
                    pass
            except OSError:   # nursery-ok: raised by open_x's start, before its nursery
                pass
            # nursery-ok: the same, on the line above
            except KeyError:
                pass
            except ValueError:   # nursery: not the allow comment
                pass
    """) == [(11, "ValueError", "open_nursery")]


def test_a_context_manager_that_opens_a_nursery_counts_as_one() -> None:
    """An ``@asynccontextmanager`` whose body opens a nursery around its yield (or enters another that does)
    runs the caller's block inside that nursery."""
    assert hits("""
        @contextlib.asynccontextmanager
        async def open_service():
            async with trio.open_nursery() as n:
                yield n
        @asynccontextmanager
        async def open_app():
            async with open_service() as s:
                yield s
        @asynccontextmanager
        async def open_plain():
            yield 1
        async def f():
            try:
                async with open_app() as a:
                    pass
            except KeyError:
                pass
            try:
                async with open_plain() as a:
                    pass
            except KeyError:
                pass
    """) == [(17, "KeyError", "open_app")]


def test_the_command_reports_and_exits_by_its_hits(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "svc.py").write_text(textwrap.dedent("""
        @asynccontextmanager
        async def open_service():
            async with trio.open_nursery() as n:
                yield n
    """))
    (tmp_path / "use.py").write_text(textwrap.dedent("""
        async def f():
            try:
                async with open_service():
                    pass
            except KeyError:
                pass
    """))
    assert main([str(tmp_path)]) == 1          # the opener is defined in another module of the tree
    out = capsys.readouterr().out
    assert "use.py:6: NUR001 `except KeyError`" in out and "open_service()" in out
    (tmp_path / "use.py").write_text("x = 1\n")
    assert main([str(tmp_path)]) == 0
    assert main([]) == 2


@pytest.mark.slow   # `make lint` runs it; here 4 CPU-s, mostly parsing 440 files
def test_the_tree_is_clean() -> None:
    """What ``make lint`` runs, in ``make test-all`` too."""
    assert main([str(ROOT / d) for d in ("fusionp2p", "node", "bootstrap", "benchmarks", "tests", "tools")]) == 0
