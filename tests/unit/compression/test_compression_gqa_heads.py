"""Head pruning on a Hugging Face Llama with grouped-query attention: pruned blocks are whole
key/value groups (other block counts refused), ``redundancy_clean`` removes the right rows and
columns, keeps the function, and updates the shared config so ``save_pretrained`` loads."""

from __future__ import annotations

import logging

import pytest
import torch

from shardspeed.compression import build_compression_hook, init_compression, redundancy_clean

transformers = pytest.importorskip("transformers")


def _llama(layers: int = 2) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def _config(num_heads: int, layer: str = r"\d+") -> dict:
    attn = rf"layers\.{layer}\.self_attn\."
    return {
        "compression_training": {
            "head_pruning": {
                "shared_parameters": {
                    "enabled": True, "schedule_offset": 0, "method": "topk",
                    "num_heads": num_heads,
                },
                "different_groups": {
                    "hp": {
                        "params": {"dense_ratio": 0.5},
                        "modules": [attn + "o_proj"],
                        "related_modules": [[attn + "q_proj", attn + "k_proj", attn + "v_proj"]],
                    }
                },
            }
        }
    }  # fmt: skip


def test_block_count_that_splits_a_kv_head_is_refused():
    # 4 query heads share 2 kv heads: 4 blocks would cut each kv head in two
    with pytest.raises(
        ValueError, match=r"num_heads=4 .*num_key_value_heads=2. Fix: set num_heads to 2"
    ):
        init_compression(_llama(), _config(4))


def test_kv_group_pruning_removes_the_group_and_updates_the_config(tmp_path):
    model = _llama()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    config = _config(2)
    init_compression(model, config)
    for i in range(2):  # keep kv group 1 (query heads 2, 3) in both layers
        o_proj = model.model.layers[i].self_attn.o_proj
        o_proj.head_pruning_scores.data = torch.tensor([[0.0, 1.0]])
    build_compression_hook(model, config).before_forward(0)  # head masks on from step 0
    x = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        masked = model(x).logits
    redundancy_clean(model, config)
    assert (model.config.num_attention_heads, model.config.num_key_value_heads) == (2, 1)
    assert model.config.head_dim == 4
    attn = model.model.layers[0].self_attn
    w = "model.layers.0.self_attn."
    # head_dim 4: query heads 2, 3 are q rows 8..15; kv head 1 is k / v rows 4..7
    torch.testing.assert_close(
        attn.q_proj.weight, before[w + "q_proj.weight"][8:16], rtol=0, atol=0
    )
    torch.testing.assert_close(attn.k_proj.weight, before[w + "k_proj.weight"][4:8], rtol=0, atol=0)
    torch.testing.assert_close(attn.v_proj.weight, before[w + "v_proj.weight"][4:8], rtol=0, atol=0)
    torch.testing.assert_close(
        attn.o_proj.weight, before[w + "o_proj.weight"][:, 8:16], rtol=0, atol=0
    )
    assert attn.num_key_value_groups == 2
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, masked, rtol=1e-5, atol=1e-6)
    model.save_pretrained(tmp_path)
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert sum(p.numel() for p in loaded.parameters()) == sum(p.numel() for p in model.parameters())
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, masked, rtol=1e-5, atol=1e-6)


def test_uneven_pruning_leaves_the_config_and_warns(caplog):
    model = _llama()
    config = _config(2, "0")  # layer 0 only
    init_compression(model, config)
    with caplog.at_level(logging.WARNING, logger="shardspeed.compression.attention_heads"):
        redundancy_clean(model, config)
    assert model.config.num_attention_heads == 4  # layer 1 still has 4 heads
    assert "cannot describe" in caplog.text
    assert model.model.layers[0].self_attn.q_proj.out_features == 8
