"""The examples' ``--help`` layout: the script's docstring as written, and every option's default."""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps the description's line breaks and appends ``(default: ...)`` to an option's help.

    Not to a required option (it has no default), nor where the default is ``None`` (the
    help says what happens then) or the help already names its default.
    """

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.required or action.default is None or "(default" in text:
            return text
        return super()._get_help_string(action)
