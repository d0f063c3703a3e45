"""OpenAI features through the real ``openai`` client: ``n``, ``best_of``, ``logprobs`` /
``top_logprobs`` (completions and chat), ``echo``, penalties, ``logit_bias``,
``min_tokens`` and the context limit (400).

The server runs a tiny random Llama (vocabulary 256) with the byte tokenizer, so that
token ids and text map one to one; references are HF's forward / ``generate`` on the
same model.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest
import torch
from serving_helpers import MODEL_NAME, start_server

from shardspeed.inference.fastgen.engine import InferenceEngine
from shardspeed.models.tokenizer import ByteTokenizer

EOS = 2
TOL = 1e-4


@pytest.fixture(scope="module")
def llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    return LlamaForCausalLM(cfg).float().eval()


@pytest.fixture(scope="module")
def client(llama) -> Iterator[openai.OpenAI]:
    engine = InferenceEngine.from_pretrained(
        llama, tokenizer=ByteTokenizer(), device="cpu", block_size=4
    )
    thread, _ = start_server(engine, max_tokens_limit=512)
    yield openai.OpenAI(base_url=thread.base_url + "/v1", api_key="unused", max_retries=0)
    thread.stop()


def _log_probs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)  # [T, V]


def _ids(text: str) -> list[int]:
    return ByteTokenizer().encode(text)


def test_n_samples(client):
    r = client.completions.create(
        model=MODEL_NAME, prompt="Sample me", max_tokens=6, n=3, temperature=1.0, seed=5
    )
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.text for c in r.choices}) > 1
    assert r.usage.prompt_tokens == len(_ids("Sample me"))  # counted once, not per sample
    assert r.usage.completion_tokens == 18
    best = client.completions.create(
        model=MODEL_NAME, prompt="Sample me", max_tokens=4, n=2, best_of=4, temperature=1.0
    )
    assert [c.index for c in best.choices] == [0, 1]


def test_n_samples_stream_like_non_stream(client):
    body = dict(model=MODEL_NAME, prompt="Stream", max_tokens=5, n=2, temperature=1.0, seed=9)
    want = [c.text for c in client.completions.create(**body).choices]
    got = ["", ""]
    for chunk in client.completions.create(**body, stream=True):
        for c in chunk.choices:
            got[c.index] += c.text
    assert got == want


def test_completion_logprobs_with_echo_equal_hf(client, llama):
    prompt = "Logprobs, please"
    r = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=6, temperature=0, logprobs=3, echo=True
    )
    choice = r.choices[0]
    lp = choice.logprobs
    p = _ids(prompt)
    with torch.no_grad():  # greedy reference tokens
        out_ids = llama.generate(
            torch.tensor([p]), do_sample=False, max_new_tokens=6, pad_token_id=0
        )[0, len(p) :].tolist()
    tokens = p + out_ids
    assert lp.tokens == [ByteTokenizer().decode([t]) for t in tokens]
    assert choice.text == prompt + ByteTokenizer().decode(out_ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = _log_probs(llama, tokens)
    for pos in range(1, len(tokens)):
        assert abs(lp.token_logprobs[pos] - ref[pos - 1, tokens[pos]].item()) < TOL
    for i in range(len(p), len(tokens)):  # the sampled tokens carry their top 3
        top = lp.top_logprobs[i]  # keyed by token text (distinct bytes may share U+FFFD)
        ref_top = ref[i - 1].topk(3)
        assert 1 <= len(top) <= 4  # the top 3 and the sampled token
        keys = [ByteTokenizer().decode([t]) for t in ref_top.indices.tolist()]
        for key, val in zip(keys, ref_top.values.tolist()):
            if keys.count(key) == 1:  # the first of equal keys is kept
                assert abs(top[key] - val) < TOL
        assert abs(max(top.values()) - ref_top.values[0].item()) < TOL


def test_chat_logprobs_equal_hf(client, llama):
    messages = [{"role": "user", "content": "Hi!"}]
    r = client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = r.choices[0].logprobs.content
    prompt_ids = _ids("user: Hi!\nassistant:")  # the fallback template (no chat template)
    assert r.usage.prompt_tokens == len(prompt_ids) and len(content) == 5
    ids = prompt_ids + [e.bytes[0] if e.bytes else 0 for e in content]
    ref = _log_probs(llama, ids)
    for i, entry in enumerate(content):
        row = ref[len(prompt_ids) - 1 + i]
        token = ids[len(prompt_ids) + i]
        assert abs(entry.logprob - row[token].item()) < TOL
        assert len(entry.top_logprobs) == 2
        assert abs(entry.top_logprobs[0].logprob - row.max().item()) < TOL


def test_repetition_penalty_token_identical_to_hf(client, llama):
    prompt = "aaaa abab"
    r = client.completions.create(
        model=MODEL_NAME,
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        logprobs=0,
        extra_body={"repetition_penalty": 1.6, "ignore_eos": True},
    )
    with torch.no_grad():
        ref = llama.generate(
            torch.tensor([_ids(prompt)]),
            do_sample=False,
            max_new_tokens=12,
            repetition_penalty=1.6,
            pad_token_id=0,
            eos_token_id=None,
        )[0, len(prompt) :].tolist()
    assert r.choices[0].text == ByteTokenizer().decode(ref)


def test_presence_and_frequency_penalties_match_hand_computation(client, llama):
    prompt = "penalties"
    r = client.completions.create(
        model=MODEL_NAME,
        prompt=prompt,
        max_tokens=10,
        temperature=0,
        presence_penalty=1.5,
        frequency_penalty=0.8,
        extra_body={"ignore_eos": True},
    )
    ids, out = _ids(prompt), []
    with torch.no_grad():
        for _ in range(10):
            logits = llama(torch.tensor([ids + out])).logits[0, -1].float().clone()
            for tok in set(out):  # OpenAI: mu[j] - c[j] * a_freq - (c[j] > 0) * a_pres
                logits[tok] -= out.count(tok) * 0.8 + 1.5
            out.append(int(logits.argmax()))
    assert r.choices[0].text == ByteTokenizer().decode(out)


def test_logit_bias_and_min_tokens(client):
    r = client.completions.create(
        model=MODEL_NAME, prompt="stop now", max_tokens=10, temperature=0, logit_bias={"2": 100}
    )
    assert r.usage.completion_tokens == 1 and r.choices[0].finish_reason == "stop"
    r = client.completions.create(
        model=MODEL_NAME,
        prompt="stop now",
        max_tokens=10,
        temperature=0,
        logit_bias={str(EOS): 100},
        extra_body={"min_tokens": 4},
    )
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "stop"


def test_max_tokens_beyond_the_context_is_400(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt="x" * 100, max_tokens=40)
    message = str(info.value)
    assert "maximum context length is 128 tokens" in message and "140 tokens" in message
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "y" * 100}], max_tokens=40
        )
    # Without max_tokens, chat runs up to the context instead of failing.
    r = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "y" * 100}],
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].finish_reason == "length" and r.usage.total_tokens == 128
    with pytest.raises(openai.BadRequestError, match="not supported with stream"):
        client.completions.create(
            model=MODEL_NAME, prompt="x", max_tokens=2, logprobs=1, stream=True
        )
