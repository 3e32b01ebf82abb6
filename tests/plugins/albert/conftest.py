"""Fixtures of the ALBERT tests: one cache folder per session (the built-in corpus and its tokenizer
are made once), the tiny preset's config and its tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dedloc.plugins.albert import ALBERT
from dedloc.plugins.albert.corpus import Corpus, open_corpus
from dedloc.plugins.albert.tokenizer import Vocabulary, load_vocabulary
from dedloc.plugins.albert.workload import settings


@pytest.fixture(scope="session")
def albert_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("albert-cache")


@pytest.fixture(scope="session")
def tiny_config(albert_cache: Path) -> dict[str, Any]:
    """albert-tiny on the built-in corpus, cached in the session's folder."""
    return ALBERT.resolve_config({"preset": "albert-tiny", "cache_dir": str(albert_cache)})


@pytest.fixture(scope="session")
def builtin_corpus(albert_cache: Path) -> Corpus:
    return open_corpus("", albert_cache)


@pytest.fixture(scope="session")
def tiny_vocab(tiny_config: dict[str, Any], builtin_corpus: Corpus) -> Vocabulary:
    resolved = settings(tiny_config)
    return load_vocabulary(builtin_corpus, resolved.vocab_size, "", resolved.cache_dir)
