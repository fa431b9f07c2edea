"""The request latency histograms (``pprun.engine.request_latency``) on fake timestamps: what each
observes and when, read back through Prometheus' text format and its parser; and the serving
client feeds them from step reports (``EngineClient._on_report``), stamped with the report's time."""

from __future__ import annotations

import types

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pprun.engine.async_engine import EngineClient
from pprun.engine.engine_loop import FinishedUpdate, StepReport
from pprun.engine.outputs import RequestMetrics
from pprun.engine.request_latency import TOKEN_BUCKETS, LatencyHistograms, RequestTimes
from pprun.sampling.params import SamplingParams

NAMES = {
    "ttft": "pprun:time_to_first_token_seconds",
    "tpot": "pprun:time_per_output_token_seconds",
    "itl": "pprun:inter_token_latency_seconds",
    "queue": "pprun:request_queue_time_seconds",
}


def histograms(text: str) -> dict[str, dict]:
    """Each histogram's count, sum and cumulative buckets (upper bound -> count), by short name."""
    by_name = {v: k for k, v in NAMES.items()}
    out = {}
    for family in text_string_to_metric_families(text):
        if family.name not in by_name:
            continue
        h = {"buckets": {}}
        for s in family.samples:
            if s.name.endswith("_count"):
                h["count"] = s.value
            elif s.name.endswith("_sum"):
                h["sum"] = s.value
            elif s.name.endswith("_bucket"):
                h["buckets"][float(s.labels["le"])] = s.value
        out[by_name[family.name]] = h
    return out


def read(lat: LatencyHistograms) -> dict[str, dict]:
    return histograms(generate_latest(lat.registry).decode())


def test_observations_on_fake_timestamps():
    lat = LatencyHistograms()
    a, b = RequestTimes(arrival_time=100.0), RequestTimes(arrival_time=100.5)
    lat.step_tokens(100.7, [(a, 1)])  # a's first token after 0.7 s
    lat.step_tokens(100.73, [(a, 1), (b, 1)])  # a: 30 ms; b's first after 0.23 s
    lat.step_tokens(100.76, [(a, 1), (b, 1), (a, 0)])  # both 30 ms (one addition of two); no tokens: nothing
    lat.step_tokens(100.86, [(b, 1)])  # b: 100 ms... then a finishes with 3 tokens, b with 3
    lat.finished(a, RequestMetrics(100.0, first_scheduled_time=100.2))
    lat.finished(b, RequestMetrics(100.5, first_scheduled_time=100.5))
    lat.finished(RequestTimes(101.0), RequestMetrics(101.0))  # aborted while waiting: nothing
    h = read(lat)
    assert h["ttft"]["count"] == 2 and h["ttft"]["sum"] == pytest.approx(0.7 + 0.23)
    assert h["ttft"]["buckets"][0.25] == 1 and h["ttft"]["buckets"][0.75] == 2
    assert h["itl"]["count"] == 4 and h["itl"]["sum"] == pytest.approx(0.03 * 3 + 0.1)
    assert (
        h["itl"]["buckets"][0.025] == 0 and h["itl"]["buckets"][0.05] == 3 and h["itl"]["buckets"][0.15] == 4
    )
    assert h["tpot"]["count"] == 2 and h["tpot"]["sum"] == pytest.approx(0.03 + 0.065)
    assert h["queue"]["count"] == 2 and h["queue"]["sum"] == pytest.approx(0.2)
    assert h["queue"]["buckets"][0.001] == 1  # b was taken at once
    assert list(h["itl"]["buckets"]) == [*TOKEN_BUCKETS, float("inf")]


def test_a_single_token_request_has_a_first_token_and_no_per_token_time():
    lat = LatencyHistograms()
    t = RequestTimes(arrival_time=5.0)
    lat.step_tokens(5.5, [(t, 1)])
    lat.finished(t, RequestMetrics(5.0, first_scheduled_time=5.1))
    h = read(lat)
    assert (h["ttft"]["count"], h["itl"]["count"], h["tpot"]["count"], h["queue"]["count"]) == (1, 0, 0, 1)


class ReportFedClient(EngineClient):
    """An EngineClient without an engine: the test hands it reports."""

    def __init__(self) -> None:
        inputs = types.SimpleNamespace(
            tokenizer=None,
            check_params=lambda params, where: None,
            check_prompt=lambda prompt, where: (None, list(prompt["prompt_token_ids"])),
            check_output_room=lambda n, params, where: None,
        )
        super().__init__(inputs, max_unfinished=8)
        self.sent = []

    def _send(self, cmd) -> None:
        self.sent.append(cmd)

    def _stop_engine(self) -> None:
        pass

    num_steps = 0
    num_first_uses_after_ready = 0

    def num_free_blocks(self) -> int:
        return 0

    def describe(self) -> dict:
        return {}

    def cache_stats(self) -> dict:
        return {}


def test_the_client_observes_each_report_at_its_time():
    client = ReportFedClient()
    params = SamplingParams(temperature=0.0, max_tokens=3)
    stream = client.add_request({"prompt_token_ids": [1, 2]}, params, "a")
    (add,) = client.sent
    arrival = add.arrival_time
    client._on_report(StepReport(["a"], [7], time=arrival + 0.5))
    client._on_report(StepReport(["a"], [8], time=arrival + 0.52))
    metrics = RequestMetrics(arrival, first_scheduled_time=arrival + 0.1)
    client._on_report(StepReport(finished=[FinishedUpdate("a", [9], None, "length", num_output_tokens=3,
                                                          metrics=metrics)], time=arrival + 0.54))  # fmt: skip
    assert [d.token_ids for d in stream] == [[7], [8], [9]]
    h = read(client.latency)
    assert h["ttft"]["count"] == 1 and h["ttft"]["sum"] == pytest.approx(0.5)
    assert h["itl"]["count"] == 2 and h["itl"]["sum"] == pytest.approx(0.04)
    assert h["tpot"]["count"] == 1 and h["tpot"]["sum"] == pytest.approx(0.02)
    assert h["queue"]["count"] == 1 and h["queue"]["sum"] == pytest.approx(0.1)
