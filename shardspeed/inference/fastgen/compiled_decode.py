"""A compiled, static-shape decode step for decode-only batches.

Decode-only batches (every sequence computes exactly one new token and needs its
logits) run through one whole-model function (:func:`decode_forward`), padded
to a *batch bucket* (1, 2, 4, 8, ... up to ``max_ragged_sequence_count``) for
CUDA graphs:

* inputs per bucket: ``input_ids`` / ``positions`` / ``slot_mapping`` /
  ``context_lens`` ``[B]`` and ``block_table`` ``[B, MB]``;
* attention gathers each sequence's KV blocks into a padded
  ``[B, H_kv, MB * block_size, D]`` view and masks keys at or past its
  context length (and outside its sliding window);
* padding rows repeat row 0 (same token, position, slot and blocks): they
  compute and write the very same K/V values into row 0's slot, so padding
  never touches another sequence's cache and needs no reserved block.

Two backends:

* ``"compile"`` (CPU, and CUDA when graphs are off): ``torch.compile`` of the
  step: one graph for batch 1 and one whose batch size is a dynamic dimension
  for batches >= 2; the block-table width (padded to >= 2) is dynamic in both
  (``torch._dynamo.mark_dynamic``), so two compilations serve every batch size
  and context length - one Inductor compile takes seconds on CPU. On CPU the
  linears read ``[in, out]`` copies of their weights (:func:`transposed_weights`;
  MKL's small-batch GEMM is much faster on that layout).
* ``"cuda_graph"`` (CUDA): one CUDA graph per batch bucket, captured on static
  buffers whose block table is ``max_seq_len / block_size`` wide; a step copies
  its inputs into the bucket's buffers and replays. (Written for CUDA; the test
  suite runs on CPU only.)

Prefill chunks and mixed batches fall back to the eager ragged forward.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from shardspeed.inference.fastgen.attention import _sdpa
from shardspeed.inference.fastgen.models.rope import apply_rope
from shardspeed.utils.logging import get_logger

if TYPE_CHECKING:
    from shardspeed.inference.fastgen.kv_cache import KVCache
    from shardspeed.inference.fastgen.models.decoder import DecoderModel
    from shardspeed.inference.fastgen.scheduler import ScheduledBatch

logger = get_logger(__name__)

COMPILED_DECODE_MODES = ("compile", "cuda_graph")


def batch_buckets(max_batch: int) -> list[int]:
    """Powers of two up to ``max_batch``, plus ``max_batch`` itself: ``[1, 2, 4, ..., max]``."""
    if max_batch < 1:
        raise ValueError(f"max_batch={max_batch} must be >= 1.")
    buckets, b = [], 1
    while b < max_batch:
        buckets.append(b)
        b *= 2
    buckets.append(max_batch)
    return buckets


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot take the compiled decode path (None when it can)."""
    from shardspeed.inference.fastgen.models.decoder import DecoderModel, GatedMLP

    if not isinstance(model, DecoderModel):
        return f"{type(model).__name__} is not a DecoderModel (Llama-like family)"
    if model.rotary.length_dependent:
        return f"rope_type={model.spec.rope.rope_type!r} depends on the sequence length"
    if any(not isinstance(layer.mlp, GatedMLP) for layer in model.layers):
        return "sparse MoE layers route tokens data-dependently"
    linears = [model.lm_head]
    for layer in model.layers:
        linears += [layer.qkv_proj, layer.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
    odd = [type(m).__name__ for m in linears if type(m) is not torch.nn.Linear]
    if odd:
        return f"its linear layers are {odd[0]} (e.g. quantized), not plain nn.Linear"
    return None


def decode_forward(
    model: DecoderModel,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    k_cache: list[torch.Tensor],
    v_cache: list[torch.Tensor],
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    weights_t: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """Logits ``[B, vocab]`` of one decode token per row; writes each row's K/V to its slot.

    ``input_ids``, ``positions``, ``slot_mapping``, ``context_lens``: ``[B]`` long;
    ``block_table``: ``[B, MB]`` long; ``rope``: precomputed ``(cos, sin)`` ``[B, rot_dim]``
    (the CUDA-graph path computes them outside the graph); ``weights_t``: the
    ``[in, out]`` contiguous copies from :func:`transposed_weights` (None: the
    modules' own ``[out, in]`` weights). The math is the eager decoder's
    (:class:`~shardspeed.inference.fastgen.models.decoder.DecoderLayer`) with the
    decode attention of :mod:`~shardspeed.inference.fastgen.attention`.
    """
    s = model.spec
    b = input_ids.shape[0]
    x = model.embed_tokens(input_ids)  # [B, hidden]
    if s.embed_scale is not None:
        x = x * torch.tensor(s.embed_scale, dtype=x.dtype)
    cos, sin = rope if rope is not None else model.rotary(positions, x.dtype)  # [B, rot_dim]

    n_kv, d = model.num_kv_heads, model.head_dim
    groups = model.num_heads // n_kv
    num_blocks_per_seq = block_table.shape[1]
    block_size = k_cache[0].shape[1]
    length = num_blocks_per_seq * block_size
    keys = torch.arange(length, device=input_ids.device).unsqueeze(0)  # [1, L]
    lens = context_lens.unsqueeze(1)  # [B, 1]
    full_mask = (keys < lens)[:, None, None, :]  # [B, 1, 1, L]
    window_masks: dict[int, torch.Tensor] = {}

    def linear(mod: torch.nn.Linear, h: torch.Tensor, index: int) -> torch.Tensor:
        if weights_t is None:
            return mod(h)
        out = h @ weights_t[index]  # [B, out]
        return out if mod.bias is None else out + mod.bias

    for i, layer in enumerate(model.layers):
        h = layer.input_layernorm(x)
        q, k, v = linear(layer.qkv_proj, h, 4 * i).split(layer.split, dim=-1)
        q = q.view(b, model.num_heads, d)  # [B, H, D]
        k = k.view(b, n_kv, d)  # [B, H_kv, D]
        v = v.view(b, n_kv, d)  # [B, H_kv, D]
        if layer.q_norm is not None:
            q, k = layer.q_norm(q), layer.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        kc, vc = k_cache[i], v_cache[i]  # [num_blocks, BS, H_kv, D]
        # index_put_ (not index_copy_): inductor updates the cache in place
        kc.view(-1, n_kv, d)[slot_mapping] = k.to(kc.dtype)
        vc.view(-1, n_kv, d)[slot_mapping] = v.to(vc.dtype)
        kd = kc[block_table].view(b, length, n_kv, d).transpose(1, 2)  # [B, H_kv, L, D]
        vd = vc[block_table].view(b, length, n_kv, d).transpose(1, 2)  # [B, H_kv, L, D]
        qd = q.view(b, n_kv, groups, d)  # [B, H_kv, H / H_kv, D]
        mask = full_mask
        if layer.window is not None:
            if layer.window not in window_masks:
                inside = keys >= lens - layer.window  # [B, L]
                window_masks[layer.window] = full_mask & inside[:, None, None, :]
            mask = window_masks[layer.window]
        o = _sdpa(qd, kd.to(q.dtype), vd.to(q.dtype), mask, False, layer.scale, layer.softcap)
        a = linear(layer.o_proj, o.reshape(b, -1), 4 * i + 1)  # [B, hidden]
        mlp = layer.mlp
        if layer.sandwich:
            x = x + layer.post_attention_layernorm(a)
            h = layer.pre_feedforward_layernorm(x)
        else:
            x = x + a
            h = layer.post_attention_layernorm(x)
        gate, up = linear(mlp.gate_up_proj, h, 4 * i + 2).chunk(2, dim=-1)  # [B, inter] each
        h = linear(mlp.down_proj, mlp.act(gate) * up, 4 * i + 3)  # [B, hidden]
        x = x + (layer.post_feedforward_layernorm(h) if layer.sandwich else h)
    logits = linear(model.lm_head, model.norm(x), 4 * len(model.layers))  # [B, vocab]
    if s.final_softcap is not None:
        logits = torch.tanh(logits / s.final_softcap) * s.final_softcap
    return logits


def transposed_weights(model: DecoderModel) -> list[torch.Tensor]:
    """``[in, out]`` contiguous copies of every linear weight, in :func:`decode_forward` order.

    On CPU, MKL's small-batch GEMM reads an ``[in, out]`` matrix much faster than
    ``nn.Linear``'s ``[out, in]`` one (measured on AMD EPYC, 32000 x 512, fp32:
    1 row 7.0 -> 4.4 ms, 2 rows 16.8 -> 6.5 ms). Costs one extra copy of the weights.
    """
    out: list[torch.Tensor] = []
    for layer in model.layers:
        for mod in (layer.qkv_proj, layer.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            out.append(mod.weight.detach().t().contiguous())  # [in, out]
    out.append(model.lm_head.weight.detach().t().contiguous())  # [hidden, vocab]
    return out


class CompiledDecoder:
    """Runs decode-only batches through a compiled (or CUDA-graphed) static-shape step.

    ``first_call_seconds`` maps each batch bucket (CUDA graphs; key 0 for the
    single dynamic-shape compile) to the latency of its first call (compile or
    capture included), for reporting. ``compile_backend`` is ``torch.compile``'s
    backend (``"inductor"``; ``"eager"`` checks the tracing without code generation).
    """

    def __init__(
        self,
        model: DecoderModel,
        kv_cache: KVCache,
        device: torch.device,
        max_batch: int,
        max_seq_len: int,
        mode: str = "compile",
        compile_backend: str = "inductor",
    ):
        if mode not in COMPILED_DECODE_MODES:
            raise ValueError(
                f"compiled decode mode={mode!r} is not supported; choose one of "
                f"{COMPILED_DECODE_MODES}."
            )
        if mode == "cuda_graph" and device.type != "cuda":
            raise ValueError(
                f"compiled decode mode='cuda_graph' needs a CUDA device, got {device}."
            )
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"compiled decode cannot run this model: {reason}.")
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.mode = mode
        self.compile_backend = compile_backend  # "eager" traces without Inductor (tests)
        self.block_size = kv_cache.spec.block_size
        self.buckets = batch_buckets(max_batch)
        self.max_blocks = -(-max_seq_len // self.block_size)
        self.first_call_seconds: dict[int, float] = {}
        # CPU: [in, out] weight copies (faster small-batch GEMMs); CUDA keeps nn.Linear's.
        self.weights_t = transposed_weights(model) if device.type == "cpu" else None
        self._compiled: Callable[..., torch.Tensor] | None = None
        self._graphs: dict[int, _GraphRunner] = {}

    # ------------------------------------------------------------------ routing
    def accepts(self, batch: ScheduledBatch) -> bool:
        """True for a decode-only batch that fits the largest bucket."""
        seqs = batch.sequences
        return (
            0 < len(seqs) <= self.buckets[-1]
            and all(s.num_tokens == 1 and s.needs_logits and not s.all_logits for s in seqs)
            and all(len(s.block_table) <= self.max_blocks for s in seqs)
        )

    def bucket_for(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    # ------------------------------------------------------------------ running
    def run(self, batch: ScheduledBatch) -> torch.Tensor:
        """Logits ``[S, vocab]`` (in batch order) of a batch :meth:`accepts` took."""
        seqs = batch.sequences
        n = len(seqs)
        # CUDA graphs: one static batch bucket per graph. torch.compile: one graph for
        # batch 1 and one with a dynamic batch dimension for every size >= 2.
        bucket = self.bucket_for(n) if self.mode == "cuda_graph" else n
        rows = list(range(n)) + [0] * (bucket - n)  # padding repeats row 0
        width = max(-(-s.context_len // self.block_size) for s in seqs)
        if self.mode == "cuda_graph":
            width = self.max_blocks
        else:
            width = max(2, width)  # >= 2 keeps the dynamic dimension unspecialised
        table = torch.zeros(bucket, width, dtype=torch.long)  # [B, MB]
        for j, i in enumerate(rows):
            blocks = seqs[i].block_table[:width]
            table[j, : len(blocks)] = torch.tensor(blocks, dtype=torch.long)
        inputs = (
            torch.tensor([seqs[i].token_ids[0] for i in rows], dtype=torch.long),
            torch.tensor([seqs[i].start_position for i in rows], dtype=torch.long),
            torch.tensor([seqs[i].slot_mapping[0] for i in rows], dtype=torch.long),
            table,
            torch.tensor([seqs[i].context_len for i in rows], dtype=torch.long),
        )
        key = bucket if self.mode == "cuda_graph" or bucket == 1 else 0
        first = key not in self.first_call_seconds
        t0 = time.perf_counter()
        if self.mode == "cuda_graph":
            logits = self._run_graph(bucket, inputs)
        else:
            logits = self._run_compiled(inputs)
        if first:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            took = time.perf_counter() - t0
            self.first_call_seconds[key] = took
            logger.info(
                "compiled decode (%s): first call of batch %s took %.2f s (compile/capture)",
                self.mode, bucket if key else "2+", took,
            )  # fmt: skip
        return logits[:n]

    def _run_compiled(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        if self._compiled is None:
            self._compiled = torch.compile(
                decode_forward, fullgraph=True, dynamic=False, backend=self.compile_backend
            )
        ids, pos, slots, table, lens = (t.to(self.device, non_blocking=True) for t in inputs)
        if ids.shape[0] > 1:  # batch 1 gets its own static graph (no padding row)
            limit = self.buckets[-1] + 1  # max must exceed min for a dynamic dimension
            for t in (ids, pos, slots, table, lens):
                torch._dynamo.mark_dynamic(t, 0, min=2, max=max(3, limit))
        torch._dynamo.mark_dynamic(table, 1, min=2, max=max(3, self.max_blocks))
        kv = self.kv_cache
        return self._compiled(
            self.model, ids, pos, slots, table, lens, kv.k, kv.v, None, self.weights_t
        )

    def _run_graph(
        self, bucket: int, inputs: tuple[torch.Tensor, ...]
    ) -> torch.Tensor:  # pragma: no cover - needs CUDA
        runner = self._graphs.get(bucket)
        if runner is None:
            runner = _GraphRunner(self, bucket)
            self._graphs[bucket] = runner
        return runner.replay(inputs)


class _GraphRunner:  # pragma: no cover - needs CUDA
    """One CUDA graph of :func:`decode_forward` on static buffers of one batch bucket."""

    def __init__(self, owner: CompiledDecoder, bucket: int):
        dev = owner.device
        self.ids = torch.zeros(bucket, dtype=torch.long, device=dev)
        self.pos = torch.zeros(bucket, dtype=torch.long, device=dev)
        self.slots = torch.zeros(bucket, dtype=torch.long, device=dev)
        self.table = torch.zeros(bucket, owner.max_blocks, dtype=torch.long, device=dev)
        self.lens = torch.ones(bucket, dtype=torch.long, device=dev)
        dtype = owner.model.embed_tokens.weight.dtype
        self.rotary = owner.model.rotary
        cos, sin = self.rotary(self.pos, dtype)  # [bucket, rot_dim]; rope stays outside
        self.cos, self.sin = cos.clone(), sin.clone()
        # Capture writes K/V to slot 0 of block 0 for every row; save and restore it.
        kv = owner.kv_cache
        saved = [(k[0].clone(), v[0].clone()) for k, v in zip(kv.k, kv.v)]

        def step() -> torch.Tensor:
            return decode_forward(
                owner.model, self.ids, self.pos, self.slots, self.table, self.lens,
                kv.k, kv.v, (self.cos, self.sin),
            )  # fmt: skip

        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up kernels / workspaces outside the capture
                step()
        torch.cuda.current_stream(dev).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = step()  # [bucket, vocab], a static output buffer
        for (k0, v0), k, v in zip(saved, kv.k, kv.v):
            k[0].copy_(k0)
            v[0].copy_(v0)

    def replay(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        ids, pos, slots, table, lens = inputs
        self.ids.copy_(ids, non_blocking=True)
        self.pos.copy_(pos, non_blocking=True)
        self.slots.copy_(slots, non_blocking=True)
        self.table.copy_(table, non_blocking=True)
        self.lens.copy_(lens, non_blocking=True)
        cos, sin = self.rotary(self.pos, self.cos.dtype)  # [bucket, rot_dim]
        self.cos.copy_(cos)
        self.sin.copy_(sin)
        self.graph.replay()
        return self.logits.clone()
