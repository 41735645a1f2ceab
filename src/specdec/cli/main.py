"""The `specdec` console script: its subcommands, each registered from its own module, with one-line errors.

This module imports no command (nor torch) at import: the parser loads them, so a missing extra turns its command
into a refusal that names the extra, and `specdec` starts before the heavy imports a Ctrl-C may interrupt."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from specdec.errors import EXPECTED_ERRORS, UserError, one_line
from specdec.host.hugepages import environment_for_huge_pages
from specdec.version import __version__

# (module whose register() adds the subcommand, its name, the pip extra it needs; None: always installed)
COMMANDS = (
    ("specdec.cli.generate", "generate", None),
    ("specdec.server.cli", "serve", "server"),
    ("specdec.bench.cli", "bench", "bench"),
    ("specdec.distill.cli", "distill", "distill"),
    ("specdec.tune.cli", "tune", "bench"),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description="Lossless speculative decoding.")
    parser.add_argument("--version", action="version", version=f"specdec {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    for module, command, extra in COMMANDS:
        if extra is None:
            importlib.import_module(module).register(commands)
            continue
        try:
            importlib.import_module(module).register(commands)
        except ImportError as exc:  # an extra is not installed: the command says which, instead of vanishing
            _register_missing(commands, command, extra, exc)
    return parser


def _register_missing(commands, command: str, extra: str, exc: ImportError) -> None:
    missing = exc.name or str(exc)
    # No option prefix: whatever follows the command (flags included) is swallowed, so the refusal below is what
    # the user sees, not an argparse complaint about a flag the missing command would have known.
    stub = commands.add_parser(command, help=f"(needs: pip install 'specdec[{extra}]')", add_help=False,
                               prefix_chars="\0")
    stub.add_argument("ignored", nargs=argparse.REMAINDER)

    def refuse(_args: argparse.Namespace) -> int:
        raise UserError(f"'specdec {command}' needs the {extra} extra ({missing} is not installed): "
                        f"pip install 'specdec[{extra}]'")

    stub.set_defaults(handler=refuse)


def entry() -> int:
    """The `specdec` command: once, re-execute with glibc's malloc asking for huge pages (host/hugepages.py:
    a 1.2x faster decoding step on the AMX Xeon, and a tunable is read only at process start), then main()."""
    environment = environment_for_huge_pages()
    if environment is not None and getattr(sys, "orig_argv", None):
        try:
            os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], environment)
        except OSError:
            pass  # run as we are
    return main()


def main(argv: list[str] | None = None) -> int:
    try:
        # Building the parser imports the subcommands (torch among them: seconds), so a Ctrl-C can land here.
        args = build_parser().parse_args(argv)
    except KeyboardInterrupt:
        print("specdec: interrupted", file=sys.stderr)
        return 130
    try:
        return int(args.handler(args) or 0)
    except KeyboardInterrupt as exc:
        print(f"specdec {args.command}: interrupted{_what_was_kept(exc)}", file=sys.stderr)
        return 130
    except EXPECTED_ERRORS as exc:
        print(f"specdec {args.command}: error: {one_line(exc)}", file=sys.stderr)
        return 2


def _what_was_kept(exc: KeyboardInterrupt) -> str:
    return getattr(exc, "note", "")  # cli/generation_report.GenerationInterrupted says what text it kept


if __name__ == "__main__":
    sys.exit(entry())
