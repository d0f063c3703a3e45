"""BERT masked-language-model pretraining with the DeepSpeed API (Hugging Face ``BertForMaskedLM``).

    shardspeed --nproc 2 examples/deepspeed_tutorials/bert_mlm.py --deepspeed \
        --deepspeed_config examples/deepspeed_tutorials/ds_config_bert.json --steps 50

Follows DeepSpeed's BERT pretraining tutorial usage: ``deepspeed.add_config_arguments``,
decay / no-decay parameter groups handed to ``deepspeed.initialize(args=...)``, the
engine's ``backward``/``step``, ``save_checkpoint`` with ``client_state`` and
``load_checkpoint`` to resume. BERT's masking rule: 15% of the tokens are predicted, of
those 80% become ``[MASK]``, 10% a random token, 10% stay. Departure from the tutorial: no
download, so the model is a small random-initialised BERT and the corpus a synthetic
token stream with learnable structure (sentences made of recurring phrases).
"""

from __future__ import annotations

import argparse
import json
import os

import torch

try:
    import deepspeed
except ImportError:  # no DeepSpeed (or compat distribution) installed: the drop-in
    import shardspeed as deepspeed

VOCAB, MASK_ID, PAD_ID, CLS_ID, SEP_ID, FIRST_WORD = 512, 4, 0, 2, 3, 5


def get_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="BERT MLM pretraining")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the launcher")
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--output-dir", default=None, help="save a checkpoint here at the end")
    parser.add_argument("--resume", action="store_true", help="load the latest checkpoint first")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--dump-losses", default=None, help="write rank 0's losses here (JSON)")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def make_model(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        intermediate_size=4 * args.hidden,
        max_position_embeddings=args.seq_len,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        pad_token_id=PAD_ID,
    )
    torch.manual_seed(args.seed)
    return BertForMaskedLM(config)


class PhraseCorpus(torch.utils.data.Dataset):
    """Sequences ``[CLS] phrase phrase ... [SEP]`` drawn from 64 fixed 4-token phrases."""

    def __init__(self, num_samples: int, seq_len: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        phrases = torch.randint(FIRST_WORD, VOCAB, (64, 4), generator=g)  # (64, 4)
        picks = torch.randint(0, 64, (num_samples, (seq_len - 2) // 4), generator=g)
        body = phrases[picks].flatten(1)  # (N, 4 * ((L - 2) // 4))
        ids = torch.full((num_samples, seq_len), PAD_ID)
        ids[:, 0], ids[:, 1 : 1 + body.size(1)], ids[:, 1 + body.size(1)] = CLS_ID, body, SEP_ID
        self.ids = ids  # (N, L)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.ids[i]


def mask_tokens(ids: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT's rule: (inputs, labels); labels are -100 where nothing is predicted."""
    special = (ids == PAD_ID) | (ids == CLS_ID) | (ids == SEP_ID)
    chosen = (torch.rand(ids.shape, generator=g) < 0.15) & ~special
    labels = torch.where(chosen, ids, torch.full_like(ids, -100))
    roll = torch.rand(ids.shape, generator=g)
    inputs = ids.clone()
    inputs[chosen & (roll < 0.8)] = MASK_ID
    random_tokens = torch.randint(FIRST_WORD, VOCAB, ids.shape, generator=g)
    swap = chosen & (roll >= 0.8) & (roll < 0.9)
    inputs[swap] = random_tokens[swap]
    return inputs, labels


def grouped_parameters(model: torch.nn.Module, weight_decay: float = 0.01) -> list[dict]:
    """No weight decay on biases and LayerNorm weights (BERT's usual grouping)."""
    no_decay = ("bias", "LayerNorm.weight")
    named = list(model.named_parameters())
    return [
        {"params": [p for n, p in named if not any(k in n for k in no_decay)],
         "weight_decay": weight_decay},
        {"params": [p for n, p in named if any(k in n for k in no_decay)], "weight_decay": 0.0},
    ]  # fmt: skip


def main() -> None:
    args = get_args()
    deepspeed.init_distributed()
    model = make_model(args)
    engine, _, loader, _ = deepspeed.initialize(
        args=args,
        model=model,
        model_parameters=grouped_parameters(model),
        training_data=PhraseCorpus(4096, args.seq_len),
    )
    start = 0
    if args.resume and args.output_dir and os.path.isdir(args.output_dir):
        _, client_state = engine.load_checkpoint(args.output_dir)
        start = (client_state or {}).get("step", 0)
    g = torch.Generator().manual_seed(args.seed + 1000 * engine.global_rank + start)
    batches = iter(deepspeed.utils.RepeatingLoader(loader))
    device = deepspeed.accelerator.get_accelerator().device_name(engine.local_rank)
    losses: list[float] = []
    step = start
    while step < args.steps:
        inputs, labels = mask_tokens(next(batches), g)
        out = engine(input_ids=inputs.to(device), labels=labels.to(device))
        engine.backward(out.loss)
        engine.step()
        losses.append(out.loss.item())
        step = engine.global_steps  # counts optimizer steps (micro-steps / GAS)
    if args.output_dir:
        engine.save_checkpoint(args.output_dir, client_state={"step": step})
    if engine.global_rank == 0:
        print(f"MLM loss: first {losses[0]:.3f} -> last {losses[-1]:.3f} after {step} steps")
        if args.dump_losses:
            with open(args.dump_losses, "w") as f:
                json.dump(losses, f)


if __name__ == "__main__":
    main()
