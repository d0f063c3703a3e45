"""LoRA adapters through the ``openai`` client: ``model=<adapter>`` picks an adapter,
adapters load and unload while the server runs (vLLM's ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter``), unknown adapters are 404s naming them.

A tiny random Llama (vocabulary 256, byte tokenizer) serves two PEFT adapters with
random nonzero ``lora_B``; each answer must equal HF ``generate`` on the PEFT model with
that adapter merged.
"""

from __future__ import annotations

import concurrent.futures
import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from serving_helpers import MODEL_NAME, start_server

from shardspeed.inference.fastgen.config import EngineConfig
from shardspeed.inference.fastgen.engine import InferenceEngine
from shardspeed.models.tokenizer import ByteTokenizer

openai = pytest.importorskip("openai")
PROMPT = "LoRA adapters, please"
MAX_NEW = 8


def _base() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        eos_token_id=None,
    )  # fmt: skip
    return LlamaForCausalLM(cfg).float().eval()


def _adapter(base: Any, path: Path, targets: list[str], seed: int) -> list[int]:
    """Save an adapter to ``path``; returns HF's greedy tokens for PROMPT with it merged."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        copy.deepcopy(base), LoraConfig(r=4, lora_alpha=8, target_modules=targets)
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.15)
    model.save_pretrained(str(path))
    return _greedy(model.merge_and_unload())


def _greedy(model: Any) -> list[int]:
    ids = torch.tensor([ByteTokenizer().encode(PROMPT)])
    with torch.no_grad():
        out = model.generate(ids, do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=0)
    return out[0, ids.shape[1] :].tolist()


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("lora")
    root, outside = tmp / "allowed", tmp / "outside"
    base = _base()
    refs = {
        MODEL_NAME: _greedy(base),
        "sql": _adapter(base, root / "sql", ["q_proj", "v_proj"], seed=1),
        "chat": _adapter(base, root / "chat", ["q_proj", "v_proj", "down_proj"], seed=2),
        "outside": _adapter(base, outside / "x", ["q_proj"], seed=3),
    }
    cfg = EngineConfig(block_size=4, num_blocks=256, device="cpu", enable_lora=True, max_loras=2)
    engine = InferenceEngine(base, tokenizer=ByteTokenizer(), config=cfg)
    engine.lora.load("sql", str(root / "sql"))
    thread, _ = start_server(engine, lora_root=str(root))
    client = openai.OpenAI(base_url=thread.base_url + "/v1", api_key="unused", max_retries=0)
    yield dict(client=client, base=thread.base_url, root=root, outside=outside, refs=refs)
    thread.stop()


def _complete(client: Any, model: str, max_tokens: int = MAX_NEW) -> str:
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0)
    assert r.model == model
    return r.choices[0].text


def _text(ids: list[int]) -> str:
    return ByteTokenizer().decode(ids)


def _post(base: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(base + path, json=body, timeout=60)


def test_models_lists_base_and_adapters(setup):
    models = {m.id: m for m in setup["client"].models.list().data}
    assert list(models) == [MODEL_NAME, "sql"]
    assert models["sql"].model_extra["parent"] == MODEL_NAME


def test_adapters_and_base_concurrently_match_merged_peft(setup):
    client, refs = setup["client"], setup["refs"]
    r = _post(
        setup["base"],
        "/v1/load_lora_adapter",
        {"lora_name": "chat", "lora_path": str(setup["root"] / "chat")},
    )
    assert r.status_code == 200, r.text
    names = [MODEL_NAME, "sql", "chat", "sql", "chat", MODEL_NAME]
    with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
        texts = list(pool.map(lambda n: _complete(client, n), names))
    assert texts == [_text(refs[n]) for n in names]
    assert len({_text(refs[n]) for n in (MODEL_NAME, "sql", "chat")}) == 3  # adapters matter
    chat = client.chat.completions.create(
        model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert chat.model == "chat"
    assert _post(setup["base"], "/v1/unload_lora_adapter", {"lora_name": "chat"}).status_code == 200


def test_unloaded_adapter_is_a_404_and_the_server_keeps_serving(setup):
    client, base = setup["client"], setup["base"]
    body = {"lora_name": "tmp", "lora_path": str(setup["root"] / "chat")}
    assert _post(base, "/v1/load_lora_adapter", body).status_code == 200
    assert _complete(client, "tmp") == _text(setup["refs"]["chat"])
    assert _post(base, "/v1/unload_lora_adapter", {"lora_name": "tmp"}).status_code == 200
    with pytest.raises(openai.NotFoundError, match="'tmp' does not exist"):
        _complete(client, "tmp")
    unload_again = _post(base, "/v1/unload_lora_adapter", {"lora_name": "tmp"})
    assert unload_again.status_code == 404
    assert "'tmp' is not loaded" in unload_again.json()["error"]["message"]
    assert _complete(client, MODEL_NAME) == _text(setup["refs"][MODEL_NAME])
    assert _complete(client, "sql") == _text(setup["refs"]["sql"])


def test_unload_during_a_stream_lets_it_finish(setup):
    """Unloading an adapter that running requests use lets them finish with it."""
    client, base = setup["client"], setup["base"]
    body = {"lora_name": "chat", "lora_path": str(setup["root"] / "chat")}
    assert _post(base, "/v1/load_lora_adapter", body).status_code == 200
    stream = client.completions.create(
        model="chat", prompt=PROMPT, max_tokens=MAX_NEW, temperature=0, stream=True
    )
    chunks = iter(stream)
    text = next(chunks).choices[0].text
    assert _post(base, "/v1/unload_lora_adapter", {"lora_name": "chat"}).status_code == 200
    text += "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == _text(setup["refs"]["chat"])


def test_load_refusals(setup):
    base, root = setup["base"], setup["root"]
    outside = _post(
        base, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(setup["outside"] / "x")}
    )
    assert outside.status_code == 403
    assert "outside the directory" in outside.json()["error"]["message"]
    escape = _post(
        base,
        "/v1/load_lora_adapter",
        {"lora_name": "x", "lora_path": str(root / ".." / "outside" / "x")},
    )
    assert escape.status_code == 403
    missing = _post(
        base, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(root / "nope")}
    )
    assert missing.status_code == 400
    assert "not a directory" in missing.json()["error"]["message"]
    dup = _post(base, "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": str(root / "sql")})
    assert dup.status_code == 400 and "already loaded" in dup.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError, match="'nope' does not exist"):
        _complete(setup["client"], "nope")


def test_serve_cli_and_build_app_lora_options(setup, tmp_path):
    from starlette.testclient import TestClient

    from shardspeed.inference.serving.server import build_app
    from shardspeed.launcher.serve_cmd import build_parser

    args = build_parser().parse_args(
        ["m", "--enable-lora", "--lora-modules", "a=/x", "b=/y", "--allowed-lora-root", "/r"]
    )
    assert dict(args.lora_modules) == {"a": "/x", "b": "/y"} and args.enable_lora
    with pytest.raises(SystemExit):
        build_parser().parse_args(["m", "--lora-modules", "no-equals-sign"])
    plain = InferenceEngine(_base(), tokenizer=ByteTokenizer(), config=EngineConfig(num_blocks=8))
    with pytest.raises(ValueError, match="enable_lora=True"):
        build_app(plain, lora_modules={"sql": str(setup["root"] / "sql")})
    app = build_app(
        _base(), tokenizer=ByteTokenizer(), model_name="base", device="cpu", num_blocks=64,
        lora_modules={"sql": str(setup["root"] / "sql")}, lora_root=str(setup["root"]),
    )  # fmt: skip
    with TestClient(app) as http:
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["base", "sql"]
        body = {"model": "sql", "prompt": PROMPT, "max_tokens": MAX_NEW, "temperature": 0}
        assert http.post("/v1/completions", json=body).json()["choices"][0]["text"] == _text(
            setup["refs"]["sql"]
        )
