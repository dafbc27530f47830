"""What every command group shares: the help layout (defaults shown), argument types that refuse bad numbers in
the parser, and the one way a group adds a command (its parser beside its handler)."""

from __future__ import annotations

import argparse
from collections.abc import Callable


class Parser(argparse.ArgumentParser):
    """argparse's parser, whose refusals are one line (the usage block is one `--help` away)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` with each flag's default, left out where it says nothing (None, off switches) or the help
    already states it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        quiet = action.default is None or action.default is False or action.default in ([], "", argparse.SUPPRESS)
        if quiet or "default" in text:
            return text
        if action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"
        return text


def at_least_one(text: str) -> int:
    """An int >= 1, for counts such as draft tokens per step (K = 0 would decode without the drafter)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


SHIPPED = "`toy`, `toy-plateau` or `toy-driftfix` (the shipped toy drafters)"


def resolve_drafter_path(text: str) -> str:
    """A `--drafter` value: a shipped toy drafter's name becomes its directory; anything else is a directory."""
    from draftopd.loading import resolve_drafter_path as resolve

    return resolve(text)


def add_command(sub, name: str, handler: Callable, summary: str, description: str = "") -> argparse.ArgumentParser:
    """A subcommand's parser, bound to its handler; `summary` is its line in `draftopd --help`."""
    p = sub.add_parser(name, description=description or summary, formatter_class=HelpFormatter)
    p.set_defaults(handler=handler, summary=summary)
    return p
