"""Entry point of the `vitkit` command. Each command module defines `register(app)`; errors that a user can
fix are printed as one line plus a hint, with a non-zero exit code, never as a traceback."""

from __future__ import annotations

import importlib
import sys
import warnings

import typer

app = typer.Typer(
    name="vitkit",
    help="The Vision Transformer of 'An Image is Worth 16x16 Words': build, train, load, inspect.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
    context_settings={"help_option_names": ["-h", "--help"]},
)


# Defined before the command modules are imported, so that they can import it from here.
class UsageError(Exception):
    """An error the user can fix; `hint` says how."""

    def __init__(self, message: str, hint: str = ""):
        super().__init__(message)
        self.hint = hint


def fail(message: str, hint: str = "", code: int = 1) -> None:
    typer.echo(f"error: {message}", err=True)
    if hint:
        typer.echo(f"hint: {hint}", err=True)
    raise SystemExit(code)


# The command modules, in the order their commands appear in --help.
COMMAND_MODULES = [
    "vitkit.cli.inspect",
    "vitkit.cli.train",
    "vitkit.cli.shard",
    "vitkit.cli.analyze",
    "vitkit.cli.speed",
    "vitkit.cli.convert",
    "vitkit.cli.serve",
]

for _name in COMMAND_MODULES:
    importlib.import_module(_name).register(app)


FILESYSTEM_HINT = "check the path's filesystem: space, quota, read-only"


def command_help(argv: list[str] | None) -> str:
    """The hint that points to the help of the command that failed (`vitkit eval --help`)."""
    words = [a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("-")]
    return f"see `vitkit {words[0]} --help`" if words else "see `vitkit --help`"


def warning_line(message, category, filename, lineno, line=None) -> str:
    """How the command line shows a Python warning: `warning: MESSAGE`, without the file and source line."""
    return f"warning: {message}\n"


def main(argv: list[str] | None = None) -> None:
    warnings.formatwarning = warning_line
    try:
        app(args=argv, prog_name="vitkit", standalone_mode=True)
    except KeyboardInterrupt:
        fail("interrupted", code=130)
    except Exception as e:
        explain(e, argv)


def explain(error: Exception, argv: list[str] | None) -> None:
    """Exit with a one-line message and a hint for an error the user can fix; re-raise any other. Its imports
    wait for an error, so that `vitkit --help` does not load torch."""
    from safetensors import SafetensorError

    from ..checkpoint import CheckpointError
    from ..config import UnknownModelError
    from ..extras import MissingExtra

    e = error
    if isinstance(e, UsageError):
        fail(str(e), e.hint)
    elif isinstance(e, MissingExtra):  # its message names the extra to install
        fail(str(e))
    elif isinstance(e, CheckpointError):
        words = [a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("-")]
        fail(str(e), "vitkit loads its own folders (config.json + model.safetensors), Google .npz, timm, "
                     "Hugging Face and torchvision files, and hub names"
                     + ("" if words[:1] == ["info"] else "; `vitkit info PATH` tells what one holds"))
    elif isinstance(e, OSError):  # a wrong path; a read-only or full filesystem, a quota
        path_error = isinstance(e, (FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError,
                                    PermissionError))
        fail(f"{e.filename or ''}: {e.strerror or e}".lstrip(": "),
             "check the path" if path_error else FILESYSTEM_HINT)
    elif isinstance(e, UnknownModelError):  # its message names `vitkit models`
        fail(str(e.args[0]))
    elif isinstance(e, ValueError):
        fail(str(e), command_help(argv))
    elif isinstance(e, SafetensorError):  # what safetensors raises for the same, when it writes
        fail(f"safetensors: {e}", FILESYSTEM_HINT)
    raise error

if __name__ == "__main__":
    # `python -m vitkit.cli.main`: run the imported module's main, so that the UsageError the command
    # modules raise is the class caught there (this file as __main__ defines a second one).
    from vitkit.cli.main import main as _main

    _main(sys.argv[1:])
