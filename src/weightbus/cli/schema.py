"""``weightbus schema``: print the JSON Schema of every event family, for non-Python subscribers."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from weightbus.schemas import json_schemas

__all__ = ["register", "schema_command"]


def schema_command(
    family: Annotated[
        str | None, typer.Argument(help="Only this family: weights, counter, applied, alerts or drains.")
    ] = None,
) -> None:
    """Print the JSON Schema of each event family (keyed by family) as one JSON document."""
    schemas = json_schemas()
    if family is not None:
        if family not in schemas:
            raise typer.BadParameter(f"unknown family {family!r}; choose from {', '.join(schemas)}")
        schemas = {family: schemas[family]}
    typer.echo(json.dumps(schemas, indent=2, sort_keys=True))


def register(app: typer.Typer) -> None:
    """Add ``schema`` to ``app``."""
    app.command("schema")(schema_command)
