"""The DHT's wire messages, as pure codecs between `Message` and Python values.

Every request header carries `client` (True: the caller takes no part in routing and must not be
added to routing tables) and `addresses` (where the caller can be dialed). Methods:

- `dht.ping`        {}                                -> {}
- `dht.find_node`   {"target": <64 hex>}              -> {"nodes": [{"peer_id", "addresses"}]}
- `dht.find_value`  {"key": str, "token"?: str,     -> {"nodes": [...], "entries": <count>,
                     "min_expiration"?: float,           "encoding"?: "zlib"},
                     "accept"?: ["zlib"]}               payload = <u32 length><metas JSON><values>,
                     metas = [{"sub_key", "expiration", "signer", "signature": <hex>,
                     "proof"?: str, "size": int}]; with `min_expiration`, only the entries that
                     expire at or after it (a reader that holds the older ones asks for changes);
                     with `accept` naming zlib, a payload over COMPRESS_OVER bytes is compressed
                     (`encoding`), and the reader inflates it to at most MAX_VALUES_BYTES;
                     at most MAX_ENTRIES_IN_REPLY entries. With `"nodes": false` the reply
                     carries no contacts (a reader at a key's remembered nodes needs none). With
                     `"summary": true` it carries no entries either: `"summary": <count>`,
                     payload = per entry the first SUMMARY_DIGEST bytes of the SHA-256 of its
                     sub-key (`sub_key_digest`) and its expiration (float64, big-endian): a
                     reader that asks several nodes reads one in full and the others'
                     summaries, then asks them only for what they hold newer.
                     `"want": [<hex digest>, ...]` limits the entries to those sub-keys.
- `dht.store`       {"key", "sub_key", "expiration", "signer", "signature": <hex>, "proof"?: str},
                     payload = value                  -> {"stored": bool} (False: already held)

Keys under a closed run (`closed/<owner>/<run>/...`) need the reader's membership token
(`token`) and the writer's (`proof`, which stays with the record); see daemon/collab/membership.py.

Values travel in the payload, never in JSON; so do the entries' metadata in a find_value reply,
so that a key with thousands of sub-keys fits (a frame header holds at most 64 KiB). A key that
every peer of a run writes and reads (a run's progress board: 256 reports of about 680 bytes,
read by every peer every few seconds) makes those replies most of the swarm's DHT traffic, and
their field names, peer ids and hex signatures deflate to about a third (zlib level 1, about
1.6 ms for 180 KB); a reader that does not say it accepts zlib gets them as they are, and so
does one whose values do not deflate (a closed run's are ciphertext). A refused
store raises at the server, so the caller gets a RemoteError whose `kind` is the DHT error class
(`ForbiddenWrite`, `BadSignature`, `StaleRecord`, `RecordExpired`, `RecordTooLarge`, `StorageFull`).
"""

from __future__ import annotations

import functools
import hashlib
import math
import re
import struct
import zlib
from dataclasses import dataclass
from typing import Any

import orjson

from ..net.addresses import PeerAddress
from ..net.interface import Message
from .errors import MalformedMessage
from .records import Entry, RecordLimits

PING = "dht.ping"
FIND_NODE = "dht.find_node"
FIND_VALUE = "dht.find_value"
STORE = "dht.store"
MAX_NODES_IN_REPLY = 64
MAX_ADDRESSES_PER_NODE = 8
# Peer ids are about 48 characters and addresses rarely 200: the bounds keep a peer from making us
# base58-decode (quadratic) or cache long texts.
MAX_PEER_ID_CHARS = 128
MAX_ADDRESS_CHARS = 512
ACCEPT = ["zlib"]  # the reply encodings a find_value request says it reads
COMPRESS_OVER = 4096  # a find_value payload larger than this is deflated for a reader that accepts it
# a deflated payload inflates to at most this (a node's reply for one key is bounded by the key's
# record limits, 1 MiB of values and 1024 entries' metadata): more is a bomb
MAX_VALUES_BYTES = 4 * 1024 * 1024
# a node holds at most this many entries of a key: a reply with more is junk (and each entry costs
# its reader a signature check)
MAX_ENTRIES_IN_REPLY = RecordLimits.max_sub_keys
SUMMARY_DIGEST = 8  # bytes of a sub-key's SHA-256 that name it in a summary and a `want`
_SUMMARY_ITEM = struct.Struct(f">{SUMMARY_DIGEST}sd")
_HEX_DIGITS = re.compile(r"[0-9a-fA-F]*")


@dataclass(frozen=True)
class Caller:
    """What a request says about its sender."""

    client: bool
    addresses: tuple[PeerAddress, ...]


@dataclass(frozen=True)
class Contact:
    peer_id: str
    addresses: tuple[PeerAddress, ...]


def _expect(condition: bool, what: str) -> None:
    if not condition:
        raise MalformedMessage(what)


def _is_hex(text: str) -> bool:
    """Only hex digits (int(_, 16) also takes a sign, "0x", "_" and spaces; bytes.fromhex spaces)."""
    return _HEX_DIGITS.fullmatch(text) is not None


_parse_address = functools.lru_cache(maxsize=8192)(PeerAddress.parse)
_address_text = functools.lru_cache(maxsize=8192)(PeerAddress.__str__)


def encode_caller(client: bool, addresses: list[PeerAddress]) -> dict[str, Any]:
    return {"client": client, "addresses": [str(a) for a in addresses[:MAX_ADDRESSES_PER_NODE]]}


def _parse_addresses(raw: Any) -> tuple[PeerAddress, ...]:
    _expect(isinstance(raw, list) and len(raw) <= MAX_ADDRESSES_PER_NODE, "bad address list")
    try:  # every contact of every reply repeats a list: parse each list once
        return _parse_address_list(tuple(raw))
    except TypeError:  # an element that cannot be hashed (a list, an object): not an address
        return _parse_address_list_uncached(raw)


def _parse_address_list_uncached(raw: list[Any] | tuple[Any, ...]) -> tuple[PeerAddress, ...]:
    addresses = []
    for text in raw:
        _expect(isinstance(text, str) and len(text) <= MAX_ADDRESS_CHARS,
                f"an address is not a string of at most {MAX_ADDRESS_CHARS} characters")
        try:
            addresses.append(_parse_address(text))
        except ValueError as exc:
            raise MalformedMessage(str(exc)) from None
    return tuple(addresses)


_parse_address_list = functools.lru_cache(maxsize=8192)(_parse_address_list_uncached)


def decode_caller(header: dict[str, Any]) -> Caller:
    client = header.get("client", False)
    _expect(isinstance(client, bool), "'client' must be a boolean")
    return Caller(client, _parse_addresses(header.get("addresses", [])))


def encode_contacts(contacts: list[Contact]) -> list[dict[str, Any]]:
    return [{"peer_id": c.peer_id,
             "addresses": [_address_text(a) for a in c.addresses[:MAX_ADDRESSES_PER_NODE]]}
            for c in contacts[:MAX_NODES_IN_REPLY]]


def decode_contacts(raw: Any) -> list[Contact]:
    _expect(isinstance(raw, list) and len(raw) <= MAX_NODES_IN_REPLY, "bad node list")
    contacts = []
    for item in raw:
        _expect(isinstance(item, dict) and isinstance(item.get("peer_id"), str)
                and len(item["peer_id"]) <= MAX_PEER_ID_CHARS, "bad node")
        contacts.append(Contact(item["peer_id"], _parse_addresses(item.get("addresses", []))))
    return contacts


def encode_target(target: int) -> str:
    return f"{target:064x}"


def decode_target(header: dict[str, Any]) -> int:
    raw = header.get("target")
    _expect(isinstance(raw, str) and len(raw) == 64 and _is_hex(raw), "'target' must be 64 hex digits")
    try:
        return int(raw, 16)
    except ValueError:
        raise MalformedMessage("'target' must be 64 hex digits") from None


def decode_key(header: dict[str, Any]) -> str:
    key = header.get("key")
    _expect(isinstance(key, str), "'key' must be a string")
    return key


def _entry_meta(entry: Entry) -> dict[str, Any]:
    meta = {"sub_key": entry.sub_key, "expiration": entry.expiration, "signer": entry.signer,
            "signature": entry.signature_hex}
    if entry.proof is not None:
        meta["proof"] = entry.proof
    return meta


def _decode_entry(key: str, meta: Any, value: bytes) -> Entry:
    _expect(isinstance(meta, dict), "an entry is not an object")
    sub_key, expiration = meta.get("sub_key"), meta.get("expiration")
    signer, signature = meta.get("signer"), meta.get("signature")
    proof = meta.get("proof")
    _expect(proof is None or isinstance(proof, str), "'proof' must be a string or null")
    _expect(sub_key is None or isinstance(sub_key, str), "'sub_key' must be a string or null")
    _expect(isinstance(expiration, int | float) and not isinstance(expiration, bool)
            and math.isfinite(expiration), "'expiration' must be a number")
    _expect(isinstance(signer, str) and len(signer) <= MAX_PEER_ID_CHARS, "'signer' must be a peer id")
    _expect(isinstance(signature, str) and len(signature) == 128 and _is_hex(signature),
            "'signature' must be 128 hex digits")
    try:
        signature_bytes = bytes.fromhex(signature)
    except ValueError:
        raise MalformedMessage("'signature' must be hex") from None
    return Entry(key, sub_key, value, float(expiration), signer, signature_bytes, proof)


def encode_store(entry: Entry, caller: dict[str, Any]) -> Message:
    return Message({**caller, "key": entry.key, **_entry_meta(entry)}, entry.value)


def decode_store(message: Message) -> Entry:
    return _decode_entry(decode_key(message.header), message.header, bytes(message.payload))


def accepts_zlib(header: dict[str, Any]) -> bool:
    """Whether a find_value request says it reads a deflated reply."""
    accept = header.get("accept")
    return isinstance(accept, list) and "zlib" in accept


def encode_values(entries: list[Entry], contacts: list[Contact], *, compress: bool = False) -> Message:
    """A find_value reply; with `compress` (the reader accepts zlib), its payload deflated when
    it is over COMPRESS_OVER bytes."""
    metas = orjson.dumps([{**_entry_meta(e), "size": len(e.value)} for e in entries])
    header: dict[str, Any] = {"nodes": encode_contacts(contacts), "entries": len(entries)}
    payload = b"".join((struct.pack(">I", len(metas)), metas, *(e.value for e in entries)))
    if compress and len(payload) > COMPRESS_OVER and _values_deflate(entries):
        header["encoding"] = "zlib"
        payload = zlib.compress(payload, 1)
    return Message(header, payload)


def _values_deflate(entries: list[Entry]) -> bool:
    """Whether the entries' values are worth deflating, judged on their first 4 KiB: a closed
    run's values are ciphertext (a 256-report board deflated to 0.83 of itself in 5.9 ms)."""
    sample, size = [], 0
    for entry in entries:
        sample.append(entry.value)
        size += len(entry.value)
        if size >= COMPRESS_OVER:
            break
    data = b"".join(sample)[:COMPRESS_OVER]
    return len(zlib.compress(data, 1)) < 0.7 * len(data)


def _inflate(data: memoryview) -> bytes:
    inflater = zlib.decompressobj()
    try:
        inflated = inflater.decompress(data, MAX_VALUES_BYTES)
    except zlib.error as exc:
        raise MalformedMessage(f"a deflated reply that does not inflate: {exc}") from None
    if inflater.unconsumed_tail or inflater.unused_data or not inflater.eof:
        raise MalformedMessage(f"a deflated reply that inflates past {MAX_VALUES_BYTES} bytes "
                               "or is cut short")
    return inflated


def decode_min_expiration(header: dict[str, Any]) -> float | None:
    raw = header.get("min_expiration")
    if raw is None:
        return None
    _expect(isinstance(raw, int | float) and not isinstance(raw, bool) and math.isfinite(raw),
            "'min_expiration' must be a number")
    return float(raw)


@functools.lru_cache(maxsize=8192)
def sub_key_digest(sub_key: str | None) -> bytes:
    """What names a sub-key (None: the plain value) in a summary and a `want`."""
    text = b"\x00" if sub_key is None else b"\x01" + sub_key.encode()
    return hashlib.sha256(text).digest()[:SUMMARY_DIGEST]


def encode_summary(entries: list[Entry]) -> Message:
    """A find_value reply that names the entries held (sub-key digest, expiration), not their values."""
    payload = b"".join(_SUMMARY_ITEM.pack(sub_key_digest(e.sub_key), e.expiration) for e in entries)
    return Message({"nodes": [], "entries": 0, "summary": len(entries)}, payload)


def is_summary(message: Message) -> bool:
    return "summary" in message.header


def decode_summary(message: Message) -> dict[bytes, float]:
    """A summary reply: the newest expiration held per sub-key digest."""
    count = message.header.get("summary")
    _expect(isinstance(count, int) and not isinstance(count, bool)
            and 0 <= count <= MAX_ENTRIES_IN_REPLY, f"'summary' must count at most "
            f"{MAX_ENTRIES_IN_REPLY} entries")
    payload = bytes(message.payload)
    _expect(len(payload) == count * _SUMMARY_ITEM.size, "a summary's payload does not match its count")
    held: dict[bytes, float] = {}
    for digest, expiration in _SUMMARY_ITEM.iter_unpack(payload):
        _expect(math.isfinite(expiration), "a summary's expiration must be a number")
        held[digest] = max(expiration, held.get(digest, expiration))
    return held


def encode_want(digests: list[bytes]) -> list[str]:
    return [digest.hex() for digest in digests[:MAX_ENTRIES_IN_REPLY]]


def decode_want(header: dict[str, Any]) -> frozenset[bytes] | None:
    raw = header.get("want")
    if raw is None:
        return None
    _expect(isinstance(raw, list) and len(raw) <= MAX_ENTRIES_IN_REPLY,
            f"'want' must list at most {MAX_ENTRIES_IN_REPLY} digests")
    digests = []
    for text in raw:
        _expect(isinstance(text, str) and len(text) == 2 * SUMMARY_DIGEST and _is_hex(text),
                f"a 'want' digest must be {2 * SUMMARY_DIGEST} hex digits")
        digests.append(bytes.fromhex(text))
    return frozenset(digests)


def decode_flag(header: dict[str, Any], name: str, default: bool) -> bool:
    value = header.get(name, default)
    _expect(isinstance(value, bool), f"'{name}' must be a boolean")
    return value


def decode_values(key: str, message: Message, *,
                  contacts: bool = True) -> tuple[list[Entry], list[Contact]]:
    header, payload = message.header, memoryview(message.payload)
    count = header.get("entries", 0)
    _expect(isinstance(count, int) and not isinstance(count, bool) and count >= 0,
            "'entries' must be a count")
    _expect(count <= MAX_ENTRIES_IN_REPLY, f"more than {MAX_ENTRIES_IN_REPLY} entries in a reply")
    encoding = header.get("encoding")
    if encoding is not None:  # (after the cheap checks: inflating costs CPU)
        _expect(encoding == "zlib", "'encoding' must be zlib (the only one a request accepts)")
        payload = memoryview(_inflate(payload))
    nodes = decode_contacts(header.get("nodes", [])) if contacts else []
    if count == 0 and not payload:
        return [], nodes
    _expect(len(payload) >= 4, "payload too short for its entries")
    (size,) = struct.unpack(">I", payload[:4])
    _expect(size <= len(payload) - 4, "entries' metadata longer than the payload")
    try:
        metas = orjson.loads(payload[4 : 4 + size])
    except orjson.JSONDecodeError as exc:
        raise MalformedMessage(f"entries' metadata is not JSON: {exc}") from None
    _expect(isinstance(metas, list) and len(metas) == count, "'entries' does not match its metadata")
    entries, offset = [], 4 + size
    for meta in metas:
        size = meta.get("size") if isinstance(meta, dict) else None
        if not isinstance(size, int) or not 0 <= size <= len(payload) - offset:
            raise MalformedMessage("bad entry size")
        entries.append(_decode_entry(key, meta, bytes(payload[offset : offset + size])))
        offset += size
    _expect(offset == len(payload), "payload longer than its entries")
    return entries, nodes
