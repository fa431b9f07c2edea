"""``GET /metrics`` of a live ``pprun serve`` (the tiny Llama with the two-letter tokenizer, one
stage, engine process): after a few requests, its latency histograms, parsed with
``prometheus_client``'s parser, count exactly the requests and tokens served."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_helpers import ServerProcess

try:  # the HTTP client the openai package is built on (httpx2 in its recent releases)
    import httpx2 as httpx
except ImportError:
    import httpx

MAX_TOKENS = [4, 1, 6]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tiny_models import make_tiny_llama
    from tiny_tokenizer import make_two_letter_tokenizer

    model_dir = make_two_letter_tokenizer(
        make_tiny_llama(tmp_path_factory.mktemp("metrics_llama"), num_layers=2)
    )
    proc = ServerProcess(tmp_path_factory.mktemp("metrics_server"), [
        f"model.model={model_dir}", "model.dtype=float32", "parallel=single", "scheduler.max_num_seqs=4",
        "serve.http_port=0", "compilation.warmup=none",
    ])  # fmt: skip
    yield proc
    proc.kill()


def scrape(server: ServerProcess) -> dict[str, dict[str, float]]:
    """Every metric family's samples by sample name (histogram buckets by ``le``)."""
    answer = httpx.get(f"http://{server.info['http_address']}/metrics", timeout=30)
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/plain")
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(answer.text):
        samples = out.setdefault(family.name, {})
        for s in family.samples:
            samples[s.name + (f"{{le={s.labels['le']}}}" if "le" in s.labels else "")] = s.value
    return out


def test_latency_histograms_count_the_requests_and_tokens_served(server):
    url = f"http://{server.info['http_address']}/v1/completions"
    num_tokens = []
    for i, max_tokens in enumerate(MAX_TOKENS):
        body = {"model": server.info["model"], "prompt": "abcdefgh", "max_tokens": max_tokens,
                "temperature": 0.0, "ignore_eos": True, "stream": i == 0}  # fmt: skip
        answer = httpx.post(url, json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        if i == 0:
            assert answer.text.rstrip().endswith("data: [DONE]")
            num_tokens.append(max_tokens)  # ignore_eos: every token asked for
        else:
            num_tokens.append(answer.json()["usage"]["completion_tokens"])
    assert num_tokens == MAX_TOKENS
    m = scrape(server)
    num_requests = len(MAX_TOKENS)
    ttft = m["pprun:time_to_first_token_seconds"]
    assert ttft["pprun:time_to_first_token_seconds_count"] == num_requests
    assert ttft["pprun:time_to_first_token_seconds_bucket{le=+Inf}"] == num_requests
    assert ttft["pprun:time_to_first_token_seconds_sum"] > 0
    queue = m["pprun:request_queue_time_seconds"]
    assert queue["pprun:request_queue_time_seconds_count"] == num_requests
    # One observation per token after a request's first; one per request of two tokens or more.
    itl = m["pprun:inter_token_latency_seconds"]
    assert itl["pprun:inter_token_latency_seconds_count"] == sum(n - 1 for n in num_tokens)
    tpot = m["pprun:time_per_output_token_seconds"]
    assert tpot["pprun:time_per_output_token_seconds_count"] == sum(n >= 2 for n in num_tokens)
    # The engine's state is still there, under its names.
    assert m["pprun_healthy"]["pprun_healthy"] == 1
    assert m["pprun_engine_steps"]["pprun_engine_steps_total"] >= max(MAX_TOKENS)
    # Without a warm-up (set above) the first steps after ready meet their classes for the first time.
    assert m["pprun_first_uses_after_ready"]["pprun_first_uses_after_ready_total"] > 0
