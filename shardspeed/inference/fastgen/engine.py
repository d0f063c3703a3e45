"""The FastGen-style inference engine: continuous batching over a blocked KV cache.

``step()`` is the whole loop::

    batch  = scheduler.schedule()          # grant tokens, allocate blocks
    logits = runner.execute(batch)         # one ragged forward
    scheduler.commit(batch)                # num_computed_tokens += granted
    tokens = sample_next_tokens(logits)    # rows whose chunk reached the last token
    outputs = append + stop checks         # finished requests free their blocks

A failure that belongs to one request does not stop the others: if the batched
forward raises, each sequence is run alone and only those that still fail are
finished, as are requests whose sampling or stop checks raise. Such a request ends
with ``finish_reason="error"`` and :meth:`InferenceEngine.take_error` returns why.

The engine is not thread-safe: one thread calls ``add_request``/``abort``/``step``.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from shardspeed.inference.fastgen.attention import select_backend
from shardspeed.inference.fastgen.block_pool import BlockPool
from shardspeed.inference.fastgen.config import EngineConfig
from shardspeed.inference.fastgen.cpu_prepack import prepack_linears, resolve_prepack
from shardspeed.inference.fastgen.expert_parallel import start_expert_parallel
from shardspeed.inference.fastgen.kv_cache import KVCacheSpec, resolve_num_blocks
from shardspeed.inference.fastgen.kv_quant import make_kv_cache
from shardspeed.inference.fastgen.loader import build_model, resolve_tokenizer
from shardspeed.inference.fastgen.logprobs import record_prompt_logprobs, sampled_logprobs
from shardspeed.inference.fastgen.lora import LoRAManager
from shardspeed.inference.fastgen.model_runner import ModelRunner
from shardspeed.inference.fastgen.models.tp_shard import NO_SHARD
from shardspeed.inference.fastgen.output_processor import OutputProcessor
from shardspeed.inference.fastgen.outputs import RequestOutput
from shardspeed.inference.fastgen.request import Request
from shardspeed.inference.fastgen.request_api import RequestApiMixin
from shardspeed.inference.fastgen.sampling import argmax_only, sample_next_tokens
from shardspeed.inference.fastgen.scheduler import ScheduledBatch, Scheduler
from shardspeed.inference.fastgen.speculative import build_speculator
from shardspeed.inference.fastgen.structured import GuideFactory, MaskPrefetcher, apply_guides
from shardspeed.inference.fastgen.tensor_parallel import TensorParallelError, start_tensor_parallel
from shardspeed.utils.logging import get_logger, warning_once

__all__ = ["EngineConfig", "EngineStats", "InferenceEngine", "RequestFailedError"]

logger = get_logger(__name__)
_MAX_KEPT_ERRORS = 1024  # errors nobody took are dropped oldest-first beyond this


class RequestFailedError(RuntimeError):
    """One request failed inside a step (its forward, sampling or stop checks); the
    engine finished it with ``finish_reason="error"`` and went on with the others."""


@dataclass
class EngineStats:
    """Counters and gauges of an engine."""

    num_waiting: int
    num_running: int
    kv_blocks_used: int
    kv_blocks_total: int
    tokens_generated_total: int
    prompt_tokens_total: int
    num_steps: int
    num_preemptions: int
    prefix_cache_hit_blocks: int


class InferenceEngine(RequestApiMixin):
    """Continuous-batching text generation over a blocked KV cache."""

    def __init__(self, model: Any, tokenizer: Any = None, config: EngineConfig | None = None):
        self._is_shut_down = False
        self.config = config or EngineConfig()
        self.config.validate()
        cfg = self.config
        if cfg.pipeline_parallel > 1:
            raise ValueError(
                f"EngineConfig.pipeline_parallel={cfg.pipeline_parallel} needs the pipeline "
                "engine: use InferenceEngine.from_pretrained(..., pipeline_parallel=P), "
                "pipeline(model, pipeline_parallel=P) or PipelineInferenceEngine."
            )
        self.device = cfg.resolved_device()
        # tensor_parallel > 1: workers spawn now and load their shards while this one loads
        # (expert_parallel > 1: their experts; same process machinery)
        self.peers = start_tensor_parallel(model, cfg, self.device) or start_expert_parallel(
            model, cfg, self.device
        )
        shard = self.peers.shard if self.peers is not None else NO_SHARD
        # with offload the model is built (and quantized, for self.device) on the host and
        # the streamer moves only the resident parts: the device never holds all weights
        load_device = torch.device("cpu") if cfg.offload is not None else self.device
        self.model, self.model_config = build_model(
            model, cfg.dtype, load_device, cfg.quantization, shard, target_device=self.device,
            prepare=getattr(self.peers, "prepare_model", None),  # expert parallel: its experts
        )  # fmt: skip
        from shardspeed.inference.fastgen.offload import enable_weight_offload

        # ZeRO-Inference: decoder layers stream in from cfg.offload's store (None: all resident)
        self.weight_offload = enable_weight_offload(self.model, cfg.offload, self.device)
        if self.weight_offload is not None:  # under budget_bytes the KV gets what weights leave
            kv = self.weight_offload.kv_cache_memory(cfg.kv_cache_memory, cfg.num_blocks)
            cfg.kv_cache_memory = kv
        self.tokenizer = tokenizer
        self.max_seq_len = self._resolve_max_seq_len()
        block_size = cfg.block_size or (64 if self.device.type == "cuda" else 16)
        m = self.model
        spec = KVCacheSpec(
            m.num_layers, m.num_kv_heads, m.head_dim, block_size, next(m.parameters()).dtype,
            cfg.kv_cache_dtype,
        )  # fmt: skip
        max_useful_tokens = cfg.max_ragged_sequence_count * self.max_seq_len
        num_blocks = resolve_num_blocks(
            spec, self.device, cfg.num_blocks, cfg.kv_cache_memory, max_useful_tokens
        )
        backend = select_backend(cfg.attention_backend, self.device, block_size, spec.dtype)
        if self.peers is None:
            self.kv_cache = make_kv_cache(spec, num_blocks, self.device)  # int8 / fp8 too
        else:  # every rank allocates the same blocks of its own KV heads
            self.kv_cache = self.peers.connect(spec, num_blocks, backend)
        self.block_pool = BlockPool(num_blocks, block_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_pool,
            cfg.max_ragged_batch_size,
            cfg.max_ragged_sequence_count,
            cfg.scheduler,
            watermark_blocks=int(cfg.watermark * num_blocks),
        )
        self.scheduler.kv_window = m.kv_window  # frees blocks outside a sliding window
        self.scheduler.rope_recompute_len = m.rope_recompute_len  # longrope crossing
        self.scheduler.rope_key = m.kv_rope_key
        self.runner = ModelRunner(
            self.model, self.kv_cache, self.device, backend, cfg.compile_decode,
            cfg.max_ragged_sequence_count, self.max_seq_len, self.peers,
        )  # fmt: skip
        packed = resolve_prepack(
            cfg.cpu_prepack, self.device, spec.dtype,
            compiled=self.runner.compiled is not None, offloaded=self.weight_offload is not None,
        )  # fmt: skip
        prepack_linears(self.model, packed)  # CPU: oneDNN weights packed once, not per call
        self.speculator = build_speculator(self)  # None unless cfg.speculative_config
        self.lora = LoRAManager(m, cfg.max_loras, cfg.max_lora_rank) if cfg.enable_lora else None
        self.runner.lora = self.lora  # adapters of the batch's requests (enable_lora)
        eos = list(m.eos_token_ids)
        tok_eos = getattr(tokenizer, "eos_token_id", None)
        if tok_eos is not None and tok_eos not in eos:
            eos.append(int(tok_eos))
        self.output_processor = OutputProcessor(tokenizer, eos, self.max_seq_len)
        self.guides = GuideFactory(tokenizer, m.vocab_size, eos)  # structured output
        self.mask_prefetch = MaskPrefetcher()  # their masks computed while the forward runs
        self._requests: dict[str, Request] = {}  # unfinished requests by (sample) id
        self._unforked: dict[str, Request] = {}  # sample id -> request it forks from
        self._pending: list[RequestOutput] = []  # aborted outputs for the next step()
        self._errors: OrderedDict[str, RequestFailedError] = OrderedDict()  # see take_error
        self._ids = itertools.count()
        self._num_steps = self._tokens_generated = self._prompt_tokens = 0

    @classmethod
    def from_pretrained(
        cls, model_or_path: Any, tokenizer: Any = None, **config_kwargs: Any
    ) -> InferenceEngine:
        """Engine for an HF dir, transformers model, shardspeed GPT or its saved dir.

        ``tokenizer`` None picks ``AutoTokenizer`` from the directory when present,
        ``ByteTokenizer`` for shardspeed GPT; ``config_kwargs`` are
        :class:`EngineConfig` fields.
        """
        config = EngineConfig.from_kwargs(**config_kwargs)
        if config.pipeline_parallel > 1 and cls is InferenceEngine:
            from shardspeed.inference.fastgen.pipeline_parallel import PipelineInferenceEngine

            cls = PipelineInferenceEngine
        return cls(model_or_path, resolve_tokenizer(model_or_path, tokenizer), config)

    def _resolve_max_seq_len(self) -> int:
        limit = self.model.max_positions
        wanted = self.config.max_seq_len or limit or 4096
        if limit is not None and wanted > limit:
            if self.model.learned_positions:
                raise ValueError(
                    f"EngineConfig.max_seq_len={wanted} exceeds the model's {limit} learned "
                    f"positions; use max_seq_len <= {limit}."
                )
            warning_once(f"max_seq_len={wanted} is beyond the model's trained {limit} positions")
        return wanted

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending)

    def take_error(self, request_id: str) -> RequestFailedError | None:
        """Why ``request_id`` finished with ``finish_reason="error"`` (None if it did not);
        each error is returned once."""
        return self._errors.pop(request_id, None)

    # -------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """One schedule + one ragged forward; outputs of requests with new tokens or finished."""
        outputs, self._pending = self._pending, []
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return outputs
        self._check_not_shut_down()
        now = time.perf_counter()
        for seq in batch.sequences:
            if seq.request.metrics.first_scheduled_time is None:
                seq.request.metrics.first_scheduled_time = now
        if self.speculator is not None and self.speculator.accepts(batch):  # decodes only
            appended = self.speculator.step(batch, outputs, self._append_token, self._fail)
            if appended is not None:  # else its forward failed: the usual path below
                self._num_steps += 1
                self._tokens_generated += appended
                return outputs
        self.mask_prefetch.submit(s.request for s in batch.sequences if s.needs_logits)
        # rows that only need their argmax stay in the model's dtype (no fp32 copy)
        keep_dtype = all(
            argmax_only(s.request) and not s.all_logits for s in batch.sequences if s.needs_logits
        )
        logits, batch = self._execute(batch, outputs, keep_dtype)  # drops failed sequences
        self.scheduler.commit(batch)
        logits, sampled = self._sampling_rows(logits, batch, outputs)  # [M, V], one per request
        logits, sampled = self._fork_samples(logits, sampled)  # n / best_of samples join here
        masks = self.mask_prefetch.take()  # structured output: disallowed ids -> -inf
        logits = apply_guides(logits, sampled, masks)
        tokens = self._sample(logits, sampled, outputs)  # None where sampling failed
        now = time.perf_counter()
        for row, (req, token) in enumerate(zip(sampled, tokens)):
            if token is not None:
                self._append_token(req, token, logits[row : row + 1], now, outputs)  # [1, V]
        self._num_steps += 1
        self._tokens_generated += sum(t is not None for t in tokens)
        return outputs

    # --------------------------------------------------- logits rows / samples
    def _sampling_rows(
        self, logits: torch.Tensor, batch: ScheduledBatch, outputs: list[RequestOutput]
    ) -> tuple[torch.Tensor, list[Request]]:
        """Record prompt logprobs from ``all_logits`` rows; return the rows to sample
        from (``[M, V]``) and their requests."""
        rows: list[int] = []
        sampled: list[Request] = []
        row = 0
        for seq in batch.sequences:
            n = seq.num_logits_rows
            if seq.all_logits:
                try:
                    record_prompt_logprobs(seq.request, logits[row : row + n], seq.start_position)
                except Exception as exc:
                    self._fail(seq.request, exc, outputs)
                    row += n
                    continue
            if seq.needs_logits:
                rows.append(row + n - 1)
                sampled.append(seq.request)
            row += n
        if len(rows) == logits.shape[0]:
            return logits, sampled
        return logits[torch.tensor(rows, dtype=torch.long, device=logits.device)], sampled

    def _fork_samples(
        self, logits: torch.Tensor, sampled: list[Request]
    ) -> tuple[torch.Tensor, list[Request]]:
        """After a multi-sample request's prefill, start its other samples on its KV
        blocks; they draw their first token from the same logits row."""
        extra_rows: list[int] = []
        extra: list[Request] = []
        for row, req in enumerate(sampled):
            if not req.fork_ids or req.output_token_ids:
                continue
            for child_id in req.fork_ids:
                self._unforked.pop(child_id, None)
                child = req.new_sample(child_id)
                self._requests[child_id] = child
                if self.scheduler.add_forked(child, req, self.kv_cache):
                    extra_rows.append(row)
                    extra.append(child)
                else:  # no block free to copy the last partial block: compute its own prompt
                    self.scheduler.add(child)
            req.fork_ids = []
        if not extra:
            return logits, sampled
        idx = torch.tensor(extra_rows, dtype=torch.long, device=logits.device)
        return torch.cat([logits, logits[idx]]), sampled + extra  # [M + E, V]

    def _record_logprob(self, req: Request, logits: torch.Tensor, token: int) -> None:
        (entry,) = sampled_logprobs(logits, [req], [token])
        req.cumulative_logprob += entry.logprob
        if req.logprobs is not None:
            req.logprobs.append(entry)

    # ------------------------------------------------------- fault isolation
    def _execute(
        self, batch: ScheduledBatch, outputs: list[RequestOutput], keep_dtype: bool = False
    ) -> tuple[torch.Tensor, ScheduledBatch]:
        """Logits of ``batch``, and the batch itself less the sequences that failed.

        If the batched forward raises, every sequence runs alone (rewriting its own KV
        slots with the same values); those that still fail are finished with an error.
        When two or more sequences all fail alone, the fault is the engine's, not a
        request's, and the original error is raised. A tensor-parallel failure
        (:class:`TensorParallelError`) is the engine's at once and is raised as is.
        """
        try:
            return self.runner.execute(batch, keep_dtype), batch
        except TensorParallelError:  # the ranks are out of step: no per-request retry
            raise
        except Exception as batch_error:
            logger.warning(
                "the forward of %d sequences failed (%s); running each alone",
                len(batch.sequences),
                batch_error,
            )
            kept, rows, failed = [], [], []
            for seq in batch.sequences:
                try:
                    logits = self.runner.execute(ScheduledBatch(sequences=[seq]), keep_dtype)
                except Exception as exc:
                    failed.append((seq.request, exc))
                    continue
                kept.append(seq)
                rows.append(logits)
            if len(failed) > 1 and not kept:
                raise batch_error
            # Blocks a failed request was to fill this step may be shared (same-step prefix
            # hits): the sequences reading them recompute later instead.
            unwritten = {
                b for req, _ in failed for b in self.scheduler.uncomputed_registered_blocks(req)
            }
            for req, exc in failed:
                self._fail(req, exc, outputs)
            if unwritten:
                for seq in [s for s in kept if unwritten.intersection(s.block_table)]:
                    i = kept.index(seq)
                    kept.pop(i)
                    rows.pop(i)
                    self.scheduler.requeue(seq.request)
            vocab = self.model.vocab_size
            logits = torch.cat(rows) if rows else torch.empty(0, vocab, device=self.device)
            return logits, ScheduledBatch(sequences=kept, preempted=batch.preempted)

    def _sample(
        self, logits: torch.Tensor, requests: list[Request], outputs: list[RequestOutput]
    ) -> list[int | None]:
        """Next token per request (``logits`` row i is ``requests[i]``'s); if the batched
        draw raises, each request draws alone and those that fail get None."""
        try:
            return list(sample_next_tokens(logits, requests))
        except Exception:
            tokens: list[int | None] = []
            for i, req in enumerate(requests):
                try:
                    tokens.append(sample_next_tokens(logits[i : i + 1], [req])[0])  # [1, V]
                except Exception as exc:
                    self._fail(req, exc, outputs)
                    tokens.append(None)
            return tokens

    def _append_token(
        self,
        req: Request,
        token: int,
        row_logits: torch.Tensor | None,
        now: float,
        outputs: list[RequestOutput],
    ) -> None:
        """One sampled token of ``req``: its logprob (``row_logits``: [1, V]), the grammar of
        structured output, the detokenized text and stop checks; then one output."""
        try:
            if row_logits is not None and req.params.needs_logprobs:
                self._record_logprob(req, row_logits, token)
            if req.guide is not None:
                req.guide.accept(token)
            reason = self.output_processor.append(req, token, now)
            if reason is None and req.guide is not None and req.guide.is_finished:
                reason = "stop"  # the grammar is complete
        except Exception as exc:  # a detokenizer or stop-check failure of this request
            self._fail(req, exc, outputs)
            return
        if reason is not None:
            self.scheduler.finish(req, reason, now)
            self._requests.pop(req.request_id, None)
        outputs.append(req.make_output())

    def _fail(self, req: Request, exc: Exception, outputs: list[RequestOutput]) -> None:
        """Finish ``req`` with ``finish_reason="error"``, keeping ``exc`` for take_error."""
        logger.error("request %s failed: %s: %s", req.request_id, type(exc).__name__, exc)
        self.scheduler.finish(req, "error")
        self._requests.pop(req.request_id, None)
        error = RequestFailedError(
            f"request {req.request_id} failed while generating ({type(exc).__name__}: {exc})"
        )
        error.__cause__ = exc
        self._errors[req.request_id] = error
        while len(self._errors) > _MAX_KEPT_ERRORS:
            self._errors.popitem(last=False)
        outputs.append(req.make_output())
        for child_id in req.fork_ids:  # samples that would have forked from it fail too
            self._unforked.pop(child_id, None)
            self._errors[child_id] = error
            outputs.append(self._unstarted_output(req, child_id, "error"))
        req.fork_ids = []

    def shutdown(self) -> None:
        """Release what the engine holds beyond memory (idempotent): the weight offload
        (its worker thread; its NVMe files are deleted) and the tensor-parallel workers.

        The engine cannot generate afterwards (``add_request`` and a ``step`` with work
        raise ``RuntimeError``). Without calling it, a tensor-parallel engine stops its
        workers and an offloading one removes its files when garbage-collected or when
        this process exits.
        """
        if self._is_shut_down:
            return
        self._is_shut_down = True
        try:
            self.mask_prefetch.close()
            if self.weight_offload is not None:
                self.weight_offload.close()
        finally:
            if self.peers is not None:
                self.peers.shutdown()

    def _check_not_shut_down(self) -> None:
        if self._is_shut_down:
            raise RuntimeError(
                "this InferenceEngine was shut down (shutdown() released its weight offload "
                "and tensor-parallel workers); build a new engine to generate again."
            )

    def stats(self) -> EngineStats:
        return EngineStats(
            num_waiting=len(self.scheduler.waiting),
            num_running=len(self.scheduler.running),
            kv_blocks_used=self.block_pool.num_used,
            kv_blocks_total=self.block_pool.num_blocks,
            tokens_generated_total=self._tokens_generated,
            prompt_tokens_total=self._prompt_tokens,
            num_steps=self._num_steps,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_hit_blocks=self.block_pool.num_cache_hits,
        )

    def __repr__(self) -> str:
        s = self.stats()
        tp = ""
        if self.peers is not None:  # expert-parallel peers are tensor-parallel peers' subclass
            kind = "expert_parallel" if self.config.expert_parallel > 1 else "tensor_parallel"
            tp = f", {kind}={self.peers.world_size}"
        return (
            f"InferenceEngine({self.model.model_type}, device={self.device}{tp}, "
            f"blocks={s.kv_blocks_used}/{s.kv_blocks_total}, scheduler={self.config.scheduler})"
        )
