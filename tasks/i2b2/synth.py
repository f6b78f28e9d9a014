"""Synthetic i2b2 2010 corpora, written in the release's exact formats.

How a corpus is generated (deterministic for a seed):

* **Lexicon.** Problems (diseases, symptoms, with modifiers), tests (labs,
  imaging, procedures) and treatments (drugs, procedures). Each list is split
  by the seed into *seen* forms (train and test) and *held-out* forms (test
  only), so test documents hold surface forms no training document has: a
  dictionary cannot find them; a model must use context and word pieces.
* **Context decides the type.** Some words take their type from the
  sentence: ``potassium``/``magnesium``/``calcium``/``insulin`` are tests in a
  lab sentence and treatments when given; ``blood pressure`` is a test when
  measured and part of a problem when elevated. Clinic and service names
  (``the pain clinic``, ``the stroke team``) reuse concept words but are no
  concepts.
* **Sites differ like hospitals do.** Each site has its own note template
  (section headers, phrasing), abbreviation habit (``htn``, ``afib``,
  ``lasix``), brand-vs-generic drug names and concept-type mix. Site folders
  are ``beth``, ``partners``, then ``site3``...; stems are ``record-N`` at
  beth and nine digits with ``_DH``/``_WGH`` at partners, as in the release.
* **Noise.** Typos in a few concept words, capitalised words, concepts that
  run over a line break, quotes inside concept text, and ``.ast`` assertion
  files for problems.

Layout: ``train/<site>/{txt,concept,ast}/`` and ``test/<site>/{txt,concepts}/``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

from clinfed.core.runs import atomic_write_text
from clinfed.tasks.base import mark_synthetic

# The lexicon (tasks/i2b2/vocabulary.py): each entry is a surface form; "|"
# separates a full form from the abbreviation an abbreviating site writes.
from clinfed.tasks.i2b2.vocabulary import (  # noqa: F401  (word lists, re-exported)
    CLINICS,
    DISEASES,
    DRUGS,
    ELECTROLYTES,
    LABS,
    MODIFIERS,
    PROCEDURES,
    STUDIES,
    SYMPTOMS,
)

HELD_OUT_SHARE = 0.25

# Sentence shapes only test documents use: a model has to find concepts in
# contexts it never saw, not just in the site's familiar template slots.
TEST_ONLY_SENTENCES = [
    ("{P} was felt to be secondary to {P} .", "present"),
    ("Given her {P} , {R} was held .", "present"),
    ("After {R} her {T} improved to {N} .", None),
    ("{T} revealed no {P} but did show {P} .", "mixed_reveal"),
    ("Despite {R} and {R} , the {P} persisted .", "present"),
    ("PE : {P} , otherwise unremarkable .", "present"),
    ("Her {E} dropped to {N} after {R} .", "electrolyte_test"),
    ("Could not rule out {P} ; {T} is pending .", "possible"),
]
TEST_ONLY_RATE = 0.25

# --------------------------------------------------------------------------
# Templates. Slots: {P} problem, {T} test, {R} treatment, {E} electrolyte,
# {C} clinic (not a concept), {N} a number. "P" slots carry an assertion.
# --------------------------------------------------------------------------
HETEROGENEITY = ("normal", "strong")
STYLE_TEMPLATES = [
    {  # 0: abbreviating academic centre ("beth")
        "headers": [
            "HISTORY OF PRESENT ILLNESS :",
            "PAST MEDICAL HISTORY :",
            "HOSPITAL COURSE :",
            "LABORATORY DATA :",
            "DISCHARGE MEDICATIONS :",
            "DISPOSITION :",
        ],
        "sentences": [
            ("Pt is a {N} y/o with h/o {P} and {P} who presents c/o {P} .", "present"),
            ("Pt c/o {P} x {N} days , denies {P} .", "mixed"),
            ("{T} showed {P} .", "present"),
            ("{T} was negative for {P} .", "absent"),
            ("Pt was started on {R} for {P} .", "present"),
            ("Continued home {R} and {R} .", None),
            ("{E} was {N} , repleted with {E} .", "electrolyte"),
            ("Pt s/p {R} on {N}/{N} , tolerated well .", None),
            ("F/u with the {C} clinic in {N} weeks .", None),
            ("No evidence of {P} on {T} .", "absent"),
            ("Possible {P} , will obtain {T} .", "possible"),
            ("Elevated blood pressure on admission , given {R} .", "bp_problem"),
            ("Blood pressure {N}/{N} , HR {N} .", "bp_test"),
            ("Family history of {P} .", "family"),
        ],
        "abbreviate": 0.7,
        "mix": {"problem": 0.5, "test": 0.25, "treatment": 0.25},
    },
    {  # 1: narrative community hospital ("partners")
        "headers": [
            "CHIEF COMPLAINT :",
            "HISTORY :",
            "REVIEW OF SYSTEMS :",
            "HOSPITAL COURSE :",
            "STUDIES :",
            "PLAN :",
        ],
        "sentences": [
            (
                "The patient is a {N} -year-old woman with a history of {P} "
                "who was admitted with {P} .",
                "present",
            ),
            ("She underwent {T} , which demonstrated {P} .", "present"),
            ("Her {T} was unremarkable .", None),
            ("A {T} was obtained and did not show {P} .", "absent"),
            ("Her {E} was {N} on admission .", "electrolyte_test"),
            ("She received {E} for replacement .", "electrolyte_treatment"),
            ("She was treated with {R} and {R} with improvement of her {P} .", "present"),
            ("The patient denied {P} or {P} .", "absent"),
            ("We are concerned for {P} and will check {T} .", "possible"),
            ("She will follow up with the {C} service .", None),
            ("Her blood pressure was {N}/{N} .", "bp_test"),
            ("Her insulin level was checked and was {N} .", "insulin_test"),
            ("There is a family history of {P} in her mother .", "family"),
            ("She describes her problem as {Q} .", "quote"),
        ],
        "abbreviate": 0.1,
        "mix": {"problem": 0.35, "test": 0.45, "treatment": 0.2},
    },
    {  # 2: terse list-style notes ("site3")
        "headers": ["PROBLEMS :", "MEDS :", "LABS :", "PROCEDURES :", "FOLLOW UP :"],
        "sentences": [
            ("Problem list : {P} , {P} , {P} .", "present"),
            ("Meds : {R} , {R} , {R} .", None),
            ("Labs notable for {T} of {N} and {T} of {N} .", None),
            ("Received {R} in the emergency department .", None),
            ("Started {R} for {P} .", "present"),
            ("Given {E} and {R} .", "electrolyte_treatment"),
            ("Started on insulin for {P} .", "insulin_treatment"),
            ("Ruled out for {P} with {T} .", "absent"),
            ("Seen by the {C} team .", None),
            ("Uncontrolled blood pressure , on {R} .", "bp_problem"),
            ("{P} resolved after {R} .", "present"),
        ],
        "abbreviate": 0.35,
        "mix": {"problem": 0.3, "test": 0.25, "treatment": 0.45},
    },
]
DETERMINERS = {"problem": ["her", "a"], "test": ["a", "her", "repeat"]}
_SLOTS = {"{P}", "{T}", "{R}", "{E}", "{Q}", "{N}", "{C}"}


@dataclass
class _Lexicon:
    seen: dict[str, list[str]]
    held_out: dict[str, list[str]]


def _split_lexicon(rng: random.Random) -> _Lexicon:
    pools = {
        "problem": DISEASES + SYMPTOMS,
        "test": LABS + STUDIES,
        "treatment": DRUGS + PROCEDURES,
    }
    seen, held = {}, {}
    for ctype, words in pools.items():
        words = sorted(words)
        rng.shuffle(words)
        cut = int(len(words) * HELD_OUT_SHARE)
        held[ctype], seen[ctype] = words[:cut], words[cut:]
    return _Lexicon(seen, held)


@dataclass
class _Line:
    tokens: list[str] = field(default_factory=list)
    # (start token, end token, type, assertion or None)
    spans: list[tuple[int, int, str, str | None]] = field(default_factory=list)


class _DocumentWriter:
    """Expands one site's templates into lines of tokens with spans."""

    def __init__(self, rng: random.Random, style: dict, lexicon: _Lexicon, test: bool):
        self.rng, self.style, self.lexicon = rng, style, lexicon
        self.held_out_rate = 0.4 if test else 0.0
        self.test_only_rate = TEST_ONLY_RATE if test else 0.0

    def surface(self, ctype: str, determiner: bool) -> list[str]:
        rng = self.rng
        pool = self.lexicon.seen[ctype]
        if self.lexicon.held_out[ctype] and rng.random() < self.held_out_rate:
            pool = self.lexicon.held_out[ctype]
        full, _, abbrev = rng.choice(pool).partition("|")
        words = (abbrev if abbrev and rng.random() < self.style["abbreviate"] else full).split()
        if ctype == "problem" and rng.random() < 0.3:
            words = [rng.choice(MODIFIERS)] + words
        if (
            determiner
            and ctype in DETERMINERS
            and words[0] not in ("a", "an")
            and rng.random() < 0.15
        ):
            words = [rng.choice(DETERMINERS[ctype])] + words
        return [self._noise(w) for w in words]

    def _noise(self, word: str) -> str:
        rng = self.rng
        if len(word) > 5 and rng.random() < 0.03:  # a typo: two letters swapped
            i = rng.randrange(1, len(word) - 2)
            word = word[:i] + word[i + 1] + word[i] + word[i + 2 :]
        if rng.random() < 0.05:
            word = word.capitalize()
        return word

    def sentence(self) -> _Line:
        rng = self.rng
        pool = self.style["sentences"]
        if rng.random() < self.test_only_rate:
            pool = TEST_ONLY_SENTENCES
        if "skew" in self.style:
            # Strongly heterogeneous sites: sentences are drawn by how many
            # slots of the site's dominant concept type they hold.
            weights = [
                1.0 + self.style["skew"] * t.split().count(self.style["dominant"]) for t, _ in pool
            ]
            template, kind = rng.choices(pool, weights=weights)[0]
        else:
            template, kind = rng.choice(pool)
        line = _Line()
        for piece in template.split():
            slot = piece if piece in _SLOTS else None
            if slot is None and "{N}" in piece:
                line.tokens.append(piece.replace("{N}", str(rng.randint(1, 99))))
                continue
            if slot == "{N}":
                line.tokens.append(str(rng.randint(2, 180)))
            elif slot == "{C}":
                line.tokens.extend(rng.choice(CLINICS).split())
            elif slot in ("{P}", "{T}", "{R}", "{E}", "{Q}"):
                self._concept(line, slot, kind)
            else:
                line.tokens.append(piece)
        self._context_concepts(line, kind)
        return line

    def _concept(self, line: _Line, slot: str, kind: str | None) -> None:
        rng = self.rng
        if slot == "{E}":
            words = [rng.choice(ELECTROLYTES)]
            given = kind in ("electrolyte_treatment",) or (
                kind == "electrolyte" and any(t == "with" for t in line.tokens)
            )
            ctype = "treatment" if given else "test"
        elif slot == "{Q}":
            words, ctype = ['"' + "leaky", 'valve"'], "problem"
        else:
            ctype = {"{P}": "problem", "{T}": "test", "{R}": "treatment"}[slot]
            # Possessives and articles belong to the concept in i2b2 ("her
            # fall"); they read naturally only in affirmative sentences.
            words = self.surface(ctype, determiner=kind in (None, "present"))
        assertion = None
        if ctype == "problem":
            assertion = {
                "absent": "absent",
                "possible": "possible",
                "family": "associated_with_someone_else",
            }.get(kind or "", "present")
            if kind == "mixed":
                assertion = "absent" if "denies" in line.tokens else "present"
            elif kind == "mixed_reveal":
                assertion = "present" if "show" in line.tokens else "absent"
        start = len(line.tokens)
        line.tokens.extend(words)
        line.spans.append((start, len(line.tokens) - 1, ctype, assertion))

    def _context_concepts(self, line: _Line, kind: str | None) -> None:
        """Spans fixed by the template: blood pressure and insulin by context."""
        tokens = [t.lower() for t in line.tokens]
        if kind == "bp_problem":
            line.spans.append((0, 2, "problem", "present"))
        elif kind == "bp_test":
            i = tokens.index("blood")
            line.spans.append((i, i + 1, "test", None))
        elif kind in ("insulin_test", "insulin_treatment"):
            i = tokens.index("insulin")
            if kind == "insulin_test":
                line.spans.append((i - 1, i + 1, "test", None))  # "her insulin level"
            else:
                line.spans.append((i, i, "treatment", None))
        line.spans.sort()

    def document(self, n_sentences: int) -> _Doc:
        """Header lines and sentences; now and then a line wraps inside a
        multi-word concept, as in real notes, giving a two-line concept."""
        doc = _Doc()
        headers = self.style["headers"]
        per_section = max(1, n_sentences // len(headers))
        for header in headers:
            doc.lines.append(header.split())
            for _ in range(per_section):
                doc.add(self.sentence(), wrap=self.rng.random() < 0.03, rng=self.rng)
        return doc


@dataclass
class _Doc:
    lines: list[list[str]] = field(default_factory=list)
    # ((line, token), (line, token), type, assertion), 1-based lines
    concepts: list[tuple[tuple[int, int], tuple[int, int], str, str | None]] = field(
        default_factory=list
    )

    def add(self, line: _Line, wrap: bool, rng: random.Random) -> None:
        number = len(self.lines) + 1
        multi = [s for s in line.spans if s[1] > s[0]]
        cut = None
        if wrap and multi:
            start, end, _, _ = rng.choice(multi)
            cut = rng.randint(start + 1, end)
        if cut is None:
            self.lines.append(line.tokens)
        else:
            self.lines.extend([line.tokens[:cut], line.tokens[cut:]])

        def position(token: int) -> tuple[int, int]:
            return (number, token) if cut is None or token < cut else (number + 1, token - cut)

        for start, end, ctype, assertion in line.spans:
            self.concepts.append((position(start), position(end), ctype, assertion))

    def render(self) -> tuple[str, str, str]:
        """Text, .con and .ast bodies."""
        text = "".join(" ".join(tokens) + "\n" for tokens in self.lines)
        con, ast = [], []
        for (l1, t1), (l2, t2), ctype, assertion in self.concepts:
            words = [
                tok
                for ln in range(l1, l2 + 1)
                for i, tok in enumerate(self.lines[ln - 1])
                if (ln, i) >= (l1, t1) and (ln, i) <= (l2, t2)
            ]
            body = f'c="{" ".join(words).lower()}" {l1}:{t1} {l2}:{t2}||t="{ctype}"'
            con.append(body + "\n")
            if assertion is not None:
                ast.append(f'{body}||a="{assertion}"\n')
        return text, "".join(con), "".join(ast)


def _site_name(index: int) -> str:
    return ("beth", "partners")[index] if index < 2 else f"site{index + 1}"


def _stem(site_index: int, doc_index: int, rng: random.Random) -> str:
    if site_index == 0:
        return f"record-{100 + doc_index}"
    if site_index == 1:
        return f"{rng.randrange(10**8, 10**9):09d}_{rng.choice(['DH', 'WGH'])}"
    return f"{_site_name(site_index)}-{doc_index:04d}"


def generate(
    out: Path | str,
    sites: int = 3,
    docs: int = 40,
    seed: int = 0,
    test_fraction: float = 0.25,
    sentences: int = 24,
    heterogeneity: str = "normal",
) -> dict[str, int]:
    """Write a synthetic corpus to ``out``; return documents written per split.

    Parameters
    ----------
    sites
        Number of hospitals; each gets its own style (cycling through three).
    docs
        Documents per site, train and test together.
    test_fraction
        Share of each site's documents written to ``test/`` (held out).
    heterogeneity
        ``normal``, or ``strong``: each site's notes lean hard towards one
        concept type (problems, tests, treatments in turn: sentences with
        its slots are drawn up to 9 times as often) and abbreviation habits
        are pushed to the extremes (95%, never, 50%).
    """
    if heterogeneity not in HETEROGENEITY:
        raise ValueError(f"heterogeneity must be one of {', '.join(HETEROGENEITY)}")
    out = Path(out)
    rng = random.Random(seed)
    lexicon = _split_lexicon(random.Random(f"lexicon:{seed}"))
    counts = {"train": 0, "test": 0}
    for s in range(sites):
        site = _site_name(s)
        style = STYLE_TEMPLATES[s % len(STYLE_TEMPLATES)]
        if heterogeneity == "strong":
            style = style | {
                "skew": 8.0,
                "dominant": ("{P}", "{T}", "{R}")[s % 3],
                "abbreviate": (0.95, 0.0, 0.5)[s % 3],
            }
        n_test = max(1, round(docs * test_fraction))
        for d in range(docs):
            split = "test" if d >= docs - n_test else "train"
            writer = _DocumentWriter(rng, style, lexicon, test=split == "test")
            text, con, ast = writer.document(sentences + rng.randint(-4, 4)).render()
            stem = _stem(s, d, rng)
            folder = out / split / site
            atomic_write_text(folder / "txt" / f"{stem}.txt", text)
            if split == "train":
                atomic_write_text(folder / "concept" / f"{stem}.con", con)
                atomic_write_text(folder / "ast" / f"{stem}.ast", ast)
            else:
                atomic_write_text(folder / "concepts" / f"{stem}.con", con)
            counts[split] += 1
    mark_synthetic(out, "clinfed data synth i2b2", seed)
    return counts
