"""What a settings field is: a dataclass field with its documentation for users.

Each subsystem defines the settings type it is configured with in its own `settings` module
(daemon/averaging/settings.py, daemon/collab/settings.py, ...); daemon/config.py composes them into
one `Config` and reads each field's `doc` for `--print-default-config` and the documentation.
Subsystems import this module and never daemon/config.py (tests/test_layering.py checks that).
"""

from __future__ import annotations

from dataclasses import field
from typing import Any


def documented(text: str, **kwargs: Any) -> Any:
    """A dataclass field whose `doc` (shown to users) is `text`; kwargs as for `field`."""
    return field(metadata={"doc": text}, **kwargs)
