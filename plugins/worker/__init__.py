"""The worker process: serves the worker protocol (docs/worker-protocol.md) for one workload.

`dedloc-worker` (`main`) runs it; `WorkerService` holds the `worker.*` methods. Importing this
package does not import torch; `service` and `session` do.
"""

from .main import main

__all__ = ["main"]
