"""Speculative decoding through the OpenAI server and the ``openai`` client: greedy
completions (plain, streamed, with logprobs and a stop string) equal the engine without
speculation; sampled chat completions run."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
import torch
from serving_helpers import MODEL_NAME, make_engine, start_server

from shardspeed.inference.fastgen.sampling_params import SamplingParams
from shardspeed.models.gpt import GPT, GPTConfig

PROMPT = "the cat sat on the mat. the cat sat on the"


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[openai.OpenAI, object]]:
    torch.manual_seed(0)
    draft = GPT(GPTConfig(n_layer=2, n_embd=64, n_head=4, block_size=256))  # the target's twin
    engine = make_engine(speculative_config={"model": draft, "num_speculative_tokens": 4})
    thread, _ = start_server(engine, max_tokens_limit=256)
    client = openai.OpenAI(base_url=thread.base_url + "/v1", api_key="unused", max_retries=0)
    yield client, engine
    thread.stop()


def _reference(max_tokens: int, **kwargs) -> tuple[str, list[int]]:
    params = SamplingParams(max_new_tokens=max_tokens, **kwargs)
    out = make_engine().generate([PROMPT], params)[0]
    return out.text, out.output_token_ids


def test_greedy_completion_streamed_and_logprobs_equal_no_speculation(served):
    client, engine = served
    text, _ = _reference(40)
    got = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=40, temperature=0)
    assert got.choices[0].text == text
    stream = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=40, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == text
    with_lp = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=2
    )
    assert len(with_lp.choices[0].logprobs.token_logprobs) == 12
    assert engine.speculator.stats.num_accepted_tokens > 0


def test_stop_string_and_sampled_chat(served):
    client, _ = served
    full, _ = _reference(40)
    stop = full[10:13]
    want, _ = _reference(40, stop=[stop])
    got = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=40, temperature=0, stop=[stop]
    )
    assert got.choices[0].text == want and got.choices[0].finish_reason == "stop"
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=16,
        temperature=0.9,
        seed=3,
    )
    assert chat.choices[0].finish_reason in ("stop", "length")


def test_cli_speculative_config_flag_takes_a_json_object(capsys):
    from shardspeed.launcher.serve_cmd import build_parser

    flag = '{"method": "ngram", "num_speculative_tokens": 3}'
    args = build_parser().parse_args(["model-dir", "--speculative-config", flag])
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 3}
    for bad in ("[1, 2]", "{method: ngram}"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["model-dir", "--speculative-config", bad])
    assert "expected a JSON object" in capsys.readouterr().err
