"""Public name lists as an input feature of the encoder (a gazetteer).

``--gazetteer PATH`` names a file of public names, one a line (drug and
disease names from public terminologies, say), or a folder of such ``.txt``
files. Every forward then gives BERT's token-type id 1 to the word pieces
of the words that spell a listed name, and 0 elsewhere: a feature through
an input the encoder already has (its second segment's embedding), with no
new parameter. Under DP it turns evidence about each name, which needs a
handful of sentences that hold it and drowns in the noise, into one
direction that every sentence with a listed name shares
(``benchmarks/results/NOTEBOOK.md``, "Public terminologies").

Privacy: a unit's marks are computed from that unit's own tokens and the
public lists alone, so no other unit shapes its gradient (DESIGN.md
section 4); the lists are public input, recorded by digest in
``config.json``, the model's ``model.json`` and the privacy report.

With ``--gazetteer-marks per-list`` each list (each ``.txt`` file of the
folder, in file-name order) gets its own token-type id, 1, 2, ...: a drug
list and a disease list then say which kind of name a word is part of. The
encoder's token-type table grows a row for each list past the first, a copy
of its second row, so the start reads every list as it read the single
mark until training tells them apart.

The gazetteer belongs to the model: a saved model keeps its list
(``RUN/model/gazetteer.txt``, checked against its digest on load), so a run
started from it (``--model``), ``clinfed predict`` and a Flower node that
pins the model folder by digest all compute the same marks.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from clinfed.core.errors import ClinfedError

FILE = "gazetteer.txt"
# A line opening one list's names in a file with a mark per list (what a
# saved model keeps; also accepted from users): "#list NAME".
LIST_HEADER = "#list "
# Names longer than this many words are not looked up: each lookup tries
# every span up to the longest name, so the cost grows with it.
MAX_WORDS = 8
# Marks of this many distinct windows are kept (a run's windows repeat every
# epoch; a few hundred bytes each); past it the memo is cleared.
MEMO_ROWS = 200_000
_PUNCT = re.compile(r"\s*([-(),/'.+\[\]:;])\s*")
_WORD = re.compile(r"\w+|[^\w\s]")


def name_key(text: str) -> str:
    """The form names are compared in: lower case, single spaces, no spaces
    around punctuation (``5 - FU`` and ``5-fu`` are one name)."""
    return _PUNCT.sub(r"\1", " ".join(text.lower().split()))


@dataclass(frozen=True)
class Gazetteer:
    """A set of public names, in :func:`name_key` form.

    Parameters
    ----------
    names
        The names, already keyed.
    longest
        The most words a listed name has (spans longer are never looked up).
    """

    names: frozenset[str]
    longest: int
    lists: tuple[tuple[str, frozenset[str]], ...] = ()
    """With a mark per list: each list's name and keyed names, in mark order
    (the first list's names get token-type id 1). Empty: one mark for all."""

    def __post_init__(self) -> None:
        # Each name's mark; a name in two lists takes the first list's.
        marks: dict[str, int] = {}
        for number, (_, names) in enumerate(self.lists, start=1):
            for name in names:
                marks.setdefault(name, number)
        object.__setattr__(self, "_marks", marks)

    @classmethod
    def of(cls, names: Iterable[str]) -> Gazetteer:
        """From raw names (keyed here; names over ``MAX_WORDS`` words dropped)."""
        kept = _keyed(names)
        if not kept:
            raise ClinfedError("the gazetteer lists no name")
        return cls(kept, _longest(kept))

    @classmethod
    def of_lists(cls, lists: Iterable[tuple[str, Iterable[str]]]) -> Gazetteer:
        """A mark per list: ``(list name, raw names)`` pairs, in mark order."""
        keyed = tuple((name, _keyed(names)) for name, names in lists)
        every = frozenset().union(*(names for _, names in keyed))
        if not every:
            raise ClinfedError("the gazetteer lists no name")
        return cls(every, _longest(every), keyed)

    @classmethod
    def read(cls, path: str | Path, per_list: bool = False) -> Gazetteer:
        """A file of names, one a line (blank lines and ``#`` comments
        skipped), or a folder of such ``.txt`` files.

        Parameters
        ----------
        path
            The file or folder.
        per_list
            Give each list its own mark: each ``.txt`` file of a folder, in
            file-name order, named by its stem. A file whose first line is
            ``#list NAME`` (what a saved model keeps) holds its lists itself,
            each opened by such a line, and is read per list whatever this
            says.
        """
        path = Path(path)
        if path.is_dir():
            files = sorted(path.glob("*.txt"))
            if not files:
                raise ClinfedError(f"`gazetteer` {path}: a folder with no .txt name list")
        elif path.is_file():
            files = [path]
        else:
            raise ClinfedError(f"`gazetteer` {path}: no such file or folder")
        lists: list[tuple[str, list[str]]] = []
        for file in files:
            for name, names in _lists_in(file):
                per_list |= name is not None
                lists.append((name or file.stem, names))
        if not any(names for _, names in lists):
            raise ClinfedError(f"`gazetteer` {path}: lists no name")
        if per_list:
            return cls.of_lists(lists)
        return cls.of(name for _, names in lists for name in names)

    @property
    def kinds(self) -> tuple[str, ...]:
        """The lists' names, in mark order (empty with one mark for all)."""
        return tuple(name for name, _ in self.lists)

    @property
    def marks(self) -> int:
        """How many token-type ids past 0 the names take."""
        return max(1, len(self.lists))

    @property
    def sha256(self) -> str:
        """SHA-256 of :meth:`text`: the list's identity."""
        return hashlib.sha256(self.text().encode("utf-8")).hexdigest()

    def text(self) -> str:
        """What a saved model keeps: the keyed names, sorted, one a line; with
        a mark per list, each list's under its ``#list NAME`` line."""
        if not self.lists:
            return "\n".join(sorted(self.names)) + "\n"
        return "".join(
            f"{LIST_HEADER}{name}\n" + "".join(f"{n}\n" for n in sorted(names))
            for name, names in self.lists
        )

    def __deepcopy__(self, memo: dict) -> Gazetteer:
        # Immutable: copies of a model share one list (it can hold 10^6 names).
        return self

    def describe(self) -> dict[str, Any]:
        """What ``config.json``, ``model.json`` and the report record."""
        described: dict[str, Any] = {"names": len(self.names), "sha256": self.sha256}
        if self.lists:
            described["lists"] = list(self.kinds)
        return described

    def mark_of(self, text: str) -> int:
        """The mark of the listed name ``text`` spells (its list's number; 1
        with one mark for all), or 0 where no list holds it."""
        key = name_key(text)
        return self._marks.get(key, 1) if key in self.names else 0

    def name_spans(self, words: list[str]) -> list[tuple[int, int, int]]:
        """The listed names ``words`` spell, as ``(first word, words, mark)``:
        the longest name first, left to right, no word in two names; the mark
        is the name's list's number (1 with one mark for all)."""
        spans: list[tuple[int, int, int]] = []
        i = 0
        while i < len(words):
            for size in range(min(self.longest, len(words) - i), 0, -1):
                mark = self.mark_of(" ".join(words[i : i + size]))
                if mark:
                    spans.append((i, size, mark))
                    i += size - 1
                    break
            i += 1
        return spans

    def mark_ids(self, words: list[str]) -> list[int]:
        """Each word's mark: its list's number (1 with one mark for all) in a
        listed name (:meth:`name_spans`), else 0."""
        marks = [0] * len(words)
        for first, size, mark in self.name_spans(words):
            marks[first : first + size] = [mark] * size
        return marks

    def mark_words(self, words: list[str]) -> list[bool]:
        """Which of ``words`` belong to a listed name (:meth:`mark_ids`)."""
        return [mark > 0 for mark in self.mark_ids(words)]


def _keyed(names: Iterable[str]) -> frozenset[str]:
    keyed = {name_key(n) for n in names if n.strip()}
    return frozenset(k for k in keyed if len(_WORD.findall(k)) <= MAX_WORDS)


def _longest(keyed: frozenset[str]) -> int:
    return max(len(_WORD.findall(k)) for k in keyed)


def _lists_in(file: Path) -> list[tuple[str | None, list[str]]]:
    """The file's lists: one unnamed list, or, where its first line is a
    ``#list NAME`` line, each named list it opens."""
    try:
        raw = file.read_bytes()
    except OSError as exc:
        raise ClinfedError(f"`gazetteer` {file}: cannot read ({exc.strerror})") from None
    lists: list[tuple[str | None, list[str]]] = [(None, [])]
    for number, line in enumerate(raw.split(b"\n"), start=1):
        try:
            text = line.decode("utf-8").strip()
        except UnicodeDecodeError:
            raise ClinfedError(f"{file}:{number}: not UTF-8 text") from None
        header = text.startswith(LIST_HEADER) or text == LIST_HEADER.strip()
        if header and (lists[0][0] is not None or number == 1):
            name = text[len(LIST_HEADER) :].strip()
            if not name:
                raise ClinfedError(f"{file}:{number}: a {LIST_HEADER.strip()} line names no list")
            if lists == [(None, [])]:
                lists = []
            lists.append((name, []))
        elif text and not text.startswith("#"):
            lists[-1][1].append(text)
    return lists


class PieceMarker:
    """Token-type ids from a window's token ids: 1 on the word pieces of
    listed names, 0 elsewhere (special tokens and padding included).

    Words are rebuilt from WordPiece pieces (a ``##`` piece continues the
    word before it), as the tokenizer split them: punctuation is a word of
    its own, which :func:`name_key` joins back.
    """

    def __init__(self, gazetteer: Gazetteer, tokenizer: Any):
        if getattr(tokenizer, "backend_tokenizer", None) is None or (
            tokenizer.backend_tokenizer.model.__class__.__name__ != "WordPiece"
        ):
            raise ClinfedError(
                "`gazetteer` needs a WordPiece tokenizer (BERT family: minilm, tiny or a BERT "
                "checkpoint): it rebuilds words from ## pieces"
            )
        self.gazetteer = gazetteer
        self.pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        self.special = frozenset(tokenizer.all_special_ids)
        self._memo: dict[tuple[int, ...], list[int]] = {}

    def words(self, ids: list[int]) -> tuple[list[str], list[int]]:
        """The words a window's pieces spell, and each piece's word (-1 for
        special tokens and padding)."""
        words: list[str] = []
        owner: list[int] = []
        for token in ids:
            if token in self.special or token >= len(self.pieces):
                owner.append(-1)
                continue
            piece = self.pieces[token]
            if piece.startswith("##") and words and owner and owner[-1] >= 0:
                words[-1] += piece[2:]
            else:
                words.append(piece)
            owner.append(len(words) - 1)
        return words, owner

    def word_marks(self, words: list[str]) -> list[int]:
        """Each word's token-type id: its list's mark in a listed name (1
        with one mark for all), else 0."""
        return self.gazetteer.mark_ids(words)

    def row(self, ids: np.ndarray) -> bytes:
        """The marks of one window, a byte each (memoised by the window's
        ids, compactly: windows repeat every epoch)."""
        key = ids.tobytes()
        found = self._memo.get(key)
        if found is not None:
            return found
        words, owner = self.words(ids.tolist())
        marks = self.word_marks(words)
        found = bytes(marks[w] if w >= 0 else 0 for w in owner)
        if len(self._memo) >= MEMO_ROWS:
            self._memo.clear()
        self._memo[key] = found
        return found

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = input_ids.reshape(-1, input_ids.shape[-1]).cpu().numpy()
        marks = np.frombuffer(b"".join(self.row(r) for r in rows), dtype=np.uint8)
        return (
            torch.from_numpy(marks.copy())
            .to(device=input_ids.device, dtype=input_ids.dtype)
            .reshape(input_ids.shape)
        )

    def __deepcopy__(self, memo: dict) -> PieceMarker:
        # Immutable apart from its memo: copies of a model share it.
        return self

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_memo"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _memo={})


def gazetteer_of(model: Any) -> Gazetteer | None:
    """The gazetteer ``model`` marks, if any."""
    return getattr(model, "gazetteer", None)
