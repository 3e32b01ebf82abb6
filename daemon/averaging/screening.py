"""Which contributions a reducer accepts: the rules, applied to every chunk after decoding.

A reducer applies them to what a sender delivered once it is decoded (so every codec is covered:
a uint8 or quantile8 payload can describe values that its sender never had):

1. NaN or Inf, a payload of the wrong length, codec meta that does not parse, a chunk out of
   order: refused by the codec and the wire parser (codec.py, wire.py).
2. Hard cap: a chunk holding a value with |x| > `max_value` is rejected.
3. Norm outlier: once at least `MIN_SENDERS` senders delivered a chunk, a sender whose chunk has
   an L2 norm above `max_norm_ratio` times the median norm of the *other* senders' same chunk is
   rejected. The rule is left out when that median is 0 (a chunk that the others all left at
   zero, e.g. rows of an embedding their batches did not touch: a sender whose batch did touch
   them is not an attacker). The reducer's own contribution counts in the others' medians but is
   never rejected (it was checked locally).

With a ratio of 1000 (the default), an honest sender is never rejected in normal training: the
vectors peers average are means (gradients over a batch, parameters), whose norms differ between
honest peers by far less (a gradient over 1 sample against one over 10^4 differs in norm by at most
~100x, sqrt of the batch ratio); a contribution 1000 times the others' median is no gradient of the
same model. The rule needs every contribution of a chunk before it can judge one (a median), so
a reducer that applies it keeps each contribution until the chunk settles rather than a running
sum (reducer.py; the cost is in docs/averaging.md). Below `MIN_SENDERS` senders no median can
outvote anyone: only rules 1 and 2 apply.

A rejected sender is left out of the round (every chunk of it not yet averaged, see reducing.py)
and the rejection is an offence against it (bans.py).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np

from .codec import CompressionError, NonFiniteError
from .wire import PeerFault, ProtocolViolation

MIN_SENDERS = 3

Robust = Literal["none", "centered_clip"]

# What an offence is, for counters and the ban list.
OffenceKind = Literal["nonfinite", "malformed", "too_large", "norm_outlier", "protocol",
                      "wrong_average"]


@dataclass(frozen=True)
class ScreeningPolicy:
    """How a reducer screens and aggregates contributions (the `averaging` config keys)."""

    max_value: float = 1e12
    max_norm_ratio: float = 1000.0  # 0: no norm rule
    robust: Robust = "none"
    clip_radius: float = 2.0
    clip_iterations: int = 3
    check_answers: bool = True  # reducers account for their answers, members check (accounts.py)

    def keeps(self, senders: int) -> bool:
        """Whether a reducer of a round with `senders` senders must keep every contribution of a
        chunk until it settles (the norm rule, clipping, or the account of its answer) rather
        than a running sum."""
        return self.robust != "none" or self.check_answers \
            or (self.max_norm_ratio > 0 and senders >= MIN_SENDERS)


class ContributionRejected(PeerFault):
    """A sender's chunk decoded fine but breaks a rule (the message says which)."""

    def __init__(self, kind: OffenceKind, message: str) -> None:
        super().__init__(message)
        self.kind: OffenceKind = kind


def screen(values: np.ndarray, policy: ScreeningPolicy) -> float:
    """The chunk's L2 norm; ContributionRejected if it holds a value above the hard cap.

    One pass in the usual case: a norm within the cap bounds every value by the cap; only a bigger
    norm (or one that overflowed float32) needs the largest magnitude itself."""
    if not values.size:
        return 0.0
    with np.errstate(over="ignore"):  # a float32 overflow makes the norm inf: judged below
        norm = math.sqrt(float(np.dot(values, values)))
    if not norm <= policy.max_value:
        largest = max(-float(values.min()), float(values.max()))
        if largest > policy.max_value:
            raise ContributionRejected("too_large", f"a value of magnitude {largest:.3g} exceeds the "
                                                    f"cap of {policy.max_value:.3g}")
    return norm


def norm_outliers(norms: Mapping[int, float], ratio: float, *,
                  protected: int | None = None) -> dict[int, str]:
    """The senders whose norm exceeds `ratio` times the median of the others' norms, with why
    (none when fewer than MIN_SENDERS norms, when ratio is 0, or when the others' median is 0)."""
    if ratio <= 0 or len(norms) < MIN_SENDERS:
        return {}
    rejected = {}
    for sender, norm in norms.items():
        if sender == protected:
            continue
        reference = statistics.median(n for s, n in norms.items() if s != sender)
        if reference > 0 and norm > ratio * reference:
            rejected[sender] = (f"chunk norm {norm:.3g} is over {ratio:g} times the median "
                                f"{reference:.3g} of the other senders'")
    return rejected


def offence_kind(error: BaseException) -> OffenceKind | None:
    """What offence an error from a sender's chunk is (None: a fault, not an offence, such as a
    lost link, a stall, a stream closed early)."""
    if isinstance(error, ContributionRejected):
        return error.kind
    if isinstance(error, NonFiniteError):
        return "nonfinite"
    if isinstance(error, CompressionError):
        return "malformed"
    if isinstance(error, ProtocolViolation):
        return "protocol"
    return None
