"""Synthetic MIMIC-III corpora in the release's CSV formats, one folder per site.

How a corpus is generated (deterministic for a seed):

* **Codes.** Real ICD-9 diagnosis and procedure codes (undotted, leading
  zeros kept, E- and V-codes included). Each has surface forms (the last one
  is held out: it appears only in test notes) and indirect evidence (drugs,
  findings, procedures) that may signal it without naming it.
* **Notes.** A discharge summary per admission with MIMIC's sections and
  ``[** **]`` de-identification placeholders. A true code is named with some
  probability, signalled by evidence with another, or both; absent codes
  appear negated (``no evidence of``, ``ruled out``) or in the family history,
  which a keyword lookup mistakes for the code. Some admissions get an
  addendum that adds a diagnosis. Other note categories, ``ISERROR=1`` rows
  and notes without ``HADM_ID`` are mixed in, as the reader must drop them.
* **Sites.** Each site has its own code prevalence (case mix), abbreviation
  habit and section wording; even-numbered sites write the full release's
  quoted upper-case headers, odd-numbered ones the demo's lower-case style.
* **Split.** Patients are split train/test by the generator (test notes use
  held-out forms) and CAML-style split files record it:
  ``train_full_hadm_ids.csv`` and ``test_full_hadm_ids.csv`` in each site.
"""

from __future__ import annotations

import csv
import io
import random
from pathlib import Path

from clinfed.core.runs import atomic_write_text
from clinfed.tasks.base import mark_synthetic

# (code, surface forms (last = held out), evidence)
from clinfed.tasks.mimic3.vocabulary import (  # noqa: F401  (word lists, re-exported)
    ALL_CODES,
    DIAGNOSES,
    EVIDENCE,
    FAMILY,
    FILLER,
    MENTIONS,
    NEGATIONS,
    PROCEDURES,
    SECTIONS,
)

NOTE_HEADER = [
    "row_id",
    "subject_id",
    "hadm_id",
    "chartdate",
    "charttime",
    "storetime",
    "category",
    "description",
    "cgid",
    "iserror",
    "text",
]
CODE_HEADER = ["row_id", "subject_id", "hadm_id", "seq_num", "icd9_code"]


def _csv_text(header: list[str], rows: list[list], full_release: bool) -> str:
    buf = io.StringIO()
    if full_release:  # quoted upper-case header, every field quoted
        writer = csv.writer(buf, quoting=csv.QUOTE_ALL, lineterminator="\n")
        writer.writerow([h.upper() for h in header])
    else:  # the demo: lower-case header, minimal quoting
        writer = csv.writer(buf, quoting=csv.QUOTE_MINIMAL, lineterminator="\n")
        writer.writerow(header)
    writer.writerows(rows)
    return buf.getvalue()


HETEROGENEITY = ("normal", "strong")


class _Site:
    def __init__(self, index: int, rng: random.Random, strong: bool = False):
        self.index, self.rng = index, rng
        self.sections = SECTIONS[index % len(SECTIONS)]
        self.abbreviate = ((0.95, 0.0, 0.5) if strong else (0.6, 0.15, 0.35))[index % 3]
        spread = 1.5 if strong else 0.7  # how far case mixes drift apart
        # Case mix: a Zipf-like base rate per code, scaled per site.
        codes = sorted(ALL_CODES)
        base = {
            c: 0.35 / (1 + i) ** 0.6
            for i, c in enumerate(random.Random(7).sample(codes, len(codes)))
        }
        self.prevalence = {c: min(0.7, p * rng.lognormvariate(0, spread)) for c, p in base.items()}

    def form(self, code: str, test: bool) -> str:
        forms = ALL_CODES[code][1]
        if test and self.rng.random() < 0.4:
            return forms[-1]
        seen = forms[:-1]
        return seen[1] if len(seen) > 1 and self.rng.random() < self.abbreviate else seen[0]

    def admission(self, test: bool) -> tuple[list[str], str, str | None]:
        """Codes, discharge summary text and an optional addendum."""
        rng = self.rng
        codes = [c for c in sorted(ALL_CODES) if rng.random() < self.prevalence[c]]
        if not codes:
            codes = [rng.choice(sorted(ALL_CODES))]
        absent = [c for c in sorted(ALL_CODES) if c not in codes]
        addendum_code = codes.pop() if len(codes) > 2 and rng.random() < 0.15 else None
        sentences: dict[str, list[str]] = {s: [] for s in self.sections}
        for code in codes:
            evidence = ALL_CODES[code][2]
            named = rng.random() < 0.8 or not evidence
            if named:
                section = rng.choice(self.sections[1:])
                template = rng.choice(MENTIONS)
                sentences[section].append(template.format(f=self.form(code, test)))
            if evidence and (not named or rng.random() < 0.4):
                sentences[self.sections[2]].append(
                    rng.choice(EVIDENCE).format(e=rng.choice(evidence))
                )
        for code in rng.sample(absent, k=min(len(absent), rng.randint(1, 3))):
            template = rng.choice(NEGATIONS + FAMILY)
            sentences[rng.choice(self.sections[:3])].append(
                template.format(f=self.form(code, test))
            )
        lines = [
            f"Admission Date:  [**{self._date()}**]     Discharge Date:   [**{self._date()}**]",
            "",
            f"Date of Birth:  [**{self._date()}**]     Sex:   {rng.choice('MF')}",
            "",
            f"Service: {rng.choice(['MEDICINE', 'CARDIOLOGY', 'SURGERY', 'NEUROLOGY'])}",
        ]
        for section in self.sections:
            lines += ["", section]
            body = sentences[section] + [self._filler() for _ in range(rng.randint(1, 3))]
            rng.shuffle(body)
            lines += body
        if addendum_code is not None:
            codes.append(addendum_code)
        addendum = None
        if addendum_code is not None:
            form = self.form(addendum_code, test)
            addendum = f"Addendum :\nPatient was also found to have {form} ; see above for plan ."
        return codes, "\n".join(lines) + "\n", addendum

    def _date(self) -> str:
        return f"{self.rng.randint(2100, 2190)}-{self.rng.randint(1, 12)}-{self.rng.randint(1, 28)}"

    def _filler(self) -> str:
        rng = self.rng
        return rng.choice(FILLER).format(
            age=rng.randint(20, 89),
            sex=rng.choice(["man", "woman"]),
            t=round(rng.uniform(96, 102), 1),
            hr=rng.randint(50, 130),
            sbp=rng.randint(85, 180),
            dbp=rng.randint(40, 100),
            rr=rng.randint(12, 28),
            sat=rng.randint(86, 100),
            n=rng.randint(100, 9999),
            date=self._date(),
        )


def _note(
    row_id: int,
    subject: int,
    hadm: int | str,
    date: str,
    description: str,
    text: str,
    category: str = "Discharge summary",
    time: str = "",
    error: str = "",
) -> list:
    """One NOTEEVENTS row (ROW_ID .. TEXT; no storetime or caregiver)."""
    return [row_id, subject, hadm, date, time, "", category, description, "", error, text]


def generate(
    out: Path | str,
    sites: int = 3,
    docs: int = 120,
    seed: int = 0,
    test_fraction: float = 0.25,
    canary: str | None = None,
    heterogeneity: str = "normal",
) -> dict[str, int]:
    """Write ``out/site<i>/`` folders; return admissions written per split.

    Parameters
    ----------
    docs
        Admissions per site (about 1.5 per patient).
    canary
        A string planted in every discharge summary, so tests can prove that
        note text never reaches a log, report or error.
    heterogeneity
        ``normal``, or ``strong``: case mixes drift much further apart
        (per-code prevalence scaled by a log-normal of sigma 1.5, not 0.7)
        and abbreviation habits are pushed to the extremes.
    """
    if heterogeneity not in HETEROGENEITY:
        raise ValueError(f"heterogeneity must be one of {', '.join(HETEROGENEITY)}")
    out = Path(out)
    rng = random.Random(seed)
    counts = {"train": 0, "test": 0}
    row_id = hadm = 100000
    subject = 1000
    for s in range(sites):
        site = _Site(s, random.Random(f"{seed}:site:{s}"), heterogeneity == "strong")
        notes, diagnoses, procedures, split_ids = [], [], [], {"train": [], "test": []}
        made = 0
        while made < docs:
            subject += 1
            split = "test" if rng.random() < test_fraction else "train"
            for _ in range(min(rng.choice([1, 1, 1, 2, 2, 3]), docs - made)):
                hadm += 1
                made += 1
                codes, text, addendum = site.admission(test=split == "test")
                if canary:
                    text += f"Note id {canary} .\n"
                date = site._date()
                row_id += 1
                notes.append(_note(row_id, subject, hadm, date, "Report", text))
                if addendum:
                    row_id += 1
                    notes.append(_note(row_id, subject, hadm, date, "Addendum", addendum))
                if rng.random() < 0.3:  # other categories must be ignored
                    row_id += 1
                    other, _, _ = site.admission(test=False)
                    finding = f"FINDINGS: possible {site.form(other[0], False)} .\n"
                    notes.append(
                        _note(row_id, subject, hadm, date, "CHEST (PA & LAT)", finding,
                              category="Radiology", time=f"{date} 10:00:00")
                    )  # fmt: skip
                if rng.random() < 0.05:  # an erroneous summary, flagged ISERROR=1
                    row_id += 1
                    _, wrong, _ = site.admission(test=False)
                    notes.append(_note(row_id, subject, hadm, date, "Report", wrong, error="1"))
                seq = {"diagnoses": 0, "procedures": 0}
                for code in codes:
                    kind = ALL_CODES[code][0]
                    seq[kind] += 1
                    row_id += 1
                    table = diagnoses if kind == "diagnoses" else procedures
                    table.append([row_id, subject, hadm, seq[kind], code])
                split_ids[split].append(hadm)
                counts[split] += 1
            if rng.random() < 0.1:  # an outpatient summary with no admission
                row_id += 1
                _, text, _ = site.admission(test=False)
                notes.append(_note(row_id, subject, "", site._date(), "Report", text))
        # Even sites write the full release's quoting, odd ones the demo's.
        tables = {"NOTEEVENTS": notes, "DIAGNOSES_ICD": diagnoses, "PROCEDURES_ICD": procedures}
        _write_site(out / f"site{s + 1}", tables, split_ids, full=s % 2 == 0)
    mark_synthetic(out, "clinfed data synth mimic3", seed)
    return counts


def _write_site(
    folder: Path, tables: dict[str, list], split_ids: dict[str, list], full: bool
) -> None:
    for name, rows in tables.items():
        header = NOTE_HEADER if name == "NOTEEVENTS" else CODE_HEADER
        atomic_write_text(folder / f"{name}.csv", _csv_text(header, rows, full))
    for split, ids in split_ids.items():
        atomic_write_text(folder / f"{split}_full_hadm_ids.csv", "".join(f"{i}\n" for i in ids))
