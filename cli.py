"""needle-twin: convert Needle checkpoints between Flax and PyTorch and prove both compute the same function.

Commands stay thin: parsing and printing here, the work in the packages. Library errors
(`NeedleTwinError`) become one red line and exit code 2; exit code 1 means parity failed.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Annotated, Optional

import typer

from convert.errors import NeedleTwinError

__version__ = "0.1.0"

app = typer.Typer(
    name="needle-twin",
    help="Flax/JAX <-> PyTorch parity and weight conversion for Needle v1.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def fail(message: str, code: int = 2) -> None:
    """Print one red line to stderr and exit."""
    from rich.console import Console

    Console(stderr=True, highlight=False, soft_wrap=True).print(f"[bold red]error:[/] {message}", markup=True)
    raise typer.Exit(code)


def guarded(fn: Callable) -> Callable:
    """Turn the project's errors (and a few user-facing OS errors) into one line and exit 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except NeedleTwinError as e:
            fail(str(e))
        except FileNotFoundError as e:
            fail(f"{e.filename or e}: no such file; check the path")
        except IsADirectoryError as e:
            fail(f"{e.filename or e}: is a directory; give a file")
        except PermissionError as e:
            fail(f"{e.filename or e}: permission denied")
        except KeyboardInterrupt:
            fail("interrupted; nothing was written", 130)

    return wrapper


def _version(value: bool) -> None:
    if value:
        typer.echo(f"needle-twin {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        Optional[bool], typer.Option("--version", callback=_version, is_eager=True, help="Show the version and exit.")
    ] = None,
) -> None:
    """Flax/JAX <-> PyTorch parity and weight conversion for Needle v1."""


# --- convert commands (issue 3): convert, inspect, diff ---

# --- parity commands (issue 4): parity, rescore ---

# --- generate command (issue 5) ---


def main() -> None:
    app(prog_name="needle-twin")


if __name__ == "__main__":
    sys.exit(main())
