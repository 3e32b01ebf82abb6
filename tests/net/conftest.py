"""Real transports on 127.0.0.1 (never any other address), closed after each test.

Hypothesis keeps its cache in a temporary directory: a stray `.hypothesis/` in the repository
breaks collection under `filterwarnings = error`.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from collections.abc import AsyncIterator
from typing import Any

import pytest
from hypothesis.configuration import set_hypothesis_home_dir
from net.netutil import FAST, LOOPBACK

from dedloc.daemon.identity import Identity
from dedloc.daemon.net import TlsTransport, TransportLimits

_home = tempfile.mkdtemp(prefix="dedloc-hypothesis-")
atexit.register(shutil.rmtree, _home, True)
set_hypothesis_home_dir(_home)

@pytest.fixture
async def make_transport() -> AsyncIterator[Any]:
    made: list[TlsTransport] = []

    async def make(*, limits: TransportLimits = FAST, tls: bool = True,
                   identity: Identity | None = None) -> TlsTransport:
        transport = await TlsTransport.start(identity or Identity.generate(), [LOOPBACK],
                                             limits=limits, tls=tls)
        made.append(transport)
        return transport

    yield make
    for transport in made:
        await transport.close()
