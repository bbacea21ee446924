"""The training corpus: the running interpreter's standard library, as bytes.

Selection rule (recorded in the model card), ``selection="stdlib-v2"`` (the default):

* every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]``, recursively, skipping the directories
  ``site-packages``, ``dist-packages`` and ``__pycache__`` and every path with a component named
  ``test``, ``tests`` or ``idle_test`` (the regression suites: large, repetitive, often deliberately
  malformed), and skipping two kinds of generated file: the codec tables made by ``gencodec.py``
  (files that begin with a docstring opening ``Python Character Mapping Codec``) and
  ``pydoc_data/topics.py``;
* every topic of ``pydoc_data.topics.topics`` as its own document, named ``pydoc_data/topics/<key>``
  (the text of ``pydoc_data/topics.py``, once, as prose).

``selection="stdlib-v1"`` is the bundled model's training data: the same rule without the two
generated-file skips, so the codec tables and ``pydoc_data/topics.py`` are documents too. Under it
the text of every pydoc topic is in the training split through ``pydoc_data/topics.py``, including
the topics held out as their own documents.

Documents are ordered by name (relative POSIX path); each is followed by ``<eos>``. A document is
held out when the first 8 bytes of ``sha256(name)``, read big-endian, are ``% 100 < held_out_percent``
(whole files, deterministic, independent of the file list).
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

import attrs
import torch

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
_TEST_DIRS = {"test", "tests", "idle_test"}
_SKIP_FILES = {"pydoc_data/topics.py"}  # included as its topics instead
_GENERATED_CODEC = b'""" Python Character Mapping Codec'
STDLIB_V1 = "stdlib-v1"  # the bundled model's data: generated files included
STDLIB_V2 = "stdlib-v2"  # generated codec tables and pydoc_data/topics.py skipped
SELECTIONS = (STDLIB_V2, STDLIB_V1)
DEFAULT_SELECTION = STDLIB_V2


@attrs.frozen
class Document:
    name: str  # relative POSIX path, or pydoc_data/topics/<key>
    data: bytes


@attrs.frozen
class Corpus:
    train: torch.Tensor  # [N] int64 token ids (bytes and <eos>)
    held_out: torch.Tensor  # [M] int64
    train_names: tuple[str, ...]
    held_out_names: tuple[str, ...]


def _check_selection(selection: str) -> None:
    if selection not in SELECTIONS:
        raise ValueError(f"unknown corpus selection {selection!r}; expected one of {', '.join(SELECTIONS)}")


def stdlib_documents(selection: str = DEFAULT_SELECTION) -> list[Document]:
    _check_selection(selection)
    skip_generated = selection != STDLIB_V1
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).parts
        name = "/".join(parts)
        if set(parts[:-1]) & (_SKIP_DIRS | _TEST_DIRS) or (skip_generated and name in _SKIP_FILES):
            continue
        data = path.read_bytes()
        if skip_generated and data.startswith(_GENERATED_CODEC):
            continue
        docs.append(Document(name=name, data=data))
    import pydoc_data.topics

    for key, text in pydoc_data.topics.topics.items():
        docs.append(Document(name=f"pydoc_data/topics/{key}", data=text.encode("utf-8")))
    return sorted(docs, key=lambda d: d.name)


def is_held_out(name: str, percent: int) -> bool:
    digest = hashlib.sha256(name.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % 100 < percent


def _tokens(docs: list[Document], eos_id: int) -> torch.Tensor:
    """Documents -> one id stream, each document followed by ``<eos>``."""
    eos = torch.tensor([eos_id], dtype=torch.int64)
    pieces = []
    for doc in docs:
        pieces.append(torch.tensor(list(doc.data), dtype=torch.int64))
        pieces.append(eos)
    return torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.int64)


def build_corpus(eos_id: int = 256, held_out_percent: int = 5, selection: str = DEFAULT_SELECTION) -> Corpus:
    docs = stdlib_documents(selection)
    train = [d for d in docs if not is_held_out(d.name, held_out_percent)]
    held = [d for d in docs if is_held_out(d.name, held_out_percent)]
    return Corpus(
        train=_tokens(train, eos_id),
        held_out=_tokens(held, eos_id),
        train_names=tuple(d.name for d in train),
        held_out_names=tuple(d.name for d in held),
    )
