"""``shardspeed.mii`` ports an MII script by changing its import; ``Pipeline`` takes MII's
keywords, ``chat()`` uses the tokenizer's chat template, and the context limit is enforced.

The model is a tiny random ShardSpeed GPT with the byte tokenizer; an MII-style call is
checked against the equivalent explicit ShardSpeed call on the same engine.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from shardspeed import mii
from shardspeed.inference.fastgen.engine import InferenceEngine
from shardspeed.inference.serving.pipeline import Pipeline
from shardspeed.models.gpt import GPT, GPTConfig
from shardspeed.models.tokenizer import ByteTokenizer


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=64))


@pytest.fixture(scope="module")
def pipe() -> Iterator[Pipeline]:
    p = mii.pipeline(_model(), tokenizer=ByteTokenizer(), device="cpu")
    yield p
    p.destroy()


def test_mii_kwargs_on_the_pipeline(pipe):
    greedy = Pipeline.__call__(pipe, "Hello", max_new_tokens=6)[0]
    r = pipe("Hello", max_new_tokens=6, do_sample=False)[0]
    assert r.generated_text == greedy.generated_text and pipe.is_rank_0
    assert (r.prompt_length, r.generated_length, r.finish_reason) == (5, 6, "length")
    full = pipe("Hello", max_length=11, do_sample=False, return_full_text=True)[0]
    assert full.generated_text == "Hello" + greedy.generated_text
    held = pipe("Hello", max_new_tokens=6, min_new_tokens=6, do_sample=False, stop="x")[0]
    assert held.generated_length == 6
    # MII's default: sample (top_p=0.9) up to the context (max_length = max_seq_len).
    default = pipe("Hello", ignore_eos=True)[0]
    assert default.prompt_length + default.generated_length == pipe.engine.max_seq_len
    with pytest.raises(ValueError, match="unknown generation keyword.*num_beams"):
        pipe("Hello", num_beams=2)
    with pytest.raises(ValueError, match="do_sample=False.*temperature"):
        pipe("Hello", do_sample=False, temperature=0.7)


def test_pipeline_context_limit_needs_truncate(pipe):
    with pytest.raises(ValueError, match="exceeds the engine's max_seq_len of 64.*truncate=True"):
        Pipeline.__call__(pipe, "x" * 40, max_new_tokens=30)
    r = Pipeline.__call__(pipe, "x" * 40, max_new_tokens=30, truncate=True, ignore_eos=True)[0]
    assert r.finish_reason == "length" and r.generated_length == 24


def test_chat_uses_the_chat_template(pipe):
    with pytest.raises(ValueError, match="needs a tokenizer with a chat template"):
        pipe.chat([{"role": "user", "content": "Hi"}])
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
    tok = _templated_tokenizer(template)
    engine = InferenceEngine.from_pretrained(_model(), tokenizer=tok, device="cpu")
    chat_pipe = Pipeline(engine)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    got = chat_pipe.chat(messages, max_new_tokens=5)
    rendered = "<system>be brief<user>hi<assistant>"
    want = chat_pipe([tok.encode(rendered, add_special_tokens=False)], max_new_tokens=5)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert len(chat_pipe.chat([messages, messages[1:]], max_new_tokens=2)) == 2


def _templated_tokenizer(template: str):
    """A character-level HF fast tokenizer with ``template`` as its chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {chr(i): i for i in range(32, 127)}
    vocab["[UNK]"] = 0
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    fast.chat_template = template
    return fast


def test_serve_client_generate_and_terminate():
    client = mii.serve(_model(), deployment_name="tiny", tokenizer=ByteTokenizer(), device="cpu")
    try:
        assert mii.client("tiny").base_url == client.base_url
        direct = Pipeline(InferenceEngine.from_pretrained(_model(), ByteTokenizer(), device="cpu"))
        want = direct(["DeepSpeed is", "Seattle is"], max_new_tokens=5)
        got = client.generate(["DeepSpeed is", "Seattle is"], max_new_tokens=5, do_sample=False)
        assert [r.generated_text for r in got] == [r.generated_text for r in want]
        assert [(r.prompt_length, r.generated_length) for r in got] == [(12, 5), (10, 5)]
        assert got[0].finish_reason == "length"
        pieces: list[str] = []
        streamed = client.generate(
            "DeepSpeed is",
            streaming_fn=lambda rs: pieces.append(rs[0].generated_text),
            max_new_tokens=5,
            do_sample=False,
        )
        assert "".join(pieces) == streamed[0].generated_text == want[0].generated_text
        full = client(["Seattle is"], max_length=15, do_sample=False, return_full_text=True)
        assert full[0].generated_text == "Seattle is" + want[1].generated_text
    finally:
        client.terminate_server()
    with pytest.raises(ValueError, match="no deployment named 'tiny'"):
        mii.client("tiny")
