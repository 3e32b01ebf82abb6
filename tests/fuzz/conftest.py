"""Settings of the fuzz tests (hypothesis), and hypothesis's files kept out of the repository.

`make test` runs every fuzz test with the "dedloc-fuzz" profile: a bounded number of examples per
test (the whole folder stays under a minute), no deadline (the machine is shared), and in CI
(`CI` set) the same examples every run and no example database. To fuzz longer locally:

    DEDLOC_FUZZ_EXAMPLES=20000 .venv/bin/python -m pytest -q tests/fuzz

Locally, failing examples are remembered in a database under the temporary directory (never a
`.hypothesis/` in the repository), so a rerun tries them first. Tests that each example talks to
a real daemon use `fuzz_settings(scale=...)` to run a fraction of the examples.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile

from fuzz.fuzzutil import register_profile
from hypothesis.configuration import set_hypothesis_home_dir

_home = tempfile.mkdtemp(prefix="dedloc-hypothesis-")
atexit.register(shutil.rmtree, _home, True)
set_hypothesis_home_dir(_home)
register_profile()
