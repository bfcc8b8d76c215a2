"""`python -m ravnest` runs the CLI.

A worker process (`ravnest worker`) leaves with `os._exit` once it is done, its outputs written:
gRPC's threads may still hold a stream to a peer behind a network cut, and the interpreter's own
exit would wait for them for good (seen: a worker that finished its job never exited). Its
output streams and logs are flushed first; every other command exits as usual.
"""

import logging
import os
import sys
import traceback

from ravnest.cli import main

if len(sys.argv) > 1 and "worker" in sys.argv[1:3]:
    try:
        code = main()
    except SystemExit as e:  # a signal (SIGTERM: 143), or argparse
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
sys.exit(main())
