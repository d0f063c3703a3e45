"""The OpenAI-compatible server end to end over loopback HTTP, on the real engine."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from serving_helpers import API_KEY, MODEL_NAME, GatedEngine, make_engine, start_server

from shardspeed.inference.serving.client import APIStatusError, Client


def _post(base: str, path: str, body: dict, timeout: float = 60, **kw) -> httpx.Response:
    return httpx.post(base + path, json=body, timeout=timeout, **kw)


def _sse_events(text: str) -> list[dict | str]:
    events: list[dict | str] = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        data = block[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_completion_matches_pipeline(server, pipe):
    base = server[0].base_url
    r = _post(
        base,
        "/v1/completions",
        {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 8, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    expected = pipe("Hello", max_new_tokens=8)[0]
    assert body["object"] == "text_completion"
    assert body["model"] == MODEL_NAME
    assert body["choices"][0]["text"] == expected.generated_text
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13}


def test_completion_list_of_prompts_and_token_ids(server, pipe):
    base = server[0].base_url
    prompts = ["abc", "a longer prompt"]
    r = _post(base, "/v1/completions", {"prompt": prompts, "max_tokens": 5, "temperature": 0})
    assert r.status_code == 200, r.text
    texts = [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
    assert texts == [x.generated_text for x in pipe(prompts, max_new_tokens=5)]
    r = _post(base, "/v1/completions", {"prompt": list(b"abc"), "max_tokens": 5, "temperature": 0})
    assert r.json()["choices"][0]["text"] == texts[0]


def test_chat_uses_fallback_template(server, pipe):
    base = server[0].base_url
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "hi"}]
    r = _post(
        base, "/v1/chat/completions", {"messages": messages, "max_tokens": 6, "temperature": 0}
    )
    assert r.status_code == 200, r.text
    body = r.json()
    expected = pipe("system: Be terse.\nuser: hi\nassistant:", max_new_tokens=6)[0]
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {
        "role": "assistant",
        "content": expected.generated_text,
    }
    assert body["usage"]["completion_tokens"] == 6


def test_streaming_completion_sse(server, pipe):
    base = server[0].base_url
    body = {
        "prompt": "Stream me",
        "max_tokens": 12,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    r = _post(base, "/v1/completions", body)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = _sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    usage = chunks.pop()
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 12
    assert (
        "".join(c["choices"][0]["text"] for c in chunks)
        == pipe("Stream me", max_new_tokens=12)[0].generated_text
    )
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_streaming_chat_with_openai_client(server, pipe):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server[0].base_url + "/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "tell"}],
        max_tokens=10,
        temperature=0,
        stream=True,
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == pipe("user: tell\nassistant:", max_new_tokens=10)[0].generated_text
    completion = client.completions.create(
        model=MODEL_NAME, prompt="tell", max_tokens=4, temperature=0
    )
    assert completion.choices[0].text == pipe("tell", max_new_tokens=4)[0].generated_text


def test_stop_strings_trimmed_streaming_and_not(server, pipe):
    base = server[0].base_url
    full = pipe("Stop test", max_new_tokens=16)[0].generated_text
    stop = full[5:7]
    expected = full[: full.find(stop)]
    r = _post(
        base,
        "/v1/completions",
        {"prompt": "Stop test", "max_tokens": 16, "temperature": 0, "stop": stop},
    )
    choice = r.json()["choices"][0]
    assert choice["text"] == expected and choice["finish_reason"] == "stop"
    r = _post(
        base,
        "/v1/completions",
        {
            "prompt": "Stop test",
            "max_tokens": 16,
            "temperature": 0,
            "stop": [stop, "\x00never"],
            "stream": True,
        },
    )
    chunks = _sse_events(r.text)[:-1]
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_64_concurrent_requests_match_pipeline(server, pipe):
    base = server[0].base_url
    prompts = [f"request number {i}: " for i in range(64)]
    expected = [r.generated_text for r in pipe(prompts, max_new_tokens=8)]

    async def run() -> list[str]:
        async with httpx.AsyncClient(base_url=base, timeout=120) as client:

            async def one(p: str) -> str:
                r = await client.post(
                    "/v1/completions", json={"prompt": p, "max_tokens": 8, "temperature": 0}
                )
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["text"]

            return await asyncio.gather(*(one(p) for p in prompts))

    assert asyncio.run(run()) == expected


@pytest.mark.parametrize(
    ("path", "body", "status", "needle", "param"),
    [
        ("/v1/completions", b"{not json", 400, "malformed JSON", None),
        ("/v1/completions", {"prompt": "x", "max_tokens": -3}, 400, "max_tokens", "max_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 65}, 400, "limit of 64", "max_tokens"),
        ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "gpt-4", "model"),
        ("/v1/completions", {"prompt": "x", "n": 17}, 400, "n=17 is not supported", "n"),
        ("/v1/completions", {"max_tokens": 2}, 400, "required", "prompt"),
        ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature", "temperature"),
        ("/v1/completions", {"prompt": "x" * 300}, 400, "prompt", None),
        ("/v1/chat/completions", {"messages": []}, 400, "messages", "messages"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "wizard", "content": "x"}]},
            400,
            "role",
            None,
        ),
        ("/v1/completions", {"prompt": "x" * 200_000}, 413, "100000 bytes", None),
    ],
)
def test_bad_requests_get_openai_errors(server, path, body, status, needle, param):
    base = server[0].base_url
    if isinstance(body, bytes):
        r = httpx.post(
            base + path, content=body, headers={"content-type": "application/json"}, timeout=30
        )
    else:
        r = _post(base, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"]
    assert set(err) == {"message", "type", "param", "code"}
    if param is not None:
        assert err["param"] == param


def test_unknown_route_is_openai_style_404(server):
    r = httpx.get(server[0].base_url + "/v1/nothing", timeout=10)
    assert r.status_code == 404 and "message" in r.json()["error"]


def test_client_disconnect_aborts_request(server):
    thread, async_engine = server
    with httpx.Client(base_url=thread.base_url, timeout=30) as client:
        body = {
            "prompt": "long one",
            "max_tokens": 64,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
        }
        with client.stream("POST", "/v1/completions", json=body) as r:
            next(r.iter_lines())
    deadline = time.monotonic() + 10
    while async_engine._streams and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not async_engine._streams


def test_client_helper(server, pipe):
    with Client(server[0].base_url + "/v1") as client:
        assert client.health()
        assert client.models() == [MODEL_NAME]
        expected = pipe("client", max_new_tokens=6)[0].generated_text
        assert (
            client.complete("client", max_tokens=6, temperature=0)["choices"][0]["text"] == expected
        )
        assert "".join(client.stream_complete("client", max_tokens=6, temperature=0)) == expected
        chat = client.chat([{"role": "user", "content": "x"}], max_tokens=3, temperature=0)
        assert chat["usage"]["completion_tokens"] == 3
        with pytest.raises(APIStatusError) as info:
            client.complete("client", max_tokens=0)
        assert info.value.status_code == 400 and info.value.param == "max_tokens"


def test_queue_full_429_and_api_key_401():
    gated = GatedEngine(make_engine())
    thread, async_engine = start_server(gated, max_queue=2, api_key=API_KEY)
    auth = {"Authorization": f"Bearer {API_KEY}"}
    try:
        base = thread.base_url
        r = _post(base, "/v1/completions", {"prompt": "x"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = _post(
            base, "/v1/completions", {"prompt": "x"}, headers={"Authorization": "Bearer wrong"}
        )
        assert r.status_code == 401 and "Incorrect API key" in r.json()["error"]["message"]
        assert httpx.get(base + "/v1/models", timeout=10).status_code == 401
        assert (
            httpx.get(base + "/v1/models", headers=auth, timeout=10).json()["data"][0]["id"]
            == MODEL_NAME
        )

        # A non-streaming client that gives up while queued frees its queue slot.
        with pytest.raises(httpx.ReadTimeout):
            _post(base, "/v1/completions", {"prompt": "gone"}, headers=auth, timeout=0.5)
        deadline = time.monotonic() + 10
        while async_engine.queue_depth and time.monotonic() < deadline:
            time.sleep(0.02)
        assert async_engine.queue_depth == 0 and not async_engine._streams

        async def run() -> list[int]:
            async with httpx.AsyncClient(base_url=base, headers=auth, timeout=60) as client:
                body = {"prompt": "queued", "max_tokens": 3, "temperature": 0}
                held = [
                    asyncio.ensure_future(client.post("/v1/completions", json=body))
                    for _ in range(2)
                ]
                for _ in range(1000):  # at most ~10 s
                    if async_engine.queue_depth == 2:
                        break
                    await asyncio.sleep(0.01)
                assert async_engine.queue_depth == 2
                rejected = await client.post("/v1/completions", json=body)
                assert rejected.json()["error"]["code"] == "queue_full"
                gated.gate.set()
                return [rejected.status_code] + [(await h).status_code for h in held]

        assert asyncio.run(run()) == [429, 200, 200]
        assert httpx.get(base + "/health", timeout=10).status_code == 200
        metrics = httpx.get(base + "/metrics", timeout=10).text
        assert "shardspeed_requests_rejected_total 1" in metrics
    finally:
        gated.gate.set()
        thread.stop()


def test_health_and_metrics_after_traffic(server):
    base = server[0].base_url
    for prompt in ("m1", "m2"):
        _post(base, "/v1/completions", {"prompt": prompt, "max_tokens": 4, "temperature": 0})
    assert httpx.get(base + "/health", timeout=10).json() == {"status": "ok"}
    text = httpx.get(base + "/metrics", timeout=10).text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    assert values["shardspeed_generation_tokens_total"] >= 8
    assert values["shardspeed_time_to_first_token_seconds_count"] >= 2
    assert (
        values['shardspeed_time_to_first_token_seconds_bucket{le="+Inf"}']
        == values["shardspeed_time_to_first_token_seconds_count"]
    )
    for name in (
        "shardspeed_queue_depth",
        "shardspeed_num_requests_running",
        "shardspeed_kv_blocks_used",
        "shardspeed_kv_blocks_total",
        "shardspeed_generation_tokens_per_second",
        "shardspeed_time_per_output_token_seconds_sum",
    ):
        assert name in values
    assert values["shardspeed_queue_depth"] == 0


class _BrokenEngine(GatedEngine):
    def step(self):
        raise RuntimeError("simulated kernel failure")


def test_engine_failure_gives_503_and_unhealthy():
    thread, _ = start_server(_BrokenEngine(make_engine()))
    try:
        r = _post(thread.base_url, "/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and "simulated kernel failure" in r.json()["error"]["message"]
        assert httpx.get(thread.base_url + "/health", timeout=10).status_code == 503
        r = _post(thread.base_url, "/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert r.status_code == 503
    finally:
        thread.stop()
