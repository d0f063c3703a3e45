"""``/v1/embeddings`` through the real ``openai`` client: a tiny random BERT (``cls`` and
``mean`` pooling) against HF's own forward of each input alone, base64 and float
encodings, token-id inputs, errors; decoder last-token pooling against HF's hidden states."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
import torch
from serving_helpers import MODEL_NAME, make_engine
from structured_helpers import bpe_tokenizer, tiny_llama

from shardspeed.inference.serving.embedder import Embedder

WORDS = ["hello", "world", "the", "cat", "sat", "on", "mat", "a", "b", "c"]
TEXTS = ["hello world", "the cat sat on the mat", "a", "c b a cat world hello the sat"]


@pytest.fixture(scope="module")
def bert() -> tuple[torch.nn.Module, object]:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(specials + WORDS)}, "[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
        sep_token="[SEP]",
    )  # fmt: skip
    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=64,
    )  # fmt: skip
    return BertModel(cfg).eval(), tokenizer


def _reference(model, tokenizer, text: str, mode: str) -> torch.Tensor:
    ids = torch.tensor([tokenizer.encode(text)])
    with torch.no_grad():
        hidden = model(input_ids=ids).last_hidden_state[0]  # [T, H]
    vec = hidden[0] if mode == "cls" else hidden.mean(dim=0)
    return torch.nn.functional.normalize(vec, dim=0)


@pytest.fixture(scope="module")
def client(bert) -> Iterator[openai.OpenAI]:
    from shardspeed.inference.serving.app import ServerSettings, create_app
    from shardspeed.inference.serving.async_engine import AsyncEngine
    from shardspeed.inference.serving.server import ServerThread

    model, tokenizer = bert
    embedder = Embedder(model, tokenizer, pooling="mean", max_batch_tokens=12)  # several batches
    app = create_app(AsyncEngine(make_engine()), ServerSettings(MODEL_NAME), embedder=embedder)
    thread = ServerThread(app, port=0).start()
    yield openai.OpenAI(base_url=thread.base_url + "/v1", api_key="unused", max_retries=0)
    thread.stop()


def test_embeddings_equal_hf_per_input(client, bert):
    model, tokenizer = bert
    for fmt in (openai.NOT_GIVEN, "float"):  # not given: the client asks for base64, decodes
        r = client.embeddings.create(model=MODEL_NAME, input=TEXTS, encoding_format=fmt)
        assert [d.index for d in r.data] == list(range(len(TEXTS)))
        for text, d in zip(TEXTS, r.data):
            got = torch.tensor(d.embedding)
            assert got.shape == (32,)
            torch.testing.assert_close(
                got, _reference(model, tokenizer, text, "mean"), atol=1e-5, rtol=1e-5
            )
    assert r.usage.prompt_tokens == sum(len(tokenizer.encode(t)) for t in TEXTS)
    ids = tokenizer.encode(TEXTS[1])
    one = client.embeddings.create(model=MODEL_NAME, input=ids, encoding_format="float")
    torch.testing.assert_close(
        torch.tensor(one.data[0].embedding), torch.tensor(r.data[1].embedding)
    )


def test_embedding_errors_are_400(client):
    for kwargs, param in [
        ({"input": ["ok", ""]}, "input"),
        ({"input": "hello", "dimensions": 8}, "dimensions"),
        ({"input": [[5, 10_000]]}, "input"),
        ({"input": " ".join(["a"] * 100)}, "input"),  # beyond 64 positions
    ]:
        with pytest.raises(openai.BadRequestError) as info:
            client.embeddings.create(model=MODEL_NAME, **kwargs)
        assert info.value.body["param"] == param, info.value.body


def test_server_without_embedder_refuses(server):
    thread, _ = server
    c = openai.OpenAI(base_url=thread.base_url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="no embedding model"):
        c.embeddings.create(model=MODEL_NAME, input="hi")


def test_cls_and_decoder_last_token_pooling(bert):
    model, tokenizer = bert
    cls = Embedder(model, tokenizer).embed_ids([tokenizer.encode(t) for t in TEXTS])
    assert Embedder(model, tokenizer).pooling == "cls"  # auto: an encoder
    for text, vec in zip(TEXTS, cls):
        torch.testing.assert_close(
            vec, _reference(model, tokenizer, text, "cls"), atol=1e-5, rtol=1e-5
        )
    tok = bpe_tokenizer()
    llama = tiny_llama(len(tok))
    embedder = Embedder(llama, tok)
    assert embedder.pooling == "last"  # auto: a decoder
    seqs = [tok.encode(t) for t in ['{"name": 1}', "age city", '{"ok": true, "tags": []}']]
    got = embedder.embed_ids(seqs)  # one right-padded batch
    for seq, vec in zip(seqs, got):
        with torch.no_grad():
            hidden = llama(torch.tensor([seq]), output_hidden_states=True).hidden_states[-1]
        want = torch.nn.functional.normalize(hidden[0, -1], dim=0)
        torch.testing.assert_close(vec, want, atol=1e-5, rtol=1e-5)
