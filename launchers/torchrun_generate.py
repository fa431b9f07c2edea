"""Generate with one pipeline stage per torchrun rank (executor ``external_launcher``, SPMD).

    torchrun --nproc-per-node 2 launchers/torchrun_generate.py \
        model.model=/path/to/model parallel.pipeline_parallel_size=2 \
        'prompts=[Hello, "The capital of France is"]' sampling.max_tokens=32

Arguments are Hydra overrides of ``conf/generate.yaml`` (every key of
``pprun.config.GenerateAppConfig``; ``parallel=torchrun`` selects pp=2 with executor
external_launcher). ``parallel.pipeline_parallel_size`` must equal torchrun's world size
(``--nproc-per-node`` x ``--nnodes``); ``executor=auto`` picks external_launcher under torchrun.

The config is composed with ``hydra.compose`` rather than ``@hydra.main``: every rank runs this
script, and ``hydra.main`` would have each of them set up Hydra's logging and working directory.

Every rank computes the same results (the last stage shares each step's sampled tokens), so
only rank 0 reports them: as JSON lines to ``output_file`` when set, else to stdout; an
``output_file`` holding ``{rank}`` has every rank write its own copy.

Several hosts (``--nnodes N``): start the same command on every host with one rendezvous
endpoint, e.g. ``torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint
HOST0:29500 --rdzv-id job1 launchers/torchrun_generate.py ...`` (``docs/cluster.md``).

Prompts come from ``prompts`` and ``input_file`` (one prompt per line, or ``.jsonl`` with a ``"prompt"`` string
or a ``"prompt_token_ids"`` list per line, the latter for models without a tokenizer).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

# Run as a plain script from a source checkout: make the repository's package importable.
_REPO_ROOT = Path(__file__).resolve().parent.parent
if (_REPO_ROOT / "pprun").is_dir() and str(_REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(_REPO_ROOT))

logger = logging.getLogger("pprun.launchers.torchrun_generate")


def compose_config(overrides: list[str]):
    """``conf/generate.yaml`` with ``overrides``, as a typed GenerateAppConfig."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from pprun.config.config import default_conf_dir, register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(default_conf_dir()), version_base=None):
        # `pprun generate` defaults to Ray actors; under torchrun the ranks are the stages.
        if not any(o.split("=", 1)[0].lstrip("+~") == "parallel" for o in overrides):
            overrides = ["parallel=torchrun", *overrides]
        cfg = compose(config_name="generate", overrides=overrides)
    return OmegaConf.to_object(cfg)


def read_prompts(prompts: list[str], input_file: str | None) -> list[str | dict]:
    """``prompts`` followed by ``input_file``'s prompts (text lines, or .jsonl objects)."""
    from pprun.apps import iter_jsonl

    result: list[str | dict] = list(prompts)
    if input_file is None:
        return result
    path = Path(input_file)
    if path.suffix != ".jsonl":
        if not path.is_file():
            raise ValueError(f"input_file={input_file!r} does not exist or is not a file")
        result.extend(line for line in path.read_text().splitlines() if line.strip())
        return result
    for where, row in iter_jsonl(input_file):
        if "prompt_token_ids" in row:
            result.append({k: row[k] for k in ("prompt_token_ids", "prompt") if k in row})
        elif isinstance(row.get("prompt"), str):
            result.append(row["prompt"])
        else:
            raise ValueError(f'{where}: must be an object with a "prompt" string or a "prompt_token_ids" list')
    return result


def main(argv: list[str] | None = None) -> int:
    """Compose the config, generate on this rank, report on rank 0; returns the exit code."""
    overrides = sys.argv[1:] if argv is None else argv
    rank = int(os.environ.get("RANK", "0"))
    app = compose_config(overrides)
    logging.basicConfig(
        level=str(app.log_level).upper(),
        format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s",
    )
    prompts = read_prompts(list(app.prompts), app.input_file)
    if not prompts:
        raise ValueError("no prompts: set prompts='[...]' or input_file=<path>")

    from pprun import LLM

    params = app.sampling.to_sampling_params()
    with LLM(config=app.pprun_config()) as llm:
        if app.chat:
            conversations = [[{"role": "user", "content": p}] for p in prompts if isinstance(p, str)]
            if len(conversations) != len(prompts):
                raise ValueError("chat=true needs text prompts, not prompt_token_ids")
            outputs = llm.chat(conversations, params)
        else:
            outputs = llm.generate(prompts, params)
        summary = llm.describe()
    # Every rank holds the same results; rank 0 reports them, or every rank where the output file
    # names its rank (output_file=out/rank{rank}.jsonl), to check or debug each rank's view.
    per_rank = bool(app.output_file) and "{rank}" in app.output_file
    if rank != 0 and not per_rank:
        return 0
    rows = [
        {
            "prompt": out.prompt,
            "prompt_token_ids": out.prompt_token_ids,
            "text": out.outputs[0].text,
            "token_ids": out.outputs[0].token_ids,
            "finish_reason": out.outputs[0].finish_reason,
        }
        for out in outputs
    ]
    lines = "".join(json.dumps(row) + "\n" for row in rows)
    if app.output_file:
        out = Path(app.output_file.replace("{rank}", str(rank)))
        out.write_text(lines)
        logger.info("wrote %d results to %s", len(rows), out)
    else:
        sys.stdout.write(lines)
    logger.info("pprun: %s", json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
