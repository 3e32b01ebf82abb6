"""dedloc: collaborative deep-learning training over the internet (DeDLOC).

The layers live in `dedloc.rpc`, `dedloc.daemon`, `dedloc.plugins` and `dedloc.cli`.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("dedloc")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
