"""The ``mograph`` command line.

Each sub-command lives in its own module (``optimize``, ``passes``, ``inspect``, ``diff``, ``bench``
...) exposing ``add_parser(subparsers)`` and ``run(args) -> CommandResult``.  This module owns what is
common: global flags, ``--json`` output, logging, and turning :class:`~mograph.errors.MographError`
into one clear line on stderr and a documented exit code.

A bug inside a pass (:class:`~mograph.errors.InternalError`) is one line too, exit code 1, with the
original traceback printed above it at ``-v``.  ``-v`` / ``-vv`` raise mograph's own loggers (the
``mograph`` tree, which includes the built-in passes) to INFO / DEBUG; third-party libraries' loggers
stay at WARNING.  ``--block-plugin`` is accepted before and after the sub-command.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
import traceback
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from mograph.errors import InternalError, MographError

__all__ = ["main", "CommandResult", "COMMANDS", "EXIT_CODES_HELP"]

#: Sub-command modules under ``mograph.cli``, in the order ``--help`` lists them.
COMMANDS: tuple[str, ...] = ("optimize", "passes", "inspect", "diff", "bench", "build", "validate", "sweep", "ledger", "gate", "report")

EXIT_CODES_HELP = """exit codes:
  0  success
  1  internal error (a bug: please report it with the traceback that -v prints)
  2  usage error: bad command line, unknown pass, bad option value
  3  the model could not be loaded or is invalid
  4  a pass failed
  5  numeric verification failed (outputs drifted past tolerance)
  6  a plugin failed to load or misbehaved (a pass calling sys.exit included; nothing written)
  7  an optional dependency is missing (the message names the pip extra)
  130  interrupted (Ctrl-C); temporary files are removed, OUT is left as it was
  143  terminated (SIGTERM); the same clean-up
"""


@dataclass
class CommandResult:
    """What a command produced: ``data`` for ``--json``, ``text`` for people, and an exit code."""

    data: dict[str, Any] = field(default_factory=dict)
    text: str = ""
    exit_code: int = 0


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # argparse exits 2 on usage errors: keep that, one line
        self.exit(2, f"{self.prog}: error: {message}\n")


def _load_command(name: str) -> Any:
    try:
        return importlib.import_module(f"mograph.cli.{name}")
    except ModuleNotFoundError as exc:
        if exc.name == f"mograph.cli.{name}":
            return None
        raise


def prescan_blocked(argv: Sequence[str]) -> list[str]:
    """Plugin names given with ``--block-plugin`` anywhere in ``argv`` (needed before parsing, since
    the pass options a parser offers depend on which plugins load)."""
    out = []
    for i, arg in enumerate(argv):
        if arg == "--block-plugin" and i + 1 < len(argv):
            out.append(argv[i + 1])
        elif arg.startswith("--block-plugin="):
            out.append(arg.split("=", 1)[1])
    return out


#: Plugins blocked on this command line, known before the parser is built.
BLOCKED: list[str] = []


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="mograph",
        description="mograph: optimize ONNX models with an ordered pipeline of rewrite passes "
        "(cleanup, fusion, shapes, precision, pruning), lower them to a backend, and check the numbers.",
        epilog=EXIT_CODES_HELP
        + "\nplugins: MOGRAPH_DISABLE_PLUGIN_AUTOLOAD=1 loads no third-party plugin; "
        "MOGRAPH_BLOCK_PLUGINS=a,b or --block-plugin NAME skips some.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from mograph import __version__

    parser.add_argument("--version", action="version", version=f"mograph {__version__}")
    parser.add_argument(  # a separate dest: a sub-command's defaults would overwrite a shared one
        "--block-plugin", action="append", default=[], dest="block_plugin_global", metavar="NAME",
        help="do not load this plugin (repeatable; also accepted after the sub-command)",
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="print machine-readable JSON on stdout")
    common.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv for debug)")
    common.add_argument("-q", "--quiet", action="store_true", help="only errors")
    common.add_argument(
        "--block-plugin", action="append", default=[], metavar="NAME", help="do not load this plugin (repeatable)"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in COMMANDS:
        module = _load_command(name)
        if module is not None:
            module.add_parser(sub, common)
    return parser


def _emit(result: CommandResult, as_json: bool) -> None:
    if as_json:
        sys.stdout.write(json.dumps(result.data, indent=2, default=str) + "\n")
    elif result.text:
        sys.stdout.write(result.text.rstrip("\n") + "\n")


@contextmanager
def _logging(verbose: int, quiet: bool) -> Iterator[None]:
    """Log to stderr for one command: WARNING for everyone, INFO (``-v``) or DEBUG (``-vv``) for the
    ``mograph`` loggers only, ERROR for everyone with ``-q``.

    Levels are put back afterwards, and a handler is added only where the root logger has none (as
    ``logging.basicConfig`` would), so calling :func:`main` in-process leaves logging as it was.
    """
    mine = logging.getLogger("mograph")
    root = logging.getLogger()
    saved = (root.level, mine.level)
    handler: logging.Handler | None = None
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)
    if quiet:
        levels = (logging.ERROR, logging.ERROR)
    else:
        levels = (logging.WARNING, logging.DEBUG if verbose >= 2 else logging.INFO if verbose == 1 else logging.WARNING)
    root.setLevel(levels[0])
    mine.setLevel(levels[1])
    try:
        yield
    finally:
        root.setLevel(saved[0])
        mine.setLevel(saved[1])
        if handler is not None:
            root.removeHandler(handler)


def _fail(args: argparse.Namespace, message: str, exit_code: int, report: Any = None) -> int:
    """One line on stderr; with ``--json`` also ``{"error", "exit_code"}`` on stdout, plus what the command
    measured when the error carries a result object (``report.to_dict()``: ``gate``'s figures on failure)."""
    if getattr(args, "json", False):
        data = dict(report.to_dict()) if callable(getattr(report, "to_dict", None)) else {}
        data.update({"error": message, "exit_code": exit_code})
        _emit(CommandResult(data=data), True)
    sys.stderr.write(f"mograph: error: {message}\n")
    return exit_code


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``mograph`` console script; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    BLOCKED[:] = prescan_blocked(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    args.block_plugin = list(args.block_plugin_global) + list(getattr(args, "block_plugin", []))
    verbose = 0 if getattr(args, "quiet", False) else getattr(args, "verbose", 0)
    from mograph._signals import Terminated, terminate_as_exception

    with _logging(verbose, getattr(args, "quiet", False)):
        try:
            with terminate_as_exception():  # so temporary folders are removed on SIGTERM too
                result = args.run(args)
        except InternalError as exc:  # a MographError too: caught first, it is a bug to report
            if verbose:
                original = exc.__cause__ if exc.__cause__ is not None else exc
                sys.stderr.write("".join(traceback.format_exception(original)))
                hint = "a bug: please report it with the traceback above"
            else:
                hint = "a bug: please report it; run with -v for the traceback"
            return _fail(args, f"{exc} ({hint})", exc.exit_code)
        except MographError as exc:
            return _fail(args, str(exc), exc.exit_code, getattr(exc, "report", None))
        except KeyboardInterrupt:
            sys.stderr.write("mograph: interrupted\n")
            return 130
        except Terminated:
            sys.stderr.write("mograph: terminated\n")
            return 143
    if not getattr(args, "quiet", False) or getattr(args, "json", False):  # -q: nothing but errors
        _emit(result, getattr(args, "json", False))
    return result.exit_code


def entry() -> None:
    sys.exit(main())
