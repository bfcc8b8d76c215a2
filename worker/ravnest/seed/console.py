"""What the seed API shows a provider script's user: Ravnest prints the plan and a line per
epoch, and so do we, through the ``ravnest.seed.console`` logger, which writes its messages to
standard output as they are. Silence it with
``logging.getLogger("ravnest.seed.console").setLevel(logging.WARNING)``."""

from __future__ import annotations

import logging
import sys

CONSOLE = logging.getLogger("ravnest.seed.console")


class _Stdout(logging.Handler):
    """Writes to whatever sys.stdout is when a message comes (pytest and notebooks swap it),
    never touching a stream swapped out (and maybe closed) since."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stdout.write(self.format(record) + "\n")
            sys.stdout.flush()
        except Exception:
            self.handleError(record)


if not CONSOLE.handlers:
    _handler = _Stdout()
    _handler.setFormatter(logging.Formatter("%(message)s"))
    CONSOLE.addHandler(_handler)
    CONSOLE.setLevel(logging.INFO)
    CONSOLE.propagate = False


def say(message: str) -> None:
    """Show `message` to the user (one or more lines)."""
    CONSOLE.info(message)
