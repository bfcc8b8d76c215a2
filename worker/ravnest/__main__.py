"""`python -m ravnest` runs the CLI."""

import sys

from ravnest.cli import main

sys.exit(main())
