"""ZeRO++ for stage 3: quantized weight all-gather (qwZ), a node-local secondary weight
partition for backward gathers (hpZ), and a quantized hierarchical gradient reduction (qgZ).

* :mod:`~shardspeed.zero.zeropp.quantize`: symmetric block-wise int8 / int4 quantization
  (pure tensor math, the error bound in one place);
* :mod:`~shardspeed.zero.zeropp.groups`: the hpZ and qgZ process groups over the data axis;
* :mod:`~shardspeed.zero.zeropp.weights`: the weight gathers (quantized, from the
  secondary partition) a :class:`~shardspeed.zero.residency.GatheredResidency` runs;
* :mod:`~shardspeed.zero.zeropp.grads`: :class:`QuantizedReduction`, the qgZ
  :class:`~shardspeed.zero.grad_reduction.GradReduction`.

See ``docs/zeropp.md`` for the design, the error bounds and the measured bytes.
"""

from shardspeed.zero.zeropp.policy import ZeroPPPolicy

__all__ = ["ZeroPPPolicy"]
