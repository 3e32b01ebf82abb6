"""Keep hypothesis's cache out of the repository (a stray `.hypothesis/` there breaks collection
under `filterwarnings = error`)."""

from __future__ import annotations

import atexit
import shutil
import tempfile

from hypothesis.configuration import set_hypothesis_home_dir

_home = tempfile.mkdtemp(prefix="dedloc-hypothesis-")
atexit.register(shutil.rmtree, _home, True)
set_hypothesis_home_dir(_home)
