"""Summarise one traced run: steady-decode medians of the engine and of every stage (JSON).

    PPRUN_STEP_TRACE=/tmp/trace pprun bench ...   # writes /tmp/trace.engine.json, /tmp/trace.stage{r}.json
    python scripts/trace_summary.py /tmp/trace

See ``pprun.utils.step_trace.summarize_traces`` for how to read it.
"""

from __future__ import annotations

import argparse
import json

from pprun.utils.step_trace import summarize_traces


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prefix", help="the PPRUN_STEP_TRACE prefix of the run")
    try:
        summary = summarize_traces(ap.parse_args().prefix)
    except FileNotFoundError as e:
        raise SystemExit(str(e)) from None
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
