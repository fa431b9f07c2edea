"""The ``pprun`` command. Its subcommands (the table is ``pprun.apps.SUBCOMMANDS``):

- ``pprun generate``: complete prompts (arguments or a JSONL file) and print a summary.
- ``pprun bench``: offline throughput and latency as JSON, against the peers transformers
  (``peer=hf``) and vLLM (``peer=vllm``) on the same weights and token ids.
- ``pprun serve``: serve the model over gRPC (pprun.v1, KServe v2 / Triton).
- ``pprun submit``: run any of these apps as a job on a Ray cluster (status, logs, stop).
- ``pprun transcribe``: transcribe audio files with a speech model (Whisper).
- ``pprun report``: the table and throughput plot of a ``pprun bench`` sweep's JSONs.

The first argument picks the subcommand; everything after it goes to that subcommand's Hydra app
as overrides (``key=value``, ``group=option``, ``-m`` for sweeps, ``--help``, ``--cfg job``).
"""

from __future__ import annotations

import difflib
import importlib
import sys
from collections.abc import Sequence

from pprun.apps import SUBCOMMANDS


def usage() -> str:
    """The text of ``pprun --help``."""
    lines = [
        "usage: pprun <command> [hydra overrides ...]",
        "",
        "Pipeline-parallel transformer inference.",
        "",
        "commands:",
    ]
    lines += [f"  {name:<10} {desc}" for name, (_, desc) in SUBCOMMANDS.items()]
    lines += [
        "",
        "Overrides are Hydra's: key=value, group=option (e.g. parallel=pp2_ray), -m to sweep",
        "(e.g. pprun bench -m scheduler.max_num_seqs=1,4). `pprun <command> --help` lists the keys.",
        "Configs: conf/*.yaml.",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``pprun <command> [overrides]``; returns the exit status (Hydra exits itself on errors)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage(), file=sys.stdout if args else sys.stderr)
        return 0 if args else 2
    if args[0] in ("-V", "--version"):
        from pprun import __version__

        print(f"pprun {__version__}")
        return 0
    command = args[0]
    if command not in SUBCOMMANDS:
        close = [c for c in SUBCOMMANDS if c.startswith(command)] or difflib.get_close_matches(
            command, list(SUBCOMMANDS), n=1
        )
        hint = f"; did you mean {close[0]!r}?" if close else ""
        print(
            f"pprun: unknown command {command!r}{hint} (commands: {', '.join(SUBCOMMANDS)})", file=sys.stderr
        )
        return 2
    module = importlib.import_module(SUBCOMMANDS[command][0])
    # Hydra parses sys.argv itself; present the subcommand as the program name.
    sys.argv = [f"pprun {command}", *args[1:]]
    module.main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
