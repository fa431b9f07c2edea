"""``python -m pprun.apps.bench``: the same as ``pprun bench``."""

from pprun.apps.bench.app import main

main()
