"""Fault injection into the engine behind a live server: one request's failure stays its
own, and a dead engine thread is restarted and reported by /health and /metrics."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from serving_helpers import make_engine, start_server

import shardspeed.inference.fastgen.engine as engine_module
from shardspeed.inference.serving.pipeline import Pipeline

MARK = list(b"BOOM")  # a prompt starting with these bytes is the one that fails


def _is_marked(req) -> bool:
    return req.prompt_token_ids[: len(MARK)] == MARK


def _prompts() -> list[str]:
    return [f"request {i} says" for i in range(6)]


@pytest.fixture(scope="module")
def expected() -> dict[str, str]:
    pipe = Pipeline(make_engine())
    return {p: r.generated_text for p, r in zip(_prompts(), pipe(_prompts(), max_new_tokens=8))}


def _run_concurrently(base: str, bodies: list[dict]) -> list[httpx.Response]:
    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=base, timeout=60) as client:
            return await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))

    return asyncio.run(run())


def _check_isolation(base: str, expected: dict[str, str], needle: str) -> None:
    bodies = [{"prompt": p, "max_tokens": 8, "temperature": 0} for p in _prompts()]
    bodies.insert(3, {"prompt": "BOOM goes one", "max_tokens": 8, "temperature": 0})
    responses = _run_concurrently(base, bodies)
    for body, r in zip(bodies, responses):
        if body["prompt"].startswith("BOOM"):
            assert r.status_code == 500, r.text
            err = r.json()["error"]
            assert needle in err["message"] and err["code"] == "request_failed"
        else:
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == expected[body["prompt"]]
    # Streaming: the failing request gets an error event, then the stream ends.
    stream = {"prompt": "BOOM streamed", "max_tokens": 8, "temperature": 0, "stream": True}
    r = httpx.post(base + "/v1/completions", json=stream, timeout=60)
    if r.status_code == 200:  # failed after the first token: in-band error
        events = [b[len("data: ") :] for b in r.text.split("\n\n") if b.strip()]
        assert events[-1] == "[DONE]"
        assert needle in json.loads(events[-2])["error"]["message"]
    else:  # failed before the first token: a plain 500
        assert r.status_code == 500 and needle in r.json()["error"]["message"]
    health = httpx.get(base + "/health", timeout=10)
    assert health.status_code == 200 and health.json() == {"status": "ok"}


def test_sampler_failure_fails_only_its_request(monkeypatch, expected):
    real = engine_module.sample_next_tokens

    def flaky_sampler(logits, requests):
        if any(_is_marked(r) for r in requests):
            raise RuntimeError("injected sampler fault")
        return real(logits, requests)

    monkeypatch.setattr(engine_module, "sample_next_tokens", flaky_sampler)
    thread, async_engine = start_server(make_engine())
    try:
        _check_isolation(thread.base_url, expected, "injected sampler fault")
        assert async_engine.restarts == 0
    finally:
        thread.stop()


def test_forward_failure_fails_only_its_request(expected):
    engine = make_engine()
    real = engine.runner.execute
    failed_batch_sizes = []

    def flaky_forward(batch, *args):
        if any(_is_marked(s.request) for s in batch.sequences):
            failed_batch_sizes.append(len(batch.sequences))
            raise RuntimeError("injected forward fault")
        return real(batch, *args)

    engine.runner.execute = flaky_forward
    thread, async_engine = start_server(engine)
    try:
        _check_isolation(thread.base_url, expected, "injected forward fault")
        assert max(failed_batch_sizes) > 1  # the fault hit a shared batch, not only a solo one
        assert async_engine.restarts == 0
        assert not engine.has_unfinished() and engine.block_pool.num_used == 0
    finally:
        thread.stop()


class _DiesOnce:
    """An engine whose ``stats()`` raises once (outside any request) when armed."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self.armed = False

    def stats(self):
        if self.armed:
            self.armed = False
            raise SystemExit("injected engine-thread death")
        return self._engine.stats()

    def __getattr__(self, name):
        return getattr(self._engine, name)


def test_dead_engine_thread_is_restarted_and_reported(expected):
    wrapper = _DiesOnce(make_engine())
    thread, async_engine = start_server(wrapper, restart_backoff_s=0.3)
    base = thread.base_url
    prompt = _prompts()[0]
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0}
    try:
        assert httpx.post(base + "/v1/completions", json=body, timeout=60).status_code == 200
        wrapper.armed = True
        r = httpx.post(base + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 503 and "injected engine-thread death" in r.text
        down = httpx.get(base + "/health", timeout=10)
        assert down.status_code == 503 and "restarting" in down.json()["detail"]
        deadline = time.monotonic() + 10
        while async_engine.restarts == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        health = httpx.get(base + "/health", timeout=10)
        assert health.status_code == 200, health.text
        assert health.json() == {"status": "ok", "restarts": 1}
        assert "shardspeed_engine_restarts_total 1" in httpx.get(base + "/metrics").text
        r = httpx.post(base + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected[prompt]
    finally:
        thread.stop()


def test_step_failing_for_good_still_answers_503_then_recovers():
    """A step that raises outside per-request code (here: every step) is the engine's
    fault: in-flight requests get 503, the thread restarts, and serving resumes once
    the fault is gone."""
    engine = make_engine()
    broken = {"on": True}
    real_step = engine.step

    def step():
        if broken["on"]:
            raise RuntimeError("injected step fault")
        return real_step()

    engine.step = step
    thread, async_engine = start_server(engine, restart_backoff_s=0.1)
    base = thread.base_url
    body = {"prompt": "x", "max_tokens": 2, "temperature": 0}
    try:
        r = httpx.post(base + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 503 and "injected step fault" in r.text
        broken["on"] = False
        deadline = time.monotonic() + 10
        while not async_engine.is_healthy and time.monotonic() < deadline:
            time.sleep(0.05)
        assert httpx.post(base + "/v1/completions", json=body, timeout=60).status_code == 200
        assert async_engine.restarts >= 1
    finally:
        thread.stop()
