"""``dualpath keys``: control-plane keys for a router and its engines."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from dualpath.commands.args import names
from dualpath.errors import DualPathError

if TYPE_CHECKING:
    from argparse import ArgumentParser


@dataclass(frozen=True)
class KeysOptions:
    """The ``dualpath keys`` command line."""

    dir: str
    engines: tuple[str, ...]


def add_arguments(parser: ArgumentParser) -> None:
    """The options of :class:`KeysOptions`."""
    parser.add_argument("dir", help="where to write router.json and engines/NAME.json")
    parser.add_argument("--engines", type=names, required=True,
                        help="comma-separated engine names, e.g. pe0,de1,de2")


def run(options: KeysOptions) -> int:
    """Write the keys; print how to use them."""
    from dualpath.control_keys import ClusterKeys
    from dualpath.protocol import check_engine

    engines = options.engines
    for name in engines:
        try:
            check_engine(name)
        except ValueError as exc:
            raise DualPathError(str(exc)) from exc
    if not engines or len(set(engines)) != len(engines):
        raise DualPathError("--engines needs distinct engine names, e.g. pe0,de1,de2")
    folder = ClusterKeys.generate(list(engines)).write(options.dir)
    print(f"keys for the router and {len(engines)} engines in {folder}: start the router with "
          f"`--set control_keys={folder}`; copy {folder}/engines/NAME.json to engine NAME's "
          "host only and start it with `dualpath engine --key FILE`")
    return 0
