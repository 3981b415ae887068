"""argparse pieces every subcommand uses: the help format and the count types (argparse names the flag in their
errors). The model flags that use them are loading.add_model_flags."""

from __future__ import annotations

import argparse


class HELP_FORMAT(argparse.ArgumentDefaultsHelpFormatter):  # noqa: N801 (used as formatter_class=HELP_FORMAT)
    """Every subcommand's --help shows each flag's default, unless it has none (None / off) or says it itself."""

    def _get_help_string(self, action):
        # `is`, not `in (None, False)`: 0 == False, and a default of 0 (--temperature, --top-k, --seed) is worth showing
        if action.default is None or action.default is False or "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (argparse names the flag in its error)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value
