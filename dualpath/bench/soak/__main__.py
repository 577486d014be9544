"""``python -m dualpath.bench.soak`` (``make soak``) is ``dualpath bench soak``."""

import sys

from dualpath.bench.soak.command import main

if __name__ == "__main__":
    sys.exit(main())
