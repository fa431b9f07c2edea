"""Convert the built-in demo model (GGUF in a pip package) to a Hugging Face directory.

Usage:
    python scripts/build_demo_model.py                 # into the pprun cache
    python scripts/build_demo_model.py --out DIR       # into DIR
    python scripts/build_demo_model.py --alias NAME    # another known alias

Prints the path of the converted directory on stdout. Never downloads anything.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

# Run as `python scripts/build_demo_model.py` from a checkout, sys.path[0] is
# scripts/; make the repository's pprun importable without installing it.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pprun.models.demo import (
    DEMO_MODEL_ALIAS,
    DEMO_MODELS,
    convert_gguf_to_hf,
    gguf_path_for,
    resolve_model,
)


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, convert (or reuse the cached conversion), print the path."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--alias",
        default=DEMO_MODEL_ALIAS,
        choices=sorted(DEMO_MODELS),
        help="built-in model to convert (default: %(default)s)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output directory (default: <cache>/models/<alias>, "
        "cache = $PPRUN_CACHE_DIR or ~/.cache/pprun)",
    )
    args = parser.parse_args(argv)
    # Logs go to stderr so stdout carries only the path, for `$(...)` in shells.
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    if args.out is None:
        path = resolve_model(args.alias)
    else:
        path = convert_gguf_to_hf(gguf_path_for(args.alias), args.out)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
