"""``init_inference`` at tp_size 1 against DeepSpeed 0.19.8's own (the behaviour oracle).

DeepSpeed runs in ``.venv-peers`` (a subprocess) on the same saved weights; its logits and
greedy tokens must equal ShardSpeed's. Only tp_size 1 and no kernel injection: DeepSpeed's
tp_size 2 crashes on CPU/gloo and its kernels need CUDA. DeepSpeed's logits and tokens are
recorded in ``tests/goldens/init_inference/`` (the golden variant, run everywhere); the
live variant runs where the peers venv has DeepSpeed and is slow (importing DeepSpeed takes
tens of seconds on the shared CI box). See ``tests/goldens/README.md``.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from goldens import deepspeed_oracle as golden

import shardspeed

tf = pytest.importorskip("transformers")

# the live variant imports DeepSpeed: slow
SOURCES = [pytest.param(s, marks=pytest.mark.slow) if s != "golden" else s
           for s in golden.ORACLE_SOURCES]  # fmt: skip

_DEEPSPEED_SIDE = """
import sys, torch, transformers, deepspeed
model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()
ids = torch.load(sys.argv[2])
engine = deepspeed.init_inference(model, dtype=torch.float32, tensor_parallel={"tp_size": 1})
with torch.no_grad():
    logits = engine(ids).logits
tokens = engine.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
torch.save({"logits": logits, "tokens": tokens}, sys.argv[3])
"""


def _deepspeed_live(model: torch.nn.Module, ids: torch.Tensor, tmp_path: Path) -> dict:
    model.save_pretrained(tmp_path / "model")
    torch.save(ids, tmp_path / "ids.pt")
    subprocess.run(
        [golden.live_python(), "-c", _DEEPSPEED_SIDE, str(tmp_path / "model"),
         str(tmp_path / "ids.pt"), str(tmp_path / "out.pt")],
        check=True, capture_output=True, timeout=600,
    )  # fmt: skip
    return torch.load(tmp_path / "out.pt")


@pytest.mark.parametrize("source", SOURCES)
def test_matches_deepspeed_init_inference(source: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            pad_token_id=0, eos_token_id=1)  # fmt: skip
    model = tf.LlamaForCausalLM(config).eval()
    ids = torch.randint(2, 64, (2, 6), generator=torch.Generator().manual_seed(3))
    inputs = golden.fingerprint({**model.state_dict(), "ids": ids})

    def live() -> dict:
        return {"inputs": inputs, **_deepspeed_live(model, ids, tmp_path)}

    want = golden.deepspeed_side(source, "init_inference", "llama_tp1.pt", live)
    golden.check_inputs(want, inputs, "init_inference llama")
    engine = shardspeed.init_inference(model, dtype=torch.float32, keep_module_on_host=True)
    with torch.no_grad():
        torch.testing.assert_close(engine(ids).logits, want["logits"], atol=1e-6, rtol=0)
    tokens = engine.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(tokens, want["tokens"])
