"""`python -m ravnest` runs the CLI (`ravnest.cli.entry`: how a worker's process ends)."""

import sys

from ravnest.cli import entry

entry(sys.argv[1:])
