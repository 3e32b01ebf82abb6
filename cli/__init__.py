"""`dedloc`, the command-line client of dedlocd's control API."""

from .main import main

__all__ = ["main"]
