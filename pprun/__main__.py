"""``python -m pprun generate ...`` / ``python -m pprun bench ...``: the ``pprun`` command."""

import sys

from pprun.cli import main

sys.exit(main())
