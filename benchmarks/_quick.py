"""``--quick``: the smoke run's values as defaults, so options given explicitly still count."""

import argparse
from typing import Any


def parse_with_quick(
    parser: argparse.ArgumentParser, argv: list[str] | None, quick: dict[str, Any]
) -> argparse.Namespace:
    """Parse ``argv``; under ``--quick`` the values in ``quick`` (by ``dest``) replace the parser's
    defaults, never an option the command line names."""
    args = parser.parse_args(argv)
    if args.quick:
        parser.set_defaults(**quick)
        args = parser.parse_args(argv)
    return args
