"""The in-process ``pipeline()`` API (MII's call shape on the FastGen engine).

::

    pipe = pipeline("path/to/model", scheduler="splitfuse")
    responses = pipe(["DeepSpeed is", "Seattle is"], max_new_tokens=64)
    print(responses[0])                     # the generated text
    pipe.chat([{"role": "user", "content": "Hi"}], max_new_tokens=32)  # chat template
    for delta in pipe.stream("Once upon a time", max_new_tokens=32):
        print(delta, end="")
    pipe.shutdown()

    pipe = pipeline("path/to/model", tensor_parallel=2)   # this process + 1 worker

The pipeline drives the engine in the caller's thread; it is not meant to be shared
between threads (the server in :mod:`.server` owns its engine through
:class:`~.async_engine.AsyncEngine` instead).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shardspeed.inference.serving.text_stream import TextDeltaStream

if TYPE_CHECKING:
    from shardspeed.inference.fastgen.engine import InferenceEngine
    from shardspeed.inference.fastgen.outputs import RequestOutput
    from shardspeed.inference.fastgen.sampling_params import SamplingParams

Prompt = str | list[int]


@dataclass
class Response:
    """One finished request. ``str(response)`` is the generated text (as in MII).

    Timings are in seconds on the engine's clock: ``ttft`` from arrival to the first
    generated token, ``tpot`` the mean time per output token after the first, and
    ``latency`` from arrival to the last token. ``prompt`` is None for token-id prompts.
    """

    generated_text: str
    prompt: str | None
    token_ids: list[int]
    finish_reason: str | None
    prompt_length: int
    generated_length: int
    ttft: float | None
    tpot: float | None
    latency: float | None
    request_id: str

    def __str__(self) -> str:
        return self.generated_text

    @classmethod
    def from_output(cls, prompt: Prompt, out: RequestOutput) -> Response:
        """Build a response from the engine's final :class:`RequestOutput`."""
        ttft, tpot, latency = request_timings(out)
        return cls(
            generated_text=out.text,
            prompt=prompt if isinstance(prompt, str) else None,
            token_ids=list(out.output_token_ids),
            finish_reason=out.finish_reason,
            prompt_length=len(out.prompt_token_ids),
            generated_length=len(out.output_token_ids),
            ttft=ttft,
            tpot=tpot,
            latency=latency,
            request_id=out.request_id,
        )


def request_timings(out: RequestOutput) -> tuple[float | None, float | None, float | None]:
    """(TTFT, TPOT, end-to-end latency) of a finished request, None where undefined."""
    m = out.metrics
    ttft = None if m.first_token_time is None else m.first_token_time - m.arrival_time
    latency = None if m.finish_time is None else m.finish_time - m.arrival_time
    n = len(out.output_token_ids)
    tpot = None
    if ttft is not None and latency is not None and n > 1:
        tpot = (latency - ttft) / (n - 1)
    return ttft, tpot, latency


def make_sampling_params(
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    repetition_penalty: float = 1.0,
    seed: int | None = None,
    stop: str | Sequence[str] | None = None,
    ignore_eos: bool = False,
    min_new_tokens: int = 0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    logit_bias: dict[int, float] | None = None,
    truncate: bool = False,
) -> SamplingParams:
    """Build and validate :class:`SamplingParams` from generation keyword arguments."""
    from shardspeed.inference.fastgen.sampling_params import SamplingParams

    if stop is None:
        stop_list: list[str] = []
    elif isinstance(stop, str):
        stop_list = [stop]
    else:
        stop_list = list(stop)
    params = SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=float(temperature),
        top_k=top_k,
        top_p=float(top_p),
        repetition_penalty=float(repetition_penalty),
        seed=seed,
        stop=stop_list,
        ignore_eos=ignore_eos,
        min_tokens=min_new_tokens,
        presence_penalty=float(presence_penalty),
        frequency_penalty=float(frequency_penalty),
        logit_bias=dict(logit_bias or {}),
        truncate=truncate,
    )
    params.validate()
    return params


GENERATION_FIELDS = (
    "max_new_tokens", "top_k", "top_p", "repetition_penalty", "seed", "stop", "ignore_eos",
    "min_new_tokens", "presence_penalty", "frequency_penalty", "logit_bias", "truncate",
)  # fmt: skip


def generation_fields(arguments: dict[str, Any]) -> dict[str, Any]:
    """The generation keywords of a ``Pipeline`` call (from its ``locals()``), with ``do_sample`` + ``temperature`` resolved into one temperature."""
    gen = {name: arguments[name] for name in GENERATION_FIELDS}
    gen["temperature"] = resolve_temperature(arguments["do_sample"], arguments["temperature"])
    return gen


def resolve_temperature(do_sample: bool | None, temperature: float | None) -> float:
    """HF/MII ``do_sample`` + ``temperature`` as one temperature (0 = greedy).

    ``do_sample=None`` samples exactly when a temperature > 0 is given;
    ``do_sample=True`` samples at ``temperature`` (1.0 when not given);
    ``do_sample=False`` is greedy and refuses a temperature > 0.
    """
    if do_sample is None:
        return 0.0 if temperature is None else float(temperature)
    if do_sample:
        t = 1.0 if temperature is None else float(temperature)
        if t <= 0.0:
            raise ValueError(
                f"do_sample=True with temperature={temperature!r} is contradictory; pass a "
                "temperature > 0 or do_sample=False for greedy decoding."
            )
        return t
    if temperature not in (None, 0, 0.0):
        raise ValueError(
            f"do_sample=False (greedy) with temperature={temperature!r} is contradictory; drop "
            "temperature or pass do_sample=True."
        )
    return 0.0


class Pipeline:
    """Batch and streaming text generation on one :class:`InferenceEngine`.

    Generation keywords (``__call__``, ``stream``, ``chat``): ``max_new_tokens``
    (default 128) or MII's ``max_length`` (prompt + new tokens), ``min_new_tokens``,
    ``do_sample`` / ``temperature`` / ``top_k`` / ``top_p``, ``repetition_penalty``,
    ``presence_penalty`` / ``frequency_penalty``, ``logit_bias``, ``seed``, ``stop``,
    ``ignore_eos``, ``return_full_text`` (prompt + generated text), and ``truncate``:
    a prompt + ``max_new_tokens`` beyond the engine's ``max_seq_len`` raises
    ``ValueError`` unless ``truncate=True``, which stops generation at the context.
    """

    def __init__(self, engine: InferenceEngine) -> None:
        self.engine = engine

    @property
    def tokenizer(self) -> Any:
        """The engine's tokenizer (None when the engine has none)."""
        return self.engine.tokenizer

    def __call__(
        self,
        prompts: str | Sequence[Prompt],
        max_new_tokens: int | None = None,
        temperature: float | None = None,
        top_k: int = 0,
        top_p: float = 1.0,
        repetition_penalty: float = 1.0,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        ignore_eos: bool = False,
        params: SamplingParams | None = None,
        *,
        do_sample: bool | None = None,
        min_new_tokens: int = 0,
        max_length: int | None = None,
        return_full_text: bool = False,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        logit_bias: dict[int, float] | None = None,
        truncate: bool = False,
    ) -> list[Response]:
        """Generate for one prompt or a list of prompts; returns one Response per prompt.

        Prompts are strings or token-id lists. ``params`` (a :class:`SamplingParams`)
        overrides the generation keywords when given.
        """
        prompt_list = self._prompt_list(prompts)
        gen = generation_fields(locals())
        token_prompts = [self._encode(p) for p in prompt_list]
        per_prompt = [self._params(len(t), max_length, params, gen) for t in token_prompts]
        outputs = self.engine.generate(token_prompts, per_prompt)
        responses = [Response.from_output(p, o) for p, o in zip(prompt_list, outputs, strict=True)]
        if return_full_text:
            for r, p in zip(responses, prompt_list, strict=True):
                r.generated_text = self._prompt_text(p) + r.generated_text
        return responses

    def chat(
        self,
        messages: Sequence[dict[str, str]] | Sequence[Sequence[dict[str, str]]],
        chat_template: str | None = None,
        **generation: Any,
    ) -> list[Response]:
        """Answer one conversation (a list of ``{"role", "content"}`` dicts) or a list of
        them, rendered with the tokenizer's chat template (``chat_template`` overrides
        it); ``generation`` are the keywords of ``__call__``. One Response per conversation.
        """
        from shardspeed.inference.serving.chat import has_chat_template, render_chat_prompt

        if not has_chat_template(self.tokenizer, chat_template):
            raise ValueError(
                "Pipeline.chat needs a tokenizer with a chat template, but "
                f"{type(self.tokenizer).__name__} has none; pass chat_template='...' (a Jinja "
                "template) or use a model whose tokenizer_config.json defines one."
            )
        if not messages:
            raise ValueError("Pipeline.chat messages is empty; pass at least one message.")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        for conv in conversations:
            if not conv or not all(isinstance(m, dict) and "role" in m for m in conv):
                raise ValueError(
                    "Pipeline.chat messages must be a list of {'role': ..., 'content': ...} "
                    "dicts, or a list of such lists."
                )
        prompts = [
            render_chat_prompt([dict(m) for m in conv], self.tokenizer, chat_template)
            for conv in conversations
        ]
        return self(prompts, **generation)  # type: ignore[arg-type]

    def stream(
        self,
        prompt: Prompt,
        max_new_tokens: int | None = None,
        temperature: float | None = None,
        top_k: int = 0,
        top_p: float = 1.0,
        repetition_penalty: float = 1.0,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        ignore_eos: bool = False,
        params: SamplingParams | None = None,
        *,
        do_sample: bool | None = None,
        min_new_tokens: int = 0,
        max_length: int | None = None,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        logit_bias: dict[int, float] | None = None,
        truncate: bool = False,
    ) -> Iterator[str]:
        """Yield the generated text of one prompt piece by piece as the engine steps.

        The pieces joined equal the text the non-streaming call returns. Closing the
        generator early aborts the request.
        """
        self._prompt_list([prompt])
        gen = generation_fields(locals())
        token_ids = self._encode(prompt)
        params = self._params(len(token_ids), max_length, params, gen)
        request_id = self.engine.add_request(token_ids, params)
        deltas = TextDeltaStream(params.stop)
        finished = False
        try:
            while not finished and self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.request_id != request_id:
                        continue
                    finished = out.finished
                    error = self.engine.take_error(request_id) if finished else None
                    if error is not None:
                        raise error
                    delta = deltas.update(out.text, out.finished)
                    if delta:
                        yield delta
        finally:
            if not finished:
                self.engine.abort(request_id)

    # ---- helpers --------------------------------------------------------------------------

    def _encode(self, prompt: Prompt) -> list[int]:
        return self.engine.encode(prompt)

    def _prompt_text(self, prompt: Prompt) -> str:
        if isinstance(prompt, str):
            return prompt
        from shardspeed.inference.fastgen.detokenizer import decode

        return decode(self.tokenizer, prompt) if self.tokenizer is not None else ""

    def _params(
        self,
        num_prompt: int,
        max_length: int | None,
        params: SamplingParams | None,
        gen: dict[str, Any],
    ) -> SamplingParams:
        """Validated params of one prompt; applies ``max_length`` and the context check."""
        if params is not None:  # replaces the keywords (max_length included)
            params.validate()
            if params.num_samples > 1:
                raise ValueError(
                    f"Pipeline returns one Response per prompt, but params has n={params.n}, "
                    f"best_of={params.best_of}; use InferenceEngine.generate or the server's "
                    "n / best_of for several samples."
                )
            gen = {"max_new_tokens": params.max_new_tokens, "truncate": params.truncate}
            self._check_context(num_prompt, gen)
            return params
        gen = dict(gen)
        if max_length is not None:
            if gen["max_new_tokens"] is not None:
                raise ValueError(
                    f"Pipeline got max_length={max_length} and max_new_tokens="
                    f"{gen['max_new_tokens']}; pass only one (max_length counts the prompt)."
                )
            if not isinstance(max_length, int) or max_length <= num_prompt:
                raise ValueError(
                    f"max_length={max_length!r} leaves no room after the {num_prompt}-token "
                    f"prompt; pass max_length > {num_prompt} (it counts prompt + new tokens)."
                )
            gen["max_new_tokens"] = max_length - num_prompt
        elif gen["max_new_tokens"] is None:
            gen["max_new_tokens"] = 128
        self._check_context(num_prompt, gen)
        return make_sampling_params(**gen)

    def _check_context(self, num_prompt: int, gen: dict[str, Any]) -> None:
        limit = self.engine.max_seq_len
        total = num_prompt + gen["max_new_tokens"]
        if total > limit and not gen["truncate"]:
            raise ValueError(
                f"prompt ({num_prompt} tokens) + max_new_tokens ({gen['max_new_tokens']}) = "
                f"{total} exceeds the engine's max_seq_len of {limit} tokens; shorten the "
                "prompt, lower max_new_tokens / max_length, or pass truncate=True to stop at "
                "the context length."
            )

    def shutdown(self) -> None:
        """Drop the engine, stopping its tensor-parallel workers (the pipeline is unusable after)."""
        engine = getattr(self, "engine", None)
        if engine is None:
            return
        shutdown = getattr(engine, "shutdown", None)
        if callable(shutdown):
            shutdown()
        self.engine = None  # type: ignore[assignment]

    destroy = shutdown  # MII's name

    @staticmethod
    def _prompt_list(prompts: str | Sequence[Prompt]) -> list[Prompt]:
        if isinstance(prompts, str):
            return [prompts]
        if isinstance(prompts, Sequence) and prompts and all(isinstance(p, int) for p in prompts):
            raise ValueError(
                "pipeline prompts is a flat list of ints; pass a list of token-id lists "
                "(e.g. [[1, 2, 3]]) for token prompts, or strings for text prompts."
            )
        prompt_list = list(prompts)
        if not prompt_list:
            raise ValueError("pipeline prompts is empty; pass a string or a non-empty list.")
        for i, p in enumerate(prompt_list):
            ok = isinstance(p, str) or (isinstance(p, list) and all(isinstance(t, int) for t in p))
            if not ok:
                raise ValueError(
                    f"pipeline prompts[{i}] has type {type(p).__name__}; each prompt must be a "
                    "str or a list[int] of token ids."
                )
        return prompt_list


def pipeline(
    model_or_path: Any, tokenizer: Any = None, quantization: Any = None, **engine_config: Any
) -> Pipeline:
    """Load a model into an :class:`InferenceEngine` and wrap it in a :class:`Pipeline`.

    ``model_or_path`` is anything ``InferenceEngine.from_pretrained`` accepts (a model
    directory, a transformers model, a ShardSpeed GPT) or an already-built engine.
    ``quantization`` (``"int8"``, ``"int4"``, ``"int4-g64-asym"``, a dict of fields or a
    :class:`~shardspeed.inference.quantization.WeightQuantConfig`) quantizes the model's
    linear layers to int8/int4 weights after load (docs/quantization.md).
    ``engine_config`` are :class:`EngineConfig` fields (``block_size``, ``scheduler``,
    ``max_ragged_batch_size``, ...). ``tensor_parallel=T`` shards the model over this
    process and ``T - 1`` spawned workers (token-identical to 1; docs/inference.md,
    "Tensor parallelism"); ``pipeline_parallel=P`` splits the layers over this process
    and ``P - 1`` spawned stages with ``P`` micro-batches in flight (token-identical to 1;
    docs/inference.md, "Pipeline parallelism"); ``expert_parallel=E`` spreads an MoE model's
    experts over this process and ``E - 1`` spawned workers, tokens moved by all-to-all
    (token-identical to 1; docs/inference.md, "Expert parallelism"); :meth:`Pipeline.shutdown`
    stops the workers, as do garbage collection and interpreter exit. Scripts that use it need
    the usual
    ``if __name__ == "__main__":`` guard of spawned processes.
    """
    from shardspeed.inference.fastgen.engine import InferenceEngine

    if quantization is not None:
        engine_config["quantization"] = quantization

    if isinstance(model_or_path, InferenceEngine):
        if tokenizer is not None or engine_config:
            raise ValueError(
                "pipeline() got an InferenceEngine together with tokenizer/engine options "
                f"{sorted(engine_config) or ['tokenizer']}; configure the engine when you build "
                "it, or pass a model instead of an engine."
            )
        return Pipeline(model_or_path)
    return Pipeline(
        InferenceEngine.from_pretrained(model_or_path, tokenizer=tokenizer, **engine_config)
    )
