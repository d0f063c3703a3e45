"""Pure pieces of serving: streaming text deltas, metrics text, request models, the CLI."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

pytest.importorskip("starlette")

from shardspeed.inference.serving.chat import render_chat_prompt
from shardspeed.inference.serving.errors import from_validation_error
from shardspeed.inference.serving.metrics import ServingMetrics
from shardspeed.inference.serving.protocol import CompletionRequest
from shardspeed.inference.serving.text_stream import TextDeltaStream, truncate_at_stop
from shardspeed.launcher import serve_cmd


def _feed(stream: TextDeltaStream, snapshots: list[str]) -> list[str]:
    deltas = [stream.update(t, finished=False) for t in snapshots[:-1]]
    return [*deltas, stream.update(snapshots[-1], finished=True)]


def test_incomplete_utf8_is_held_back():
    euro = "€".encode()
    snapshots = [
        b"a".decode(),
        (b"a" + euro[:1]).decode(errors="replace"),
        (b"a" + euro[:2]).decode(errors="replace"),
        (b"a" + euro).decode(),
        "a€b",
    ]
    assert _feed(TextDeltaStream(), snapshots) == ["a", "", "", "€", "b"]


def test_stop_prefix_is_held_back_then_trimmed():
    stream = TextDeltaStream(stop=["END"])
    assert stream.update("ab", False) == "ab"
    assert stream.update("abE", False) == ""
    assert stream.update("abEN", False) == ""
    assert stream.update("abENx", False) == "ENx"  # not a stop after all
    assert stream.update("abENxEND", True) == ""
    assert stream.text == "abENx"
    assert truncate_at_stop("hello world", ["wor", "lo"]) == ("hel", True)
    assert truncate_at_stop("hello", ["z"]) == ("hello", False)


def test_metrics_render_is_prometheus_text():
    m = ServingMetrics(rate_window_s=10.0)
    m.record_step(5, now=100.0)
    m.record_finished("length", 3, ttft=0.02, tpot=0.004, latency=0.5)
    assert m.tokens_per_second(now=105.0) == 0.5
    text = m.render(queue_depth=2)
    assert "# TYPE shardspeed_time_to_first_token_seconds histogram" in text
    assert 'shardspeed_time_to_first_token_seconds_bucket{le="0.025"} 1' in text
    assert 'shardspeed_time_to_first_token_seconds_bucket{le="0.01"} 0' in text
    assert "shardspeed_queue_depth 2" in text
    assert 'shardspeed_requests_finished_total{finish_reason="length"} 1' in text
    assert m.tokens_per_second(now=1e9) == 0.0


def test_validation_errors_name_the_field():
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({"prompt": "x", "max_tokens": -1})
    err = from_validation_error(info.value)
    assert err.status_code == 400 and err.param == "max_tokens" and "-1" in err.message
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({"prompt": "x", "echo": True, "stream": True})
    assert "echo are not supported with stream=true" in from_validation_error(info.value).message


def test_serve_cli_parses_engine_options():
    args = serve_cmd.build_parser().parse_args(
        [
            "model_dir",
            "--port",
            "0",
            "--scheduler",
            "prefill_first",
            "--block-size",
            "32",
            "--kv-cache-memory",
            "512M",
            "--api-key",
            "k",
        ]
    )
    assert (args.model, args.port, args.scheduler, args.block_size) == (
        "model_dir",
        0,
        "prefill_first",
        32,
    )
    assert args.kv_cache_memory == 512 * 2**20 and args.api_key == "k"
    assert serve_cmd._kv_memory("0.5") == 0.5
    assert serve_cmd.main(["--help"]) == 0
    assert serve_cmd.main(["m", "--scheduler", "nope"]) == 2


class _TemplateTokenizer:
    chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"

    def apply_chat_template(
        self, messages, chat_template=None, tokenize=False, add_generation_prompt=True
    ):
        assert not tokenize and add_generation_prompt
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def encode(self, text, add_special_tokens=True):
        assert add_special_tokens is False  # the template already holds special tokens
        return list(text.encode())


def test_chat_prompt_uses_template_or_documented_fallback():
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert render_chat_prompt(messages, _TemplateTokenizer()) == list(
        b"<system>S<user>U<assistant>"
    )
    assert render_chat_prompt(messages, object()) == "system: S\nuser: U\nassistant:"
