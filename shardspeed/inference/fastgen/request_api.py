"""The engine's request API: queue, validate, abort, and ``generate`` to completion.

Mixed into :class:`~shardspeed.inference.fastgen.engine.InferenceEngine`, which owns the
state these methods read (scheduler, block pool, tokenizer, the unfinished requests) and
the ``step()`` loop that ``generate`` drives. A request is validated whole before it is
queued (its length against ``max_seq_len`` and the KV cache, its token ids and
``logit_bias`` against the vocabulary, its id against the unfinished ones), so a bad
request raises ``ValueError`` and leaves the engine as it was.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

from shardspeed.inference.fastgen.lora import resolve_lora
from shardspeed.inference.fastgen.outputs import RequestOutput, select_best
from shardspeed.inference.fastgen.request import Request, sample_request_ids
from shardspeed.inference.fastgen.sampling_params import SamplingParams

if TYPE_CHECKING:
    from shardspeed.inference.fastgen.block_pool import BlockPool
    from shardspeed.inference.fastgen.models import RaggedModel
    from shardspeed.inference.fastgen.output_processor import OutputProcessor
    from shardspeed.inference.fastgen.scheduler import Scheduler
    from shardspeed.inference.fastgen.structured import GuideFactory


class RequestApiMixin:
    """``add_request`` / ``encode`` / ``abort`` / ``generate`` of the inference engine; expects
    the state annotated below and the engine's ``step``, ``has_unfinished``, ``take_error``
    and ``_check_not_shut_down``."""

    # the engine's state (set in InferenceEngine.__init__)
    model: RaggedModel
    tokenizer: Any
    max_seq_len: int
    scheduler: Scheduler
    block_pool: BlockPool
    output_processor: OutputProcessor
    guides: GuideFactory
    _requests: dict[str, Request]  # unfinished requests by (sample) id
    _unforked: dict[str, Request]  # sample id -> request it forks from
    _pending: list[RequestOutput]  # aborted outputs for the next step()
    _ids: itertools.count
    _prompt_tokens: int

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        """Queue a prompt (text or token ids); returns its request id.

        With ``params.n`` / ``best_of`` > 1 the samples' outputs carry the ids
        :func:`~.request.sample_request_ids` gives (``"<id>#<index>"``); the first
        computes the prompt and the others fork from its KV blocks after prefill.
        """
        self._check_not_shut_down()
        params = params or SamplingParams()
        params.validate()
        token_ids = self._encode(prompt)
        if params.stop and self.tokenizer is None:
            raise ValueError(
                f"SamplingParams.stop={params.stop!r} needs a tokenizer to detokenize output; "
                "pass tokenizer= to the engine or use stop_token_ids."
            )
        if not params.truncate and len(token_ids) + params.max_new_tokens > self.max_seq_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_seq_len} tokens. However, "
                f"you requested {len(token_ids) + params.max_new_tokens} tokens "
                f"({len(token_ids)} in the prompt, {params.max_new_tokens} for the completion "
                "(max_new_tokens / max_tokens)). Shorten the prompt or lower max_new_tokens."
            )
        bad_bias = [t for t in params.logit_bias if t >= self.model.vocab_size]
        if bad_bias:
            raise ValueError(
                f"SamplingParams.logit_bias has token ids {bad_bias[:5]} outside the vocabulary "
                f"[0, {self.model.vocab_size})."
            )
        if len(token_ids) >= self.max_seq_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens but max_seq_len={self.max_seq_len} leaves no "
                "room to generate; shorten the prompt or raise EngineConfig.max_seq_len."
            )
        kv_tokens = min(len(token_ids) + params.max_new_tokens, self.max_seq_len) - 1
        need = self.scheduler.max_blocks_needed(kv_tokens)  # one window's worth if sliding
        if need > self.block_pool.num_blocks:
            raise ValueError(
                f"request needs up to {need} KV blocks ({len(token_ids)} prompt + "
                f"{params.max_new_tokens} new tokens) but the whole cache has "
                f"{self.block_pool.num_blocks}; raise num_blocks/kv_cache_memory or lower "
                "max_new_tokens."
            )
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        sample_ids = sample_request_ids(request_id, params.num_samples)
        busy = [i for i in sample_ids if i in self._requests or i in self._unforked]
        if busy:
            raise ValueError(f"request_id={busy[0]!r} is already in use by an unfinished request.")
        adapter = resolve_lora(getattr(self, "lora", None), params.lora_name)  # unknown: ValueError
        req = Request(sample_ids[0], token_ids, params)
        req.lora = adapter
        if params.structured_output is not None:  # compile errors raise before queueing
            req.guide = self.guides.new_guide(params.structured_output)
        req.fork_ids = sample_ids[1:]
        if params.min_tokens:
            eos = [] if params.ignore_eos else sorted(self.output_processor.eos_token_ids)
            req.min_tokens_suppressed_ids = sorted({*eos, *params.stop_token_ids})
        self._requests[req.request_id] = req
        self._unforked.update((i, req) for i in req.fork_ids)
        self.scheduler.add(req)
        self._prompt_tokens += len(token_ids)
        return request_id

    def encode(self, prompt: str | list[int]) -> list[int]:
        """The prompt's token ids (validated against the vocabulary); ``ValueError`` if empty."""
        return self._encode(prompt)

    def _encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    "prompt is a str but the engine has no tokenizer; pass token ids "
                    "or give the engine a tokenizer."
                )
            try:
                token_ids = list(self.tokenizer.encode(prompt))
            except (TypeError, UnicodeError) as exc:  # e.g. a lone surrogate "\ud800"
                raise ValueError(
                    f"prompt could not be tokenized ({type(exc).__name__}: {exc}); send text "
                    "that is valid Unicode (no lone surrogates) or token ids."
                ) from exc
        else:
            token_ids = [int(t) for t in prompt]
        if not token_ids:
            raise ValueError("prompt is empty; pass at least one token.")
        vocab = self.model.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab}).")
        return token_ids

    def abort(self, request_id: str) -> None:
        """Stop a request now; its final output (``finish_reason="abort"``) comes with the next ``step()``."""
        parent = self._unforked.pop(request_id, None)
        if parent is not None:  # a sample whose prefill has not finished yet
            parent.fork_ids.remove(request_id)
            self._pending.append(self._unstarted_output(parent, request_id, "abort"))
            return
        req = self._requests.pop(request_id, None)
        if req is None:  # maybe the id of a multi-sample request: abort all its samples
            prefix = f"{request_id}#"
            for sid in [i for i in (*self._requests, *self._unforked) if i.startswith(prefix)]:
                self.abort(sid)
            return
        self.scheduler.finish(req, "abort")
        self._pending.append(req.make_output())
        for child_id in list(req.fork_ids):
            self.abort(child_id)

    @staticmethod
    def _unstarted_output(parent: Request, sample_id: str, reason: str) -> RequestOutput:
        """Final output of a sample that finished before it was forked from ``parent``."""
        sample = parent.new_sample(sample_id)
        sample.finish(reason)
        return sample.make_output()

    def generate(
        self,
        prompts: list[str | list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run ``prompts`` to completion; final outputs in prompt order.

        A prompt whose params ask for ``n`` > 1 samples contributes ``n`` consecutive
        outputs (``index`` 0..n-1; with ``best_of`` the ``n`` most likely samples).

        Outputs of other requests already in the engine are consumed and dropped.
        """
        if isinstance(params, list) and len(params) != len(prompts):
            raise ValueError(
                f"generate got {len(prompts)} prompts but {len(params)} SamplingParams; "
                "pass one SamplingParams or one per prompt."
            )
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        per_prompt = [sp or SamplingParams() for sp in per_prompt]
        groups: list[list[str]] = []  # sample ids of each prompt
        try:
            for prompt, sp in zip(prompts, per_prompt):
                rid = self.add_request(prompt, sp)
                groups.append(sample_request_ids(rid, sp.num_samples))
        except ValueError:
            for group in groups:  # all-or-nothing: do not leave half the batch running
                for rid in group:
                    self.abort(rid)
            dropped = {rid for group in groups for rid in group}
            self._pending = [o for o in self._pending if o.request_id not in dropped]
            raise
        ids = [rid for group in groups for rid in group]
        wanted, finals = set(ids), {}
        while len(finals) < len(ids):
            if not self.has_unfinished():
                raise RuntimeError("engine has no work left but some requests never finished")
            for out in self.step():
                if out.finished and out.request_id in wanted:
                    finals[out.request_id] = out
        for rid in ids:
            error = self.take_error(rid)
            if error is not None:
                raise error
        result: list[RequestOutput] = []
        for group, sp in zip(groups, per_prompt):
            outs = [finals[i] for i in group]
            result.extend(select_best(outs, sp.n) if sp.num_samples > sp.n else outs)
        return result
