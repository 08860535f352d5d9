"""List flags that add up when repeated, for every CLI here (the config's tuple fields, the bench's lists)."""

from __future__ import annotations

import argparse


class ListFlag(argparse.Action):
    """A list flag (nargs "+" or "*") that adds up when repeated: `--decode A --decode B` is
    `--decode A B` (argparse's own would keep only B, silently). The first use replaces the default;
    a value given twice is refused, naming it (a server listed twice would be two workers to the router)."""

    def __call__(self, parser, namespace, values, option_string=None):
        current = getattr(namespace, self.dest, None)
        items = [] if current is None or current is self.default else list(current)
        for value in values:
            if value in items:
                raise argparse.ArgumentError(self, f"{value} is given twice")
            items.append(value)
        setattr(namespace, self.dest, items)


LIST_NARGS = {"nargs": "+", "action": ListFlag}  # add_argument(..., **LIST_NARGS): one or more, adding up
