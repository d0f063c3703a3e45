"""benchmarks/serve_vs_vllm.py: the warm-up pass has the timed run's shapes but shares no
prompt prefix with it, so an engine that caches prefixes (vLLM by default) is timed on cold
prompts like one that does not."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import serve_vs_vllm  # noqa: E402


def test_warmup_has_the_shapes_and_no_token_of_the_timed_prompts() -> None:
    for reqs in serve_vs_vllm.requests(0).values():
        warm = serve_vs_vllm.warmup_requests(reqs)
        assert [(len(p), g) for p, g in warm] == [(len(p), g) for p, g in reqs[:2]]
        for wp, _ in warm:
            assert all(3 <= t < serve_vs_vllm.VOCAB for t in wp)
            # a prefix cache works on whole blocks (16 tokens in vLLM and FastGen): no timed
            # prompt starts with any warm-up prompt's first block
            assert all(p[:16] != wp[:16] for p, _ in reqs)
        for (wp, _), (p, _) in zip(warm, reqs, strict=False):
            assert all(a != b for a, b in zip(wp, p, strict=True))
