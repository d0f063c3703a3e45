"""The pipeline-parallel FastGen engine: the layers over P stages, P micro-batches in flight.

``step()`` keeps the pipeline full, then finishes the oldest micro-batch::

    while fewer than depth micro-batches are in flight:      # depth = P ("inflight"), 1 ("naive")
        batch = scheduler.schedule()     # sequences whose next token is not in flight
        stage 0 forward; hidden -> stage 1; scheduler.commit(batch)
    tokens = collect(oldest)             # sampled on the last stage (greedy) or here
    outputs = append + stop checks       # as the one-process engine

Why this hides the data dependency: a sequence's next token needs the last stage,
so a sequence can be in one micro-batch at a time; with P micro-batches of about
``active / P`` sequences each, stage k runs micro-batch i while stage k+1 runs i-1,
and in steady decoding no stage waits for a token it does not need (DeepSpeed-
Inference, SC22, Fig. 4/5). Prompt chunks (SplitFuse) need no token: a prompt's next
chunk may be in the next micro-batch while its previous one is still in flight.

Correctness rests on one invariant: every stage runs micro-batches (and block copies)
in launch order. So when rank 0 schedules, every launched micro-batch is as good as
done on every stage for KV purposes: ``commit`` at launch is exact, prefix-cache hits
on blocks still being written are read after the write on each stage, and freed
blocks are rewritten only after the in-flight reads of their old owner. The one
thing a launched micro-batch has not produced yet is the sampled token, so requests
waiting for one are hidden from ``schedule()`` (neither scheduled nor preempted).
"""

from __future__ import annotations

import itertools
import math
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any

import torch

from shardspeed.inference.fastgen.attention import select_backend
from shardspeed.inference.fastgen.block_pool import BlockPool
from shardspeed.inference.fastgen.config import PIPELINE_SCHEDULES, EngineConfig
from shardspeed.inference.fastgen.cpu_prepack import pack_worker_model
from shardspeed.inference.fastgen.engine import InferenceEngine
from shardspeed.inference.fastgen.kv_cache import KVCacheSpec, resolve_num_blocks
from shardspeed.inference.fastgen.loader import check_shardable, checkpoint_source, parse_dtype
from shardspeed.inference.fastgen.output_processor import OutputProcessor
from shardspeed.inference.fastgen.outputs import RequestOutput
from shardspeed.inference.fastgen.pipeline_parallel import messages as msg
from shardspeed.inference.fastgen.pipeline_parallel.errors import PipelineParallelError
from shardspeed.inference.fastgen.pipeline_parallel.stage_model import (
    build_stage_model,
    plan_stages,
)
from shardspeed.inference.fastgen.pipeline_parallel.stages import PipelineKVCache, PipelineStages
from shardspeed.inference.fastgen.pipeline_parallel.worker import StageTimer
from shardspeed.inference.fastgen.ragged import build_ragged_batch
from shardspeed.inference.fastgen.request import Request
from shardspeed.inference.fastgen.sampling import argmax_only
from shardspeed.inference.fastgen.scheduler import ScheduledBatch, ScheduledSequence, Scheduler
from shardspeed.inference.fastgen.structured import GuideFactory, MaskPrefetcher, apply_guides
from shardspeed.inference.fastgen.structured.prefetch import PrefetchedMasks
from shardspeed.utils.logging import get_logger

__all__ = ["PIPELINE_SCHEDULES", "PipelineInferenceEngine", "check_pipeline_config"]

logger = get_logger(__name__)


def check_pipeline_config(config: EngineConfig) -> None:
    """``ValueError`` for engine options that do not combine with ``pipeline_parallel > 1``."""
    pp = config.pipeline_parallel
    refusals = [
        (config.offload is not None, f"offload={getattr(config.offload, 'device', config.offload)!r}",
         "ZeRO-Inference offload streams one process's layers; use pipeline_parallel=1 or no offload"),
        (config.compile_decode not in (None, False), f"compile_decode={config.compile_decode!r}",
         "the compiled step runs the whole model; use compile_decode=False"),
        (config.scheduler == "static", "scheduler='static'",
         "a static batch is one group; use 'splitfuse' or 'prefill_first'"),
    ]  # fmt: skip
    for refused, what, why in refusals:
        if refused:
            raise ValueError(
                f"EngineConfig.{what} with pipeline_parallel={pp} is not supported ({why})."
            )


def _sampled_on_last_stage(req: Request) -> bool:
    """Rows whose token is their argmax and nothing else (:func:`argmax_only`), and that
    no sample forks from: the last stage can pick them without the request's state."""
    return argmax_only(req) and not req.fork_ids


@dataclass
class _MicroBatch:
    """One launched micro-batch: its sequences and how each returns its logits rows."""

    batch: ScheduledBatch
    modes: list[int]
    masks: MaskPrefetcher  # structured-output masks of its rows, computed while it is in flight

    def waiting_for_token(self) -> list[Request]:
        return [s.request for s, m in zip(self.batch.sequences, self.modes) if m != msg.NO_ROWS]


class PipelineInferenceEngine(InferenceEngine):
    """Continuous batching over ``pipeline_parallel`` stages (this process is stage 0).

    Built by ``InferenceEngine.from_pretrained(..., pipeline_parallel=P)`` or
    ``pipeline(model, pipeline_parallel=P)``; the public surface is the engine's. With
    ``tensor_parallel=T`` too, each stage is ``T`` ranks slicing its layers as
    ``tensor_parallel`` alone does (``P x T`` ranks; this process is stage 0's tensor rank 0).
    """

    def __init__(self, model: Any, tokenizer: Any = None, config: EngineConfig | None = None):
        self._is_shut_down = False
        self.config = config or EngineConfig()
        self.config.validate()
        cfg = self.config
        check_pipeline_config(cfg)
        self.device = cfg.resolved_device()
        self.peers = None  # the stages' tensor ranks (if any) are self.stages' workers
        self.weight_offload = None
        layouts = plan_stages(model, cfg.pipeline_parallel)  # refusals before any spawn
        if cfg.tensor_parallel > 1:  # heads / MLP rows / quantization groups divisible
            check_shardable(model, cfg.tensor_parallel, cfg.quantization)
        source = checkpoint_source(model)
        dtype = parse_dtype(cfg.dtype)
        self.stages = PipelineStages.spawn(
            source, layouts, dtype, self.device, cfg.quantization, cfg.tensor_parallel,
            cfg.cpu_prepack,
        )  # fmt: skip
        try:
            self._build(source, layouts, tokenizer)
        except BaseException:
            self.stages.shutdown(terminate=True)
            raise

    def _build(self, source: Any, layouts: list[Any], tokenizer: Any) -> None:
        cfg = self.config
        self.stage = build_stage_model(
            source, layouts[0], cfg.dtype, self.device, cfg.quantization, self.stages.shard
        )
        self.model = m = self.stage.model  # stage 0's part; shapes and limits are the model's
        pack_worker_model(m, cfg.cpu_prepack, self.device)  # as every other rank's
        self.model_config = {"model_type": m.model_type}
        self.tokenizer = tokenizer
        self.max_seq_len = self._resolve_max_seq_len()
        block_size = cfg.block_size or (64 if self.device.type == "cuda" else 16)
        kv_dtype = self.stage.dtype
        specs = [
            KVCacheSpec(s.num_layers, m.num_kv_heads, m.head_dim, block_size, kv_dtype)
            for s in layouts
        ]
        largest = max(specs, key=lambda s: s.num_layers)  # the budget holds on every rank
        num_blocks = resolve_num_blocks(
            largest, self.device, cfg.num_blocks, cfg.kv_cache_memory,
            cfg.max_ragged_sequence_count * self.max_seq_len,
        )  # fmt: skip
        self.backend = select_backend(cfg.attention_backend, self.device, block_size, kv_dtype)
        self.kv_cache = PipelineKVCache(specs[0], num_blocks, self.device, self.stages)
        self.stages.connect(specs, num_blocks, self.backend)
        self.block_pool = BlockPool(num_blocks, block_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_pool, cfg.max_ragged_batch_size, cfg.max_ragged_sequence_count,
            cfg.scheduler, watermark_blocks=int(cfg.watermark * num_blocks),
        )  # fmt: skip
        self.scheduler.kv_window = m.kv_window
        self.scheduler.rope_recompute_len = m.rope_recompute_len
        self.scheduler.rope_key = m.kv_rope_key
        self.runner = None  # stage 0 runs in _launch
        eos = list(m.eos_token_ids)
        tok_eos = getattr(tokenizer, "eos_token_id", None)
        if tok_eos is not None and tok_eos not in eos:
            eos.append(int(tok_eos))
        self.output_processor = OutputProcessor(tokenizer, eos, self.max_seq_len)
        self.guides = GuideFactory(tokenizer, m.vocab_size, eos)  # structured output
        self._requests: dict[str, Request] = {}
        self._unforked: dict[str, Request] = {}
        self._pending: list[RequestOutput] = []
        self._errors: OrderedDict = OrderedDict()
        self._ids = itertools.count()
        self._num_steps = self._tokens_generated = self._prompt_tokens = 0
        self.depth = cfg.pipeline_parallel if cfg.pipeline_schedule == "inflight" else 1
        self._in_flight: deque[_MicroBatch] = deque()
        self._timer = StageTimer()  # stage 0's waits for results
        # one mask prefetcher per micro-batch in flight (their rows are disjoint requests)
        self._free_masks = [MaskPrefetcher() for _ in range(self.depth)]

    # -------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Fill the pipeline, then finish its oldest micro-batch; outputs as ``InferenceEngine``."""
        outputs, self._pending = self._pending, []
        try:
            while len(self._in_flight) < self.depth:
                batch = self._schedule_micro_batch()
                if batch.is_empty:
                    break
                self._check_not_shut_down()
                self._launch(batch)
            if not self._in_flight:
                return outputs
            micro = self._in_flight.popleft()
            begin = time.perf_counter()
            try:
                tokens, rows = self.stages.collect()
            except PipelineParallelError:
                self._take_masks(micro)
                raise
            end = time.perf_counter()
        except PipelineParallelError as error:
            self._fail_all(error, outputs)
            raise
        self._finish(micro, tokens, rows, outputs)
        self._timer.add(end, end - begin)  # stage 0 waited for the last stage's result
        self._num_steps += 1
        return outputs

    def _schedule_micro_batch(self) -> ScheduledBatch:
        """The scheduler's next batch over requests not waiting for a token, at most
        ``ceil(active / depth)`` sequences (P equal groups in steady decoding)."""
        sched = self.scheduler
        waiting = {id(r) for mb in self._in_flight for r in mb.waiting_for_token()}
        saved = list(sched.running)
        active = len(saved) + len(sched.waiting)
        cap = self.config.max_ragged_sequence_count
        sched.running = [r for r in saved if id(r) not in waiting]
        sched.max_ragged_sequence_count = min(cap, max(1, math.ceil(active / self.depth)))
        try:
            batch = sched.schedule()
        finally:
            sched.max_ragged_sequence_count = cap
            kept = {id(r) for r in sched.running}
            old = {id(r) for r in saved}
            sched.running = [r for r in saved if id(r) in waiting or id(r) in kept] + [
                r for r in sched.running if id(r) not in old
            ]
        return batch

    def _launch(self, batch: ScheduledBatch) -> None:
        """Send ``batch`` down the pipeline: describe it to every stage, run stage 0."""
        now = time.perf_counter()
        for seq in batch.sequences:
            if seq.request.metrics.first_scheduled_time is None:
                seq.request.metrics.first_scheduled_time = now
        modes = [self._mode(seq) for seq in batch.sequences]
        self.stages.send_batch(batch, modes)
        micro = _MicroBatch(batch, modes, self._free_masks.pop())
        # rank 0 samples the LOGITS rows: their grammar masks are computed meanwhile
        micro.masks.submit(s.request for s, m in zip(batch.sequences, modes) if m == msg.LOGITS)
        self._in_flight.append(micro)  # from here a failure's _fail_all releases its masks
        ragged = build_ragged_batch(batch, self.kv_cache.spec.block_size, self.device, self.backend)
        try:
            hidden = self.stage.forward(ragged, self.kv_cache, None)  # [N, hidden]
        except Exception as exc:  # the other stages wait for this batch: the engine is done
            raise self.stages.fail(exc) from exc
        self.stages.send_hidden(hidden)
        self.scheduler.commit(batch)  # exact: every stage runs batches in launch order

    def _take_masks(self, micro: _MicroBatch) -> PrefetchedMasks | None:
        """``micro``'s prefetched masks (waits for them); its prefetcher goes back to the pool."""
        masks = micro.masks.take()
        self._free_masks.append(micro.masks)
        return masks

    @staticmethod
    def _mode(seq: ScheduledSequence) -> int:
        if seq.num_logits_rows == 0:
            return msg.NO_ROWS
        if seq.all_logits or not _sampled_on_last_stage(seq.request):
            return msg.LOGITS
        return msg.ARGMAX

    def _finish(
        self,
        micro: _MicroBatch,
        argmax: list[int],
        rows: torch.Tensor,
        outputs: list[RequestOutput],
    ) -> None:
        """Sample (or take the last stage's tokens), append and check stops, as the
        one-process engine's step does after its forward."""
        prefetched = self._take_masks(micro)
        picked: list[tuple[Request, int | None, torch.Tensor | None]] = []
        logits_seqs: list[ScheduledSequence] = []
        keep_rows: list[int] = []
        next_token, row = iter(argmax), 0
        for seq, mode in zip(micro.batch.sequences, micro.modes):
            live = not seq.request.is_finished  # aborted or failed while in flight
            if mode == msg.ARGMAX:
                token = next(next_token)
                if live:
                    picked.append((seq.request, token, None))
            elif mode == msg.LOGITS:
                n = seq.num_logits_rows
                if live:
                    logits_seqs.append(seq)
                    keep_rows.extend(range(row, row + n))
                row += n
        if logits_seqs:
            logits = rows[keep_rows] if len(keep_rows) != rows.shape[0] else rows
            sub = ScheduledBatch(sequences=logits_seqs)
            logits, sampled = self._sampling_rows(logits, sub, outputs)  # [M, V]
            logits, sampled = self._fork_samples(logits, sampled)  # n / best_of join here
            logits = apply_guides(logits, sampled, prefetched)  # disallowed ids -> -inf
            tokens = self._sample(logits, sampled, outputs)
            picked.extend(
                (req, tok, logits[i : i + 1]) for i, (req, tok) in enumerate(zip(sampled, tokens))
            )
        now = time.perf_counter()
        for req, token, row_logits in picked:
            if token is not None and not req.is_finished:
                self._append_token(req, token, row_logits, now, outputs)
        self._tokens_generated += sum(t is not None for _, t, _ in picked)

    def _fail_all(self, error: PipelineParallelError, outputs: list[RequestOutput]) -> None:
        """A stage is gone: end every unfinished request with ``finish_reason="error"``."""
        while self._in_flight:
            self._take_masks(self._in_flight.popleft())
        for req in list(self._requests.values()):
            if not req.is_finished:
                self._fail(req, error, outputs)
        self._pending = outputs + self._pending  # handed out by the next step()
        self._is_shut_down = True

    # ------------------------------------------------------------ observability
    def stage_times(self, reset: bool = False) -> list[msg.StageTimes]:
        """Each stage's busy time and window since the last reset (stage 0 first).

        ``idle_fraction`` is the share of the window the stage spent waiting for its
        input (a worker for the previous stage, stage 0 for the last stage's result):
        measured, never derived from the schedule. Reset while the pipeline runs in
        steady state, step, then read.
        """
        workers = self.stages.stage_times(reset)
        own = self._timer.times()
        if reset:
            self._timer.reset()
        return [own, *workers]

    def stage_weight_bytes(self) -> list[tuple[int, int]]:
        """``(decoder-layer bytes, all weight bytes)`` each rank holds, in rank order
        (``stage * tensor_parallel + tensor rank``; one per stage without tensor parallelism)."""
        own = (self.stage.layer_bytes(), self.stage.total_bytes())
        return [own, *((i.layer_bytes, i.total_bytes) for i in self.stages.infos)]

    def shutdown(self) -> None:
        """Stop the stage workers (idempotent); the engine cannot generate afterwards."""
        self._is_shut_down = True
        while self._in_flight:
            self._take_masks(self._in_flight.popleft())
        for prefetcher in self._free_masks:
            prefetcher.close()
        self.stages.shutdown()

    def _check_not_shut_down(self) -> None:
        if self.stages.failure is not None:
            raise PipelineParallelError(
                f"the pipeline-parallel stages are down ({self.stages.failure}); every request "
                "was ended with an error. Create a new engine (or pipeline) to continue."
            )
        if self._is_shut_down:
            raise RuntimeError(
                "this pipeline-parallel InferenceEngine was shut down (or lost a stage); build "
                "a new engine to generate again."
            )

    def __repr__(self) -> str:
        s = self.stats()
        tp = f", tensor_parallel={self.stages.tp_size}" if self.stages.tp_size > 1 else ""
        return (
            f"PipelineInferenceEngine({self.model.model_type}, device={self.device}, "
            f"pipeline_parallel={self.stages.num_stages}{tp}, "
            f"schedule={self.config.pipeline_schedule}, "
            f"blocks={s.kv_blocks_used}/{s.kv_blocks_total})"
        )
