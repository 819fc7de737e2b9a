"""``--quick``: the smoke run's values as defaults, so options given explicitly still count; which
options a command line names."""

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


def given_options(parser: argparse.ArgumentParser, argv: list[str] | None) -> set[str]:
    """The ``dest`` of every option ``argv`` names (an option given its default value included), so
    that an option a run would ignore can be refused instead of silently dropped."""
    unset = object()
    accumulating = (argparse._AppendAction, argparse._ExtendAction, argparse._CountAction)  # they add to the default
    options = [action for action in parser._actions if action.default is not argparse.SUPPRESS]  # not --help
    saved = [action.default for action in options]
    markers = {action.dest: None if isinstance(action, accumulating) else unset for action in options}
    for action in options:  # not set_defaults, which would also add its keys to the parser's own defaults
        action.default = markers[action.dest]
    try:
        parsed = vars(parser.parse_args(argv))
    finally:
        for action, default in zip(options, saved, strict=True):
            action.default = default
    return {dest for dest, marker in markers.items() if parsed.get(dest) is not marker}
