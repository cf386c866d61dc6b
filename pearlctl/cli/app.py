"""The ``pearlctl`` Typer app and its root options; every command module registers its commands on it."""

from __future__ import annotations

import typer

from pearlctl import __version__

app = typer.Typer(
    name="pearlctl",
    help="Control plane for agentic RL post-training on Slurm.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"pearlctl {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """pearlctl: launch, watch and cancel RL runs on Slurm (or local process groups)."""
