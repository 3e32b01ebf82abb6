"""Logging set-up for the daemon process: structlog, JSON lines when not on a terminal.

Only the program's entry point calls `configure_logging`; library code just logs.
"""

from __future__ import annotations

import logging
import sys
from typing import Literal

import orjson
import structlog


def _orjson_dumps(event: object, **_: object) -> str:
    return orjson.dumps(event, default=str).decode()


def configure_logging(level: str = "info", fmt: Literal["auto", "json", "console"] = "auto") -> None:
    use_json = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    shared: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: structlog.typing.Processor
    if use_json:
        renderer = structlog.processors.JSONRenderer(serializer=_orjson_dumps)
        shared.append(structlog.processors.dict_tracebacks)
    else:
        renderer = structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
    ))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
