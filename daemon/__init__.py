"""dedlocd, the peer daemon: identity, control API, workers, runs (and, later, the network).

It never imports torch: tensors are flat numpy buffers in shared memory.
"""

from .config import Config, load_config
from .errors import DaemonError
from .node import Node

__all__ = ["Config", "DaemonError", "Node", "load_config"]
