"""Fixtures of the ALBERT tests: one cache folder for the whole run (the built-in corpus and its
tokenizer are made once, whichever test process comes first, and read by the others), the tiny
preset's config and its tokenizer."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from dedloc.plugins.albert import ALBERT
from dedloc.plugins.albert.corpus import Corpus, open_corpus
from dedloc.plugins.albert.tokenizer import Vocabulary, load_vocabulary
from dedloc.plugins.albert.workload import settings


@pytest.fixture(scope="session")
def albert_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One folder for every test process of the run (pytest-xdist's workers share their base
    temporary folder's parent): building the corpus and the tokenizer takes 10-20 s of CPU."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return tmp_path_factory.mktemp("albert-cache")
    shared = tmp_path_factory.getbasetemp().parent / "albert-cache"
    shared.mkdir(exist_ok=True)
    return shared


@contextmanager
def _building(cache: Path) -> Iterator[None]:
    """While one process builds into `cache`, the others wait, then read what it built."""
    with open(cache / ".building", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def tiny_config(albert_cache: Path) -> dict[str, Any]:
    """albert-tiny on the built-in corpus, cached in the session's folder."""
    return ALBERT.resolve_config({"preset": "albert-tiny", "cache_dir": str(albert_cache)})


@pytest.fixture(scope="session")
def builtin_corpus(albert_cache: Path) -> Corpus:
    with _building(albert_cache):
        return open_corpus("", albert_cache)


@pytest.fixture(scope="session")
def tiny_vocab(tiny_config: dict[str, Any], builtin_corpus: Corpus, albert_cache: Path) -> Vocabulary:
    resolved = settings(tiny_config)
    with _building(albert_cache):
        return load_vocabulary(builtin_corpus, resolved.vocab_size, "", resolved.cache_dir)
