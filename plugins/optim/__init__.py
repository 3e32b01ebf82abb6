"""Optimizers that several workloads share (torch only; imported by the workloads that use them).

- `lamb`: LAMB (You et al., 2020), for ALBERT; `weight_decay_groups` keeps biases and
  normalisation weights out of weight decay.
- `lars`: LARS (You et al., 2017), for SwAV (imported from `dedloc.plugins.optim.lars`).
"""

from .lamb import Lamb, trust_ratio, weight_decay_groups

__all__ = ["Lamb", "trust_ratio", "weight_decay_groups"]
