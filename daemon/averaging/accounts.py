"""A reducer's account of each chunk it averaged, and the check every member makes of it. No I/O.

A reducer answers chunk c of its part with one payload, the same bytes to every sender. With it
(in the answer's header, key "v") it now sends its *account*: for every sender i whose
contribution it averaged into that chunk, i's weight w_i, the projection p_i = <r, x_i> of the
contribution x_i (as the reducer decoded it) onto a sign vector r, and the contribution's L2 norm.
r is derived from a SHA-256 of the answer itself (group, reducer, chunk, meta, payload): it is
fixed only once the answer is, so a reducer cannot shape its answer around it.

A member that receives the answer checks, before it writes anything into its vector:
1. its own entry, if listed: the weight is its weight in the group, the projection and norm are
   those of the chunk it sent (decoded as the reducer decodes it);
2. every entry: a sender of the group, listed once, with its group weight, and a projection no
   larger than Cauchy-Schwarz allows for its norm;
3. the answer's norm: ||y|| <= sum_i q_i ||x_i|| (q_i = w_i / sum w, the triangle inequality),
   up to the answer codec's error and float32 rounding (`norm_bound`): no false alarm at all;
4. the answer against the account: the weighted mean is linear, so an honest answer y satisfies
   <r, y> = sum_i w_i p_i / sum_i w_i, up to the answer codec's error and float32 rounding.

The tolerance of (4) comes from known bounds, not guesses. r's signs are independent of the
errors (a hash of the answer), so by Hoeffding's inequality |<r, e>| > Z * ||e||_2 has
probability at most 2 exp(-Z^2 / 2) (Z = 8: below 3e-14 per chunk) for an error vector e. The
errors: the answer codec's, whose norm the reducer states in the account ("e", which must be
within sqrt(n) times twice the codec's per-element bound, compression.py's `error_bound`
evaluated on the decoded answer: a bound evaluated on values within the bound of the originals),
and the float32 weighted mean's, at most (senders + 2) * 2^-24 * sqrt(sum_i q_i ||x_i||^2) with
q_i = w_i / sum w; plus the float64 error of the sums themselves. What the check sees of a wrong
answer y + d is <r, d>, about ||d||_2 times a standard normal: exact answers ("none") are caught
for any d above float32 rounding; with a lossy codec, a chunk passes with probability about
sqrt(2 / pi) * Z * ||e|| / ||d|| (a standard normal within +-Z ||e|| / ||d||), each chunk
independently: not only a d within a few times the codec's error, also a large one now and then
(uint8, an average scaled by 10 with the scaled answer's codec error: 6% of its chunks). (3)
closes that for answers larger than any mean of the contributions (a scaled-up average, a vector
of large norm), whatever the signs.

A wrong answer (zeros, a scaled average, a vector of the reducer's choosing, another sender's
contribution dropped or counted twice) with an honest account fails (3) or (4); an account that
misstates the member's own contribution fails (1). Not covered (docs/security.md): a reducer that
also forges its account, the projection of its own contribution or of another sender's; closing
that needs signed contribution hashes and a dispute step.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .wire import PeerFault

Z = 8.0  # Hoeffding: P(false alarm per chunk) <= 2 exp(-Z^2 / 2) < 3e-14
FLOAT32_UNIT = 2.0**-24
FLOAT64_UNIT = 2.0**-53
ACCOUNT_KEY = "v"
# A reducer that aggregates by centered clipping (not linear: no account can check it) says so.
CLIPPED = "centered_clip"


class WrongAverage(PeerFault):
    """A reducer's answer does not match its own account, or its account misstates this member's
    contribution or breaks the group: the answer is not applied and the reducer is an offender."""


@dataclass(frozen=True)
class Entry:
    sender: int
    weight: float
    projection: float
    norm: float


def signs(group_id: str, reducer: int, chunk: int, meta: Mapping[str, Any], payload: Any,
          n: int) -> np.ndarray:
    """The +-1 vector (float32, n long) that an answer is checked against: SHAKE-128 of a
    SHA-256 of the answer, one bit per element. Any platform and numpy version agree."""
    digest = hashlib.sha256()
    digest.update(f"dedloc-answer\0{group_id}\0{reducer}\0{chunk}\0".encode())
    digest.update(repr(sorted(meta.items())).encode())
    digest.update(memoryview(payload).cast("B"))
    bits = hashlib.shake_128(digest.digest()).digest(-(-n // 8))
    unpacked = np.unpackbits(np.frombuffer(bits, np.uint8), count=n, bitorder="little")
    signs_ = unpacked.astype(np.float32)
    signs_ *= 2
    signs_ -= 1
    return signs_


def measure(r: np.ndarray, values: np.ndarray) -> tuple[float, float]:
    """(<r, values>, ||values||_2), summed in float64. No BLAS: it runs in many threads at once,
    and a threaded BLAS call from each of them oversubscribes the cores (measured: 130 ms instead
    of 0.6 ms for 1M values on 2 cores). The products by +-1 are exact in float32; the squares
    are off by at most 2^-24 each, relative."""
    product = np.multiply(values, r)
    projection = float(product.sum(dtype=np.float64))
    np.multiply(values, values, out=product)
    return projection, math.sqrt(float(product.sum(dtype=np.float64)))


def account_header(entries: Sequence[Entry], codec_error: float) -> dict[str, Any]:
    """The account as it goes in the answer's header: {"s": [[sender, weight, projection, norm],
    ...], "e": ||answer - the float32 mean it encodes||_2}."""
    return {"s": [[e.sender, e.weight, e.projection, e.norm] for e in entries], "e": codec_error}


def parse_account(raw: Any, senders: int) -> tuple[list[Entry], float]:
    """The entries and the codec error of an answer header's account; WrongAverage for anything
    malformed (at most `senders` entries, each a sender index and three finite numbers)."""
    if not isinstance(raw, dict) or set(raw) != {"s", "e"}:
        raise WrongAverage("the answer's account is not {\"s\": entries, \"e\": codec error}")
    codec_error = raw["e"]
    if isinstance(codec_error, bool) or not isinstance(codec_error, int | float) \
            or not 0 <= codec_error < math.inf:
        raise WrongAverage("the answer's account holds no finite codec error")
    raw = raw["s"]
    if not isinstance(raw, list) or len(raw) > senders:
        raise WrongAverage(f"the answer's account is not a list of at most {senders} entries")
    entries = []
    for item in raw:
        if not isinstance(item, list) or len(item) != 4:
            raise WrongAverage("an account entry is not [sender, weight, projection, norm]")
        sender, *numbers = item
        if isinstance(sender, bool) or not isinstance(sender, int):
            raise WrongAverage("an account entry's sender is not a member index")
        if any(isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x)
               for x in numbers):
            raise WrongAverage("an account entry holds a non-finite or non-numeric value")
        weight, projection, norm = (float(x) for x in numbers)
        entries.append(Entry(sender, weight, projection, norm))
    return entries, float(codec_error)


def tolerance(entries: Sequence[Entry], n: int, codec_error: float, answer_norm: float) -> float:
    """How far <r, answer> may honestly be from the account's weighted mean (module docstring)."""
    total = sum(e.weight for e in entries)
    mean_square = sum(e.weight / total * e.norm**2 for e in entries)
    codec = codec_error
    rounding = (len(entries) + 2) * FLOAT32_UNIT * math.sqrt(mean_square)
    sums = n * FLOAT64_UNIT * math.sqrt(n) * (math.sqrt(mean_square) + answer_norm)
    return Z * (codec + rounding) + sums


def norm_bound(entries: Sequence[Entry], n: int, codec_error: float) -> float:
    """The largest norm an honest answer can have: ||sum_i q_i x_i|| <= sum_i q_i ||x_i|| (the
    triangle inequality), plus the float32 mean's rounding and the codec's error, plus the float32
    squares and float64 sums that measured the norms (`measure`)."""
    total = sum(e.weight for e in entries)
    mean_square = sum(e.weight / total * e.norm**2 for e in entries)
    rounding = (len(entries) + 2) * FLOAT32_UNIT * math.sqrt(mean_square)
    mean = sum(e.weight / total * e.norm for e in entries)
    return (mean + rounding + codec_error) * (1 + 8 * FLOAT32_UNIT + 2 * n * FLOAT64_UNIT) + 1e-30


def check_answer(entries: Sequence[Entry], codec_error: float, *, weights: Sequence[float],
                 sends: Sequence[bool], me: int, mine: tuple[float, float] | None, answer_projection: float,
                 answer_norm: float, answer_bound: float, n: int) -> None:
    """WrongAverage unless the answer (its projection onto r, its norm, its codec's per-element
    bound) agrees with the account. `weights`/`sends`: the group's members; `mine`: this member's
    own (projection, norm) of the chunk it sent, or None if it sent none."""
    seen: set[int] = set()
    for e in entries:
        if not 0 <= e.sender < len(weights) or not sends[e.sender] or e.sender in seen:
            raise WrongAverage(f"the account lists member {e.sender}, which is no sender of the "
                               "group or is listed twice")
        seen.add(e.sender)
        if e.weight != weights[e.sender]:
            raise WrongAverage(f"the account gives member {e.sender} weight {e.weight:g}, the "
                               f"group {weights[e.sender]:g}")
        if e.norm < 0 or abs(e.projection) > math.sqrt(n) * e.norm * (1 + 1e-6) + 1e-30:
            raise WrongAverage(f"the account's projection for member {e.sender} exceeds what its "
                               "norm allows")
    if not entries:
        raise WrongAverage("an averaged chunk with an empty account")
    if codec_error > 2.0 * answer_bound * math.sqrt(n):
        raise WrongAverage(f"the account claims a codec error of {codec_error:.3g}, more than the "
                           f"codec allows ({2.0 * answer_bound * math.sqrt(n):.3g})")
    if mine is not None and me in seen:
        own = next(e for e in entries if e.sender == me)
        projection, norm = mine
        slack = n * FLOAT64_UNIT * math.sqrt(n) * norm * 4 + 1e-30
        if abs(own.projection - projection) > slack \
                or abs(own.norm - norm) > 4 * FLOAT32_UNIT * norm + slack:
            raise WrongAverage("the account misstates this member's own contribution")
    total = sum(e.weight for e in entries)
    largest = norm_bound(entries, n, codec_error)
    if not answer_norm <= largest:
        raise WrongAverage(f"the answer's norm {answer_norm:.6g} exceeds what a weighted mean of "
                           f"the account's contributions can have ({largest:.6g})")
    expected = sum(e.weight * e.projection for e in entries) / total
    allowed = tolerance(entries, n, codec_error, answer_norm)
    if not abs(answer_projection - expected) <= allowed:
        raise WrongAverage(f"the answer's projection {answer_projection:.6g} differs from the "
                           f"account's weighted mean {expected:.6g} by more than {allowed:.3g}")
