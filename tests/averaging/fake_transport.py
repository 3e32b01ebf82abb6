"""A transport that only records the handlers a service registers, for calling them directly in
tests (accusations, audits, answer summaries, witness sketches)."""

from __future__ import annotations

from typing import Any


class HandlerTransport:
    def __init__(self, peer_id: str, identity: Any = None) -> None:
        self.peer_id = peer_id
        if identity is not None:  # (as a TlsTransport has: the matchmaker then checks signatures)
            self.identity = identity
        self.handlers: dict[str, Any] = {}
        self.stream_handlers: dict[str, Any] = {}

    def add_unary_handler(self, method: str, handler: Any) -> None:
        self.handlers[method] = handler

    def add_stream_handler(self, method: str, handler: Any) -> None:
        self.stream_handlers[method] = handler
