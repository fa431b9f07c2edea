"""Entry of an ``mp`` stage process: ``python -m pprun.executor.stage_main HOST PORT RANK``.

The auth key comes in the environment (``PPRUN_AUTHKEY``, hex), not on the command line.
"""

from __future__ import annotations

import os
import sys

from pprun.executor.remote import worker_main

if __name__ == "__main__":
    host, port, rank = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    worker_main((host, port), bytes.fromhex(os.environ.pop("PPRUN_AUTHKEY")), rank)
