"""pipeline(): batch generation, streaming, timings, argument errors (real engine)."""

from __future__ import annotations

import pytest

from shardspeed.inference.serving.pipeline import Pipeline


def test_batch_of_prompts(pipe: Pipeline):
    prompts = ["The quick brown fox", "Hi", "A third, different prompt"]
    out = pipe(prompts, max_new_tokens=7)
    assert [r.prompt for r in out] == prompts
    for prompt, r in zip(prompts, out):
        assert str(r) == r.generated_text
        assert r.generated_length == len(r.token_ids) == 7
        assert r.prompt_length == len(prompt.encode())
        assert r.finish_reason == "length"
        assert 0 <= r.ttft <= r.latency and r.tpot >= 0
    # Batching does not change greedy results.
    assert [pipe(p, max_new_tokens=7)[0].generated_text for p in prompts] == [
        r.generated_text for r in out
    ]


def test_token_id_prompts_equal_text_prompts(pipe: Pipeline):
    by_text = pipe("tokens", max_new_tokens=5)[0]
    by_ids = pipe([list(b"tokens")], max_new_tokens=5)[0]
    assert by_ids.prompt is None and by_ids.token_ids == by_text.token_ids


@pytest.mark.parametrize("kwargs", [{}, {"temperature": 0.8, "top_k": 20, "seed": 7}])
def test_stream_equals_non_stream(pipe: Pipeline, kwargs):
    for prompt in ("Once upon a time", "x"):
        full = pipe(prompt, max_new_tokens=20, **kwargs)[0].generated_text
        pieces = list(pipe.stream(prompt, max_new_tokens=20, **kwargs))
        assert "".join(pieces) == full
        assert len(pieces) > 1


def test_stream_with_stop_string(pipe: Pipeline):
    full = pipe("stop here", max_new_tokens=20)[0].generated_text
    stop = full[4:6]
    expected = full[: full.find(stop)]
    r = pipe("stop here", max_new_tokens=20, stop=stop)[0]
    assert r.generated_text == expected and r.finish_reason == "stop"
    assert "".join(pipe.stream("stop here", max_new_tokens=20, stop=[stop])) == expected


def test_closing_a_stream_early_aborts_the_request(pipe: Pipeline):
    gen = pipe.stream("abandon me", max_new_tokens=50, ignore_eos=True)
    next(gen)
    gen.close()
    stats = pipe.engine.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_blocks_used == 0


def test_bad_arguments_name_the_field(pipe: Pipeline):
    with pytest.raises(ValueError, match="max_new_tokens"):
        pipe("x", max_new_tokens=-1)
    with pytest.raises(ValueError, match="top_p"):
        pipe("x", top_p=0.0)
    with pytest.raises(ValueError, match="list of token-id lists"):
        pipe([1, 2, 3])
    with pytest.raises(ValueError, match="prompts is empty"):
        pipe([])
