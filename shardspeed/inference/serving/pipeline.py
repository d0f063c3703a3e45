"""The in-process ``pipeline()`` API (MII's call shape on the FastGen engine).

::

    pipe = pipeline("path/to/model", scheduler="splitfuse")
    responses = pipe(["DeepSpeed is", "Seattle is"], max_new_tokens=64)
    print(responses[0])                     # the generated text
    for delta in pipe.stream("Once upon a time", max_new_tokens=32):
        print(delta, end="")
    pipe.shutdown()

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
    )
    params.validate()
    return params


class Pipeline:
    """Batch and streaming text generation on one :class:`InferenceEngine`."""

    def __init__(self, engine: InferenceEngine) -> None:
        self.engine = engine

    @property
    def tokenizer(self) -> Any:
        """The engine's tokenizer (None when the engine has none)."""
        return self.engine.tokenizer

    def __call__(
        self,
        prompts: str | Sequence[Prompt],
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        repetition_penalty: float = 1.0,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        ignore_eos: bool = False,
        params: SamplingParams | None = None,
    ) -> list[Response]:
        """Generate for one prompt or a list of prompts; returns one Response per prompt.

        Prompts are strings or token-id lists. ``params`` (a :class:`SamplingParams`)
        overrides the individual generation keywords when given.
        """
        prompt_list = self._prompt_list(prompts)
        if params is None:
            params = make_sampling_params(
                max_new_tokens,
                temperature,
                top_k,
                top_p,
                repetition_penalty,
                seed,
                stop,
                ignore_eos,
            )
        else:
            params.validate()
        outputs = self.engine.generate(prompt_list, params)
        return [Response.from_output(p, o) for p, o in zip(prompt_list, outputs, strict=True)]

    def stream(
        self,
        prompt: Prompt,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        repetition_penalty: float = 1.0,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        ignore_eos: bool = False,
        params: SamplingParams | None = None,
    ) -> Iterator[str]:
        """Yield the generated text of one prompt piece by piece as the engine steps.

        The pieces joined equal the text the non-streaming call returns. Closing the
        generator early aborts the request.
        """
        if params is None:
            params = make_sampling_params(
                max_new_tokens,
                temperature,
                top_k,
                top_p,
                repetition_penalty,
                seed,
                stop,
                ignore_eos,
            )
        else:
            params.validate()
        self._prompt_list([prompt])
        request_id = self.engine.add_request(prompt, params)
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

    def shutdown(self) -> None:
        """Abort unfinished requests and drop the engine (the pipeline is unusable after)."""
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


def pipeline(model_or_path: Any, tokenizer: Any = None, **engine_config: Any) -> Pipeline:
    """Load a model into an :class:`InferenceEngine` and wrap it in a :class:`Pipeline`.

    ``model_or_path`` is anything ``InferenceEngine.from_pretrained`` accepts (a model
    directory, a transformers model, a ShardSpeed GPT) or an already-built engine.
    ``engine_config`` are :class:`EngineConfig` fields (``block_size``, ``scheduler``,
    ``max_ragged_batch_size``, ...).
    """
    from shardspeed.inference.fastgen.engine import InferenceEngine

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
