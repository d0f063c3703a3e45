"""DeepSpeed-MII's API on ShardSpeed: an MII script ports by changing its import.

::

    from shardspeed import mii                      # was: import mii

    pipe = mii.pipeline("path/to/model")
    responses = pipe(["DeepSpeed is", "Seattle is"], max_new_tokens=64)
    print(responses[0].generated_text, responses[0].finish_reason)

    client = mii.serve("path/to/model", deployment_name="demo")
    responses = client.generate(["DeepSpeed is"], max_new_tokens=32)
    mii.client("demo").terminate_server()

``pipeline`` runs in-process (:class:`MIIPipeline`); ``serve`` starts ShardSpeed's
OpenAI-compatible server in a background thread of this process and returns an
:class:`MIIClient` talking to it over HTTP. Generation keywords and their defaults
are MII's (``do_sample=True``, ``top_p=0.9``, generation up to ``max_length`` = the
model's context unless ``max_new_tokens`` is given, ``return_full_text=False``).
"""

from __future__ import annotations

from shardspeed.mii.client import MIIClient, client, serve, terminate_server
from shardspeed.mii.pipeline import MIIPipeline, pipeline

__all__ = ["MIIClient", "MIIPipeline", "client", "pipeline", "serve", "terminate_server"]
