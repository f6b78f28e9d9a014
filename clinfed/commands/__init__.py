"""The ``clinfed`` command: parse flags, call the library, print.

One module per command group (``data``, ``train``, ``privacy``,
``flower``); each registers its commands on :data:`app`. Every error a user
can fix is a :class:`~clinfed.core.errors.ClinfedError`: one line per problem on
stderr, exit status 2, no traceback, and never any note text.
"""

from __future__ import annotations

import sys

from clinfed.commands.clock import STARTED  # noqa: F401  (first: the clock starts here)


def _version_only(argv: list[str] | None) -> bool:
    """``clinfed --version`` answers from the installed packages' metadata,
    before the command groups (and torch with them) are imported."""
    args = sys.argv[1:] if argv is None else argv
    if args != ["--version"]:
        return False
    from clinfed.core.provenance import versions

    found = versions()
    libraries = ", ".join(f"{k} {found[k]}" for k in ("torch", "opacus", "flwr", "python"))
    print(f"clinfed {found['clinfed']} ({libraries})")
    return True


# ----------------------------------------------------------------- main
def _report_error(exc: Exception) -> None:
    from rich.markup import escape

    from clinfed.commands.common import MAX_PROBLEMS_SHOWN, err
    from clinfed.core.errors import DataError, worded

    problems = exc.problems if isinstance(exc, DataError) else [exc]
    lines = [line for problem in problems for line in worded(problem).splitlines()]
    for line in lines[:MAX_PROBLEMS_SHOWN]:
        # Escaped: a path or a hint in brackets ("clinfed[terminology]",
        # "notes[1].txt") is text, not rich markup to swallow.
        err.print(f"[red]error:[/] {escape(line)}", highlight=False, soft_wrap=True)
    if len(lines) > MAX_PROBLEMS_SHOWN:
        err.print(f"[red]error:[/] ... and {len(lines) - MAX_PROBLEMS_SHOWN} more problems")


def _said_once(message: str) -> str:
    """A message with a repeated sentence (a suggestion added twice) said once."""
    import re

    sentences = re.split(r"(?<=[.?!]) ", message)
    kept = [s for i, s in enumerate(sentences) if s not in sentences[:i]]
    return " ".join(kept)


def main(argv: list[str] | None = None) -> int:
    """Console entry point; returns the exit status."""
    if _version_only(argv):
        return 0
    import click
    import typer
    from rich.markup import escape

    from clinfed.commands import data, demo, flower, privacy, train  # noqa: F401  (registration)
    from clinfed.commands.common import app, err
    from clinfed.core.errors import EXIT_USAGE, USER_ERRORS, ClinfedError
    from clinfed.core.quiet import quiet_libraries
    from clinfed.core.scratch import private_scratch

    quiet_libraries()
    command = typer.main.get_command(app)
    try:
        # Every temporary file (tokenized notes, Arrow caches) in one private
        # folder, removed on exit, error, Ctrl-C and SIGTERM.
        with private_scratch():
            result = command.main(args=argv, prog_name="clinfed", standalone_mode=False)
        return result if isinstance(result, int) else 0
    except USER_ERRORS as exc:
        _report_error(exc)
        return EXIT_USAGE
    except OSError as exc:
        # The file system said no (a full disk, a missing or unreadable
        # file, a folder that cannot be written): the path and the reason,
        # never a traceback. The strerror never holds file content.
        where = f"{exc.filename}: " if exc.filename else ""
        _report_error(ClinfedError(f"{where}{exc.strerror or type(exc).__name__}"))
        return EXIT_USAGE
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.ClickException as exc:
        # Flag and command mistakes in clinfed's one error style; the usage
        # line first, as click would, and its suggestion said once (click
        # and Typer each add one).
        context = getattr(exc, "ctx", None)
        if context is not None:
            err.print(escape(context.get_usage()), highlight=False, soft_wrap=True)
            err.print(f"Try '{context.command_path} --help' for help.", highlight=False)
        _report_error(ClinfedError(_said_once(exc.format_message())))
        return exc.exit_code
    except click.exceptions.Abort:
        err.print("aborted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
