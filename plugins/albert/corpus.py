"""The text ALBERT pre-trains on: documents of sentences, read lazily from plain-text files.

Sources, by the `data_dir` config key:

- a folder holding WikiText-103 raw files: `wiki.train.raw` is the train split and
  `wiki.valid.raw` the eval split;
- any other folder: every `*.txt` file under it (sorted by path);
- empty: a corpus made at run time from the docstrings of Python's standard library (read from
  the `.py` sources with `ast`, nothing imported, nothing downloaded), written once into the cache
  folder in the WikiText layout.

A document is a run of lines between top-level headings (` = Title = `, WikiText's article
titles) or the start of a file; a document longer than `MAX_DOCUMENT_BYTES` is cut at its next
blank line. Sub-headings (` = = Section = = `) and blank lines end paragraphs; a paragraph's lines
are joined and split into sentences. Only byte offsets are kept in memory: documents are read
when the data pipeline reaches them, so WikiText-103's 500 MB train file costs one scan.

Without an eval file, every `HOLD_OUT_EVERY`-th document of the train files is held out for
eval (the same ones on every peer).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import hashlib
import os
import re
import sys
import sysconfig
import tempfile
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

CORPUS_VERSION = 1
"""Bumped when the built-in corpus or the document rules change (it keys the caches)."""

MAX_DOCUMENT_BYTES = 1 << 20
HOLD_OUT_EVERY = 20
WIKITEXT_TRAIN = "wiki.train.raw"
WIKITEXT_EVAL = "wiki.valid.raw"

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[\"'(\[]?[A-Z0-9])")
_SPACES = re.compile(r"\s+")


@dataclass(frozen=True)
class Document:
    """A byte range of one file."""

    path: str
    start: int
    end: int

    def read(self) -> str:
        with open(self.path, "rb") as file:
            file.seek(self.start)
            return file.read(self.end - self.start).decode("utf-8", errors="replace")

    def sentences(self) -> list[str]:
        return split_sentences(self.read())


@dataclass(frozen=True)
class Corpus:
    """The documents of both splits and a fingerprint of the train text (it keys the tokenizer)."""

    train: tuple[Document, ...]
    eval: tuple[Document, ...]
    fingerprint: str
    source: str

    def split(self, name: str) -> tuple[Document, ...]:
        return self.train if name == "train" else self.eval

    def train_bytes(self) -> int:
        return sum(doc.end - doc.start for doc in self.train)


# --- reading documents ----------------------------------------------------------------------------


def _is_title(stripped: bytes) -> bool:
    return (stripped.startswith(b"= ") and stripped.endswith(b" =") and not stripped.startswith(b"= =")
            and len(stripped) > 4)


def _is_heading(stripped: str | bytes) -> bool:
    equals = "=" if isinstance(stripped, str) else b"="
    return len(stripped) >= 3 and stripped[:1] == equals and stripped[-1:] == equals


def split_sentences(text: str) -> list[str]:
    """The sentences of `text`: paragraphs (runs of non-blank, non-heading lines) split at . ! ?"""
    sentences: list[str] = []
    paragraph: list[str] = []

    def flush() -> None:
        if paragraph:
            joined = _SPACES.sub(" ", " ".join(paragraph)).strip()
            sentences.extend(part for part in _SENTENCE_END.split(joined) if part)
            paragraph.clear()

    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or _is_heading(stripped):
            flush()
        else:
            paragraph.append(stripped)
    flush()
    return sentences


def scan_documents(path: str) -> list[Document]:
    """The documents of one file, as byte ranges (see the module docstring for the rules)."""
    documents: list[Document] = []
    start = offset = 0
    has_text = False
    with open(path, "rb") as file:
        for line in file:
            stripped = line.strip()
            if _is_title(stripped) or (not stripped and has_text
                                       and offset - start >= MAX_DOCUMENT_BYTES):
                if has_text:
                    documents.append(Document(path, start, offset))
                start = offset
                has_text = False
            elif stripped and not _is_heading(stripped):
                has_text = True
            offset += len(line)
    if has_text:
        documents.append(Document(path, start, offset))
    return documents


def _fingerprint(paths: Sequence[str], root: str) -> str:
    digest = hashlib.sha256(f"corpus-v{CORPUS_VERSION}\n".encode())
    for path in paths:
        digest.update(os.path.relpath(path, root).encode() + b"\0")
        with open(path, "rb") as file:
            while chunk := file.read(1 << 20):
                digest.update(chunk)
        digest.update(b"\0")
    return digest.hexdigest()


@functools.lru_cache(maxsize=8)
def _load(train_paths: tuple[str, ...], eval_paths: tuple[str, ...], root: str, source: str,
          _stamp: tuple[tuple[int, int], ...]) -> Corpus:
    train = [doc for path in train_paths for doc in scan_documents(path)]
    if not train:
        raise ValueError(f"no text in {source}")
    if eval_paths:
        held_out = [doc for path in eval_paths for doc in scan_documents(path)]
    else:
        held_out = [doc for index, doc in enumerate(train) if index % HOLD_OUT_EVERY == HOLD_OUT_EVERY - 1]
        if not held_out and len(train) >= 2:
            held_out = [train[-1]]
        if held_out:
            chosen = set(held_out)
            train = [doc for doc in train if doc not in chosen]
    return Corpus(train=tuple(train), eval=tuple(held_out or train),
                  fingerprint=_fingerprint(train_paths, root), source=source)


def _stamp(paths: Sequence[str]) -> tuple[tuple[int, int], ...]:
    stats = [os.stat(path) for path in paths]
    return tuple((stat.st_size, stat.st_mtime_ns) for stat in stats)


def open_corpus(data_dir: str, cache_dir: Path) -> Corpus:
    """The corpus of `data_dir` (see the module docstring), or the built-in one when it is empty."""
    if not data_dir:
        path = str(builtin_corpus(cache_dir))
        return _load((path,), (), str(cache_dir), "the built-in standard-library corpus",
                     _stamp([path]))
    root = Path(data_dir).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"data_dir {data_dir!r} is not a folder")
    if (root / WIKITEXT_TRAIN).is_file():
        train_paths = [str(root / WIKITEXT_TRAIN)]
        eval_paths = [str(root / WIKITEXT_EVAL)] if (root / WIKITEXT_EVAL).is_file() else []
    else:
        train_paths = sorted(str(path) for path in root.rglob("*.txt") if path.is_file())
        eval_paths = []
        if not train_paths:
            raise FileNotFoundError(f"data_dir {data_dir!r} holds neither {WIKITEXT_TRAIN} nor any "
                                    "*.txt file")
    return _load(tuple(train_paths), tuple(eval_paths), str(root), f"data_dir {data_dir!r}",
                 _stamp(train_paths + eval_paths))


# --- the built-in corpus: the standard library's docstrings ---------------------------------------

_SKIPPED_PARTS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3",
                            "turtledemo", "__pycache__", "ensurepip", "pydoc_data"})


def stdlib_sources() -> list[tuple[str, Path]]:
    """(module name, source path) of the standard library's pure-Python modules, sorted by name."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for path in root.rglob("*.py"):
        relative = path.relative_to(root)
        if _SKIPPED_PARTS.intersection(relative.parts) or relative.parts[0].startswith("config-"):
            continue
        parts = list(relative.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        if not parts:
            continue
        name = ".".join(parts)
        if name.split(".")[0] in sys.stdlib_module_names:
            found.append((name, path))
    return sorted(found)


def _prose(paragraph: str) -> str | None:
    """A docstring paragraph as one line of prose, or None when it looks like code or a table."""
    lines = [line for line in paragraph.splitlines()
             if not line.startswith((" ", "\t", ">>>", "...", "$ ", "%"))]
    text = _SPACES.sub(" ", " ".join(lines)).strip().lstrip("=-*# ")
    words = text.split()
    if len(words) < 5:
        return None
    letters = sum(ch.isalpha() or ch.isspace() for ch in text)
    if letters < 0.85 * len(text) or not any(word.islower() for word in words):
        return None
    return text


def _docstrings(path: Path) -> list[str]:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tree = ast.parse(path.read_bytes(), filename=str(path))
    except (SyntaxError, ValueError, OSError):
        return []
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            docstring = ast.get_docstring(node, clean=True)
            if docstring:
                found.append(docstring)
    return found


def builtin_documents() -> Iterator[tuple[str, list[str]]]:
    """(module name, prose paragraphs) of every standard-library module with any, in name order.

    A paragraph seen in an earlier module is left out (the many "Return self==value." and the like).
    """
    seen: set[str] = set()
    for name, path in stdlib_sources():
        paragraphs = []
        for docstring in _docstrings(path):
            for block in re.split(r"\n\s*\n", docstring):
                text = _prose(block)
                if text is not None and text not in seen:
                    seen.add(text)
                    paragraphs.append(text)
        if paragraphs:
            yield name, paragraphs


def builtin_corpus(cache_dir: Path) -> Path:
    """The built-in corpus file in `cache_dir`, written on first use (WikiText layout)."""
    key = hashlib.sha256(f"{CORPUS_VERSION}\n{sys.version}\n{sysconfig.get_paths()['stdlib']}".encode())
    path = cache_dir / f"stdlib-corpus-{key.hexdigest()[:16]}.txt"
    if path.is_file():
        return path
    lines = []
    for name, paragraphs in builtin_documents():
        lines += [f" = {name} = ", ""]
        for paragraph in paragraphs:
            lines += [paragraph, ""]
    write_atomically(path, "\n".join(lines).encode())
    return path


def write_atomically(path: Path, data: bytes) -> None:
    """Write `data` to `path` through a temporary file, so that readers never see half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(data)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
