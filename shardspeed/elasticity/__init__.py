"""``deepspeed.elasticity``: one global batch size that suits many GPU counts.

An elastic job may be scaled up or down by its scheduler. To keep convergence unchanged the
global batch size must stay fixed, so it has to divide evenly (micro batch * accumulation
steps * data-parallel ranks) at every GPU count the job may get. :func:`compute_elastic_config`
searches for such a batch size from the ds_config's ``"elasticity"`` block (DeepSpeed's
algorithm versions 0.1 and 0.2, removed from DeepSpeed in 0.19.7). ``shardspeed.initialize``
applies it: with an enabled block, the batch keys are computed for the world size (see
``shardspeed.config.elasticity``).

DeepSpeed's ``DSElasticAgent`` (a torchrun agent for its launcher) is not provided: launch
elastic jobs with ``shardspeed --elastic --min_nodes N --max_nodes M`` (torchrun's own
elastic agent on every host, :mod:`shardspeed.launcher.elastic`), and resume in the script
with :func:`shardspeed.runtime.elastic_resume.resume_elastic`.
"""

from __future__ import annotations

from shardspeed.elasticity.config import (
    ElasticityConfig,
    ElasticityConfigError,
    ElasticityError,
    ElasticityIncompatibleWorldSize,
    ElasticityUnknownVersion,
)
from shardspeed.elasticity.constants import ELASTICITY, ENABLED, ENABLED_DEFAULT
from shardspeed.elasticity.elasticity import (
    compute_elastic_config,
    elasticity_enabled,
    ensure_immutable_elastic_config,
)
from shardspeed.elasticity.utils import is_torch_elastic_compatible

__all__ = [
    "ELASTICITY",
    "ENABLED",
    "ENABLED_DEFAULT",
    "ElasticityConfig",
    "ElasticityConfigError",
    "ElasticityError",
    "ElasticityIncompatibleWorldSize",
    "ElasticityUnknownVersion",
    "compute_elastic_config",
    "elasticity_enabled",
    "ensure_immutable_elastic_config",
    "is_torch_elastic_compatible",
]
