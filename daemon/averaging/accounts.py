"""A reducer's account of each chunk it averaged, and the check every member makes of it. No I/O.

A reducer answers chunk c of its part with one payload, the same bytes to every sender. With it
(in the answer's header, key "v") it now sends its *account*: for every sender i whose
contribution it averaged into that chunk, i's weight w_i, the projections p_ik = <r_k, x_ik> of
the contribution x_i (as the reducer decoded it) onto a sign vector r, one per segment k of the
chunk (`segments`: up to SEGMENTS, each checked apart), and the contribution's L2 norm.
r is derived from a BLAKE3 digest of the answer itself (group, reducer, chunk, meta, payload): it is
fixed only once the answer is, so a reducer cannot shape its answer around it.

A member that receives the answer checks, before it writes anything into its vector:
1. its own entry, if listed: the weight is its weight in the group, the projection and norm are
   those of the chunk it sent (decoded as the reducer decodes it);
2. every entry: a sender of the group, listed once, with its group weight, and a projection no
   larger than Cauchy-Schwarz allows for its norm;
3. the answer's norm: ||y|| <= sum_i q_i ||x_i|| (q_i = w_i / sum w, the triangle inequality),
   up to the answer codec's error and float32 rounding (`norm_bound`): no false alarm at all;
4. the answer against the account, segment by segment: the weighted mean is linear, so an
   honest answer y satisfies <r_k, y_k> = sum_i w_i p_ik / sum_i w_i, up to the answer codec's
   error over the segment (stated per segment) and float32 rounding.

The tolerance of (4) comes from known bounds, not guesses. r's signs are independent of the
errors (a hash of the answer), so by Hoeffding's inequality |<r, e>| > Z * ||e||_2 has
probability at most 2 exp(-Z^2 / 2) (Z = 8: below 3e-14 per segment, 3e-13 per chunk) for an
error vector e. The
errors: the answer codec's, whose norm the reducer states in the account ("e", which must be
within sqrt(n) times twice the codec's per-element bound, codec.py's `error_bound`
evaluated on the decoded answer: a bound evaluated on values within the bound of the originals),
and the float32 weighted mean's, at most (senders + 2) * 2^-24 * sqrt(sum_i q_i ||x_i||^2) with
q_i = w_i / sum w; plus the float64 error of the sums themselves. What the check sees of a wrong
answer y + d is <r, d>, about ||d||_2 times a standard normal: exact answers ("none") are caught
for any d above float32 rounding; with a lossy codec, a chunk passes with probability about
sqrt(2 / pi) * Z * ||e|| / ||d|| (a standard normal within +-Z ||e|| / ||d||), each chunk
independently: not only a d within a few times the codec's error, also a large one now and then
(uint8, an average scaled by 10 with the scaled answer's codec error: 6% of its chunks). (3)
closes that for answers larger than any mean of the contributions (a scaled-up average, a vector
of large norm), whatever the signs. The segments close most of the rest: each has its own signs,
so a d spread over the chunk passes only if it passes in every segment (about the product of the
segments' chances: 0.3 per segment gives 7e-5 per chunk of 8), and a d in one segment is checked
against that segment's codec error alone, never more than the chunk's.

Under the norm-clipped mean (aggregation.py, a run's default) the answer is
sum_i w_i s_i x_i / sum_i w_i with s_i from the norms the account states: a member derives the
same s_i and checks (3) and (4) against the entries scaled by them (`effective`): the bounds are
those of a weighted mean of the scaled contributions (their rounding scales with s_i ||x_i||).

A wrong answer (zeros, a scaled average, a vector of the reducer's choosing, another sender's
contribution dropped or counted twice) with an honest account fails (3) or (4); an account that
misstates the member's own contribution fails (1).

Forged accounts. Every entry but the reducer's own names the digest of the contribution and its
sender's signature of it (signatures.py): a member checks each signature, so the account can only
list what each sender really sent. Each projection must also be within Z times its stated norm
(Hoeffding again: r is independent of an honest contribution, so |<r, x>| <= Z ||x|| but for
3e-14). A reducer that misstates another sender's contribution to make a wrong answer agree
fails that sender's check (1): the sender then shows the others its payload (accusations.py),
which hashes to the digest it signed, and they measure it themselves. The reducer's own entry
names a commitment to its own contribution, r is drawn from the answer and every entry's digest
(`answer_digest`), and members audit sampled segments of it after the round (audits.py). What
remains (docs/security.md): both find a forgery after the others applied the answer.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson
from blake3 import blake3

from .aggregation import Aggregation, clip_scales, l2_norm
from .signatures import DIGEST_HEX, SIGNATURE_HEX, signed_by
from .wire import PeerFault

Z = 8.0  # Hoeffding: P(false alarm per segment) <= 2 exp(-Z^2 / 2) < 3e-14
SEGMENTS = 8  # the most segments of a chunk checked apart (`segments`)
# An answer's header (frames: at most 64 KiB) holds the account: per entry a fixed part (index,
# weight, norm, a digest and a signature in hex: up to ENTRY_BYTES as JSON) and a projection per
# segment (up to PROJECTION_BYTES each); groups hold at most MAX_ACCOUNT_SENDERS senders.
HEADER_BUDGET = 56_000
ENTRY_BYTES = 260
PROJECTION_BYTES = 26
MAX_ACCOUNT_SENDERS = HEADER_BUDGET // (ENTRY_BYTES + PROJECTION_BYTES)
FLOAT32_UNIT = 2.0**-24
FLOAT64_UNIT = 2.0**-53
ACCOUNT_KEY = "v"
# A reducer that aggregates by centered clipping (not linear: no account can check it) says so.
CLIPPED = "centered_clip"


class WrongAverage(PeerFault):
    """A reducer's answer does not match its own account, or its account misstates this member's
    contribution or breaks the group: the answer is not applied and the reducer is an offender."""


class MisstatedContribution(WrongAverage):
    """The account misstates this member's own contribution (its projections or norm; the digest
    is the one it sent): what it sent (`payload`, `meta`), with the account, the answer's digest
    and the reducer's signature of both, once the sender adds them, proves it to the other
    members (accusations.py)."""

    def __init__(self, message: str, chunk: int = -1, payload: Any = None,
                 meta: Mapping[str, Any] | None = None, account: Any = None,
                 answer: bytes | None = None, signature: Any = None) -> None:
        super().__init__(message)
        self.chunk = chunk
        self.payload = payload
        self.meta = meta or {}
        self.account = account
        self.answer = answer
        self.signature = signature


class OlderAccount(PeerFault):
    """The reducer's account is of an older dedloc's format: not an offence (the part stays
    local), a run's peers should run one version."""


@dataclass(frozen=True)
class Entry:
    sender: int
    weight: float
    projections: tuple[float, ...]  # one per segment of the chunk (`segments`)
    norm: float
    digest: str = ""  # hex digest of the contribution as sent (signatures.py); "" for the reducer's
    signature: str = ""  # the sender's hex signature of it; "" for the reducer's own


def segments(n: int, senders: int) -> list[tuple[int, int]]:
    """The (start, end) of the segments of an n-element chunk that an account covers apart, each
    with its own projection and codec error: SEGMENTS, fewer for a short chunk or for so many
    senders that their projections would crowd the answer's header. Reducer and member agree on
    it from what both know."""
    count = max(1, min(SEGMENTS, n, (HEADER_BUDGET // max(senders, 1) - ENTRY_BYTES) // PROJECTION_BYTES))
    bounds = [n * k // count for k in range(count + 1)]
    return list(itertools.pairwise(bounds))


def answer_digest(group_id: str, reducer: int, chunk: int, meta: Mapping[str, Any],
                  payload: Any, contributions: Sequence[str] = ()) -> bytes:
    """The digest (BLAKE3) of an answer that its signs are drawn from (`signs_of`): with the
    digests its account names for the contributions (in the account's order), so that a reducer
    cannot choose its own contribution after the signs (audits.py)."""
    digest = blake3(max_threads=1)
    digest.update(f"dedloc-answer\0{group_id}\0{reducer}\0{chunk}\0".encode())
    digest.update(orjson.dumps(dict(meta), option=orjson.OPT_SORT_KEYS))  # (as JSON carries it)
    digest.update(("\0" + "\0".join(contributions) + "\0").encode())
    digest.update(memoryview(payload).cast("B"))
    return digest.digest()


def signs(group_id: str, reducer: int, chunk: int, meta: Mapping[str, Any], payload: Any,
          n: int) -> np.ndarray:
    """The +-1 vector (float32, n long) that an answer is checked against: SHAKE-128 of a
    BLAKE3 digest of the answer, one bit per element. Any platform and numpy version agree."""
    return signs_of(answer_digest(group_id, reducer, chunk, meta, payload), n)


def signs_of(digest: bytes, n: int) -> np.ndarray:
    """`signs` from the answer's digest."""
    bits = hashlib.shake_128(digest).digest(-(-n // 8))
    unpacked = np.unpackbits(np.frombuffer(bits, np.uint8), count=n, bitorder="little")
    signs_ = unpacked.astype(np.float32)
    signs_ *= 2
    signs_ -= 1
    return signs_


def project(r: np.ndarray, values: np.ndarray, parts: Sequence[tuple[int, int]]) -> tuple[float, ...]:
    """<r, values> over each segment of `parts`, summed in float64. No BLAS: it runs in many
    threads at once, and a threaded BLAS call from each of them oversubscribes the cores
    (measured: 130 ms instead of 0.6 ms for 1M values on 2 cores). The products by +-1 are exact
    in float32."""
    product = np.multiply(values, r)
    return tuple(float(product[a:b].sum(dtype=np.float64)) for a, b in parts)


def measure(r: np.ndarray, values: np.ndarray, parts: Sequence[tuple[int, int]]
            ) -> tuple[tuple[float, ...], float]:
    """(`project`, ||values||_2 as aggregation.l2_norm sums it: the norm a reducer states and
    clips by)."""
    return project(r, values, parts), l2_norm(values)


def codec_errors(decoded: np.ndarray, average: np.ndarray, parts: Sequence[tuple[int, int]]
                 ) -> list[float]:
    """||answer - the float32 mean it encodes||_2 over each segment (the account's "e")."""
    error = decoded.astype(np.float64)
    error -= average
    return [float(np.linalg.norm(error[a:b])) for a, b in parts]


def account_header(entries: Sequence[Entry], errors: Sequence[float]) -> dict[str, Any]:
    """The account as it goes in the answer's header: {"s": [[sender, weight, [projection per
    segment], norm, digest, signature], ...], "e": [||answer - the float32 mean it encodes||_2 per
    segment]}."""
    return {"s": [[e.sender, e.weight, list(e.projections), e.norm, e.digest, e.signature]
                  for e in entries],
            "e": list(errors)}


def _numbers(raw: Any, count: int) -> list[float] | None:
    """`raw` as `count` finite floats, or None."""
    if not isinstance(raw, list) or len(raw) != count or any(
            isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x) for x in raw):
        return None
    return [float(x) for x in raw]


def _hex(raw: Any, length: int) -> bool:
    return isinstance(raw, str) and len(raw) == length and all(c in "0123456789abcdef" for c in raw)


def parse_account(raw: Any, senders: int, parts: int) -> tuple[list[Entry], list[float]]:
    """The entries and the per-segment codec errors of an answer header's account; WrongAverage
    for anything malformed (at most `senders` entries, each a sender index, a weight, `parts`
    projections and a norm, all finite, and a digest and signature, hex text or empty; `parts`
    codec errors, finite and not negative)."""
    if not isinstance(raw, dict) or set(raw) != {"s", "e"}:
        raise WrongAverage("the answer's account is not {\"s\": entries, \"e\": codec errors}")
    errors = _numbers(raw["e"], parts)
    if errors is None or any(e < 0 for e in errors):
        raise WrongAverage(f"the answer's account holds no {parts} finite codec errors")
    raw = raw["s"]
    if not isinstance(raw, list) or len(raw) > senders:
        raise WrongAverage(f"the answer's account is not a list of at most {senders} entries")
    entries = []
    for item in raw:
        if isinstance(item, list) and len(item) == 4:
            raise OlderAccount("the reducer's account has no digests and signatures: it runs an "
                               "older dedloc (a run's peers should run one version)")
        if not isinstance(item, list) or len(item) != 6:
            raise WrongAverage("an account entry is not [sender, weight, projections, norm, digest, "
                               "signature]")
        sender, weight, projections, norm, digest, signature = item
        if isinstance(sender, bool) or not isinstance(sender, int):
            raise WrongAverage("an account entry's sender is not a member index")
        numbers = _numbers([weight, norm], 2)
        projected = _numbers(projections, parts)
        if numbers is None or projected is None:
            raise WrongAverage(f"an account entry holds a non-finite or non-numeric value, or not "
                               f"{parts} projections")
        if not ((_hex(digest, DIGEST_HEX) or digest == "")
                and (_hex(signature, SIGNATURE_HEX) or signature == "")):
            raise WrongAverage("an account entry's digest and signature are not hex text")
        entries.append(Entry(sender, numbers[0], tuple(projected), numbers[1], digest, signature))
    return entries, errors


def tolerance(entries: Sequence[Entry], n: int, codec_error: float, answer_norm: float) -> float:
    """How far <r, answer> over a segment of n elements may honestly be from the account's
    weighted mean (module docstring); the norms are the whole chunk's (at least the segment's)."""
    total = sum(e.weight for e in entries)
    mean_square = sum(e.weight / total * e.norm**2 for e in entries)
    rounding = (len(entries) + 2) * FLOAT32_UNIT * math.sqrt(mean_square)
    sums = n * FLOAT64_UNIT * math.sqrt(n) * (math.sqrt(mean_square) + answer_norm)
    return Z * (codec_error + rounding) + sums


def norm_bound(entries: Sequence[Entry], n: int, codec_error: float) -> float:
    """The largest norm an honest answer can have: ||sum_i q_i x_i|| <= sum_i q_i ||x_i|| (the
    triangle inequality), plus the float32 mean's rounding and the codec's error, plus the float32
    squares and float64 sums that measured the norms (`measure`)."""
    total = sum(e.weight for e in entries)
    mean_square = sum(e.weight / total * e.norm**2 for e in entries)
    rounding = (len(entries) + 2) * FLOAT32_UNIT * math.sqrt(mean_square)
    mean = sum(e.weight / total * e.norm for e in entries)
    return (mean + rounding + codec_error) * (1 + 8 * FLOAT32_UNIT + 2 * n * FLOAT64_UNIT) + 1e-30


def misstates(entry: Entry, projections: Sequence[float], norm: float, n: int,
              margin: float = 1.0) -> bool:
    """Whether `entry` states other projections or another norm than `measure` gives for the
    n-element contribution it names (beyond `margin` times float32 and float64 rounding: sums
    may run in another order on another machine). A judge of another member's accusation uses
    half the margin the accuser used (accusations.py): a reducer cannot state an entry just at
    the edge, where the accuser's sums and the judge's could fall on two sides of it."""
    slack = margin * (n * FLOAT64_UNIT * math.sqrt(n) * norm * 4 + 1e-30)
    return any(abs(stated - p) > slack for stated, p in zip(entry.projections, projections, strict=True)) \
        or abs(entry.norm - norm) > margin * 4 * FLOAT32_UNIT * norm + slack


def effective(entries: Sequence[Entry], aggregation: Aggregation) -> list[Entry]:
    """The entries as the rule weighs them: under `norm_clip`, each contribution's projections
    and norm times its scale s_i (aggregation.clip_scales, from the stated norms), its weight
    unchanged (the answer is sum_i w_i s_i x_i / sum_i w_i). The tolerances then follow as for a
    weighted mean of the scaled contributions: the float32 rounding and float64 sums scale with
    s_i ||x_i||, and the codec's error is the answer's, stated apart."""
    if aggregation == "mean":
        return list(entries)
    scales = clip_scales([e.weight for e in entries], [e.norm for e in entries])
    return [e if s == 1.0 else Entry(e.sender, e.weight, tuple(s * p for p in e.projections), s * e.norm)
            for e, s in zip(entries, scales, strict=True)]


def check_answer(entries: Sequence[Entry], errors: Sequence[float], *, weights: Sequence[float],
                 sends: Sequence[bool], me: int, mine: tuple[Sequence[float], float] | None,
                 answer_projections: Sequence[float], answer_norm: float, answer_bound: float,
                 parts: Sequence[tuple[int, int]], aggregation: Aggregation = "mean") -> None:
    """WrongAverage unless the answer (its projections onto r per segment of `parts`, its norm,
    its codec's per-element bound) agrees with the account under the round's `aggregation`.
    `weights`/`sends`: the group's members; `mine`: this member's own (projections, norm) of the
    chunk it sent, or None if it sent none."""
    n = parts[-1][1]
    sizes = [b - a for a, b in parts]
    seen: set[int] = set()
    for e in entries:
        # (in ascending order, one way only: a reducer cannot reorder its entries for other
        # signs, which come from their digests in this order)
        if not 0 <= e.sender < len(weights) or not sends[e.sender] or e.sender in seen \
                or (seen and e.sender < max(seen)):
            raise WrongAverage(f"the account lists member {e.sender}, which is no sender of the "
                               "group, or is listed twice or out of order")
        seen.add(e.sender)
        if e.weight != weights[e.sender]:
            raise WrongAverage(f"the account gives member {e.sender} weight {e.weight:g}, the "
                               f"group {weights[e.sender]:g}")
        # (Hoeffding: r is independent of a contribution, |<r, x>| <= Z ||x|| but for 3e-14)
        if e.norm < 0 or any(abs(p) > min(math.sqrt(size), Z) * e.norm * (1 + 1e-6) + 1e-30
                             for p, size in zip(e.projections, sizes, strict=True)):
            raise WrongAverage(f"the account's projection for member {e.sender} exceeds what its "
                               "norm allows")
    if not entries:
        raise WrongAverage("an averaged chunk with an empty account")
    for error, size in zip(errors, sizes, strict=True):
        if error > 2.0 * answer_bound * math.sqrt(size):
            raise WrongAverage(f"the account claims a codec error of {error:.3g}, more than the "
                               f"codec allows ({2.0 * answer_bound * math.sqrt(size):.3g})")
    if mine is not None and me in seen \
            and misstates(next(e for e in entries if e.sender == me), *mine, n):
        raise MisstatedContribution("the account misstates this member's own contribution")
    entries = effective(entries, aggregation)
    total = sum(e.weight for e in entries)
    largest = norm_bound(entries, n, math.sqrt(sum(e * e for e in errors)))
    if not answer_norm <= largest:
        raise WrongAverage(f"the answer's norm {answer_norm:.6g} exceeds what a weighted mean of "
                           f"the account's contributions can have ({largest:.6g})")
    for k, (error, size) in enumerate(zip(errors, sizes, strict=True)):
        expected = sum(e.weight * e.projections[k] for e in entries) / total
        allowed = tolerance(entries, size, error, answer_norm)
        if not abs(answer_projections[k] - expected) <= allowed:
            raise WrongAverage(f"the answer's projection {answer_projections[k]:.6g} (segment {k}) "
                               f"differs from the account's weighted mean {expected:.6g} by more "
                               f"than {allowed:.3g}")


def check_signatures(entries: Sequence[Entry], *, peers: Sequence[str], round_: str,
                     reducer: int, chunk: int, me: int, my_digest: bytes | None) -> None:
    """WrongAverage unless every entry but the reducer's own carries its sender's signature of
    the digest it names for this chunk of round `round_` (signatures.round_name: the reducer
    lists only what each sender sent it there), and this member's own entry names the digest of
    what it sent (another one, signed by it for this slot, can only be a chunk of an earlier
    round under a reused id: nothing this member could prove)."""
    for e in entries:
        if e.sender == reducer:  # its own: a commitment (audits.py), which nobody else signs
            if not e.digest:
                raise WrongAverage("the reducer's own entry names no commitment to its contribution")
            continue
        if not 0 <= e.sender < len(peers):
            continue  # (an index out of range fails check_answer)
        if not e.digest or not signed_by(peers[e.sender], round_, reducer, chunk,
                                         bytes.fromhex(e.digest), e.signature):
            raise WrongAverage(f"the account's entry for member {e.sender} does not carry that "
                               "member's signature of the contribution it names")
        if e.sender == me and my_digest is not None and e.digest != my_digest.hex():
            raise WrongAverage("the account names another contribution of this member than the "
                               "one it sent")
