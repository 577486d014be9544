"""``dualpath prepare-model``: convert the default model once and print its path."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from argparse import ArgumentParser


@dataclass(frozen=True)
class PrepareModelOptions:
    """The command takes no options."""


def add_arguments(parser: ArgumentParser) -> None:
    """None."""


def run(options: PrepareModelOptions) -> int:
    """Print the default model's folder (converted first if it is not yet)."""
    from dualpath.model.default_model import ensure_default_model

    print(ensure_default_model())
    return 0
