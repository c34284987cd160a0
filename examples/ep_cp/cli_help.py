"""The examples' ``--help`` layout: the script's docstring as written, and every option's default."""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps the description's line breaks and appends ``(default: ...)`` to each option's help."""
