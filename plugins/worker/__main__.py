"""`python -m dedloc.plugins.worker`: the same as the `dedloc-worker` command."""

import sys

from .main import main

sys.exit(main())
