"""What concept extraction does with public text: the warm start's and
the public check's reading (types mapped onto the run's), name lists'
distant labels, a forecast's units dealt into sites, the probe a digest is
taken on. Public text only: nothing here reads a site's notes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import datasets

from clinfed.core.errors import ClinfedError, ProblemLog
from clinfed.tasks.base import PUBLIC_SITE
from clinfed.tasks.i2b2.format import Document, read_corpus
from clinfed.tasks.i2b2.public import label_listed_names

# The fixed synthetic notes a model's behaviour is probed on (public_probe).
PROBE_SEED = 20_101


class PublicText:
    """The public-text part of :class:`~clinfed.tasks.i2b2.adapter.I2b2Task`
    (a mixin: it reads the task's labels, types and encoder)."""

    def check_public_judge(self, folder: Path, records: Any, annotated: list[str]) -> None:
        missing = [t for t in self.entity_types if t not in annotated]
        if not records or missing:
            raise ClinfedError(
                f"`public_check` {folder}: "
                + (f"no span of type {missing[0]}" if records else "no annotated documents")
                + ": its F1 scores every type of the run, so it needs text that annotates them all"
            )

    def read_public(
        self,
        folder: Path,
        flag: str,
        public_types: Any,
        tokenizer: Any,
        max_length: int,
        cache_dir: str,
        problems: ProblemLog,
        name_lists: Any = None,
    ) -> tuple[list[Document], Any, list[str], dict[str, int]]:
        # The public text's own type names, mapped onto the run's.
        reader = type(self)(format="auto", types=public_types)
        corpus = reader.load(folder, problems)
        documents = [d for d in (*corpus.train, *corpus.test) if d.concepts or d.annotated]
        labelled: dict[str, int] = {}
        if name_lists is not None:
            labelled = reader.distant_labels(documents, name_lists, self.entity_types)
        annotated = sorted({c.type for d in documents for c in d.concepts})
        unknown = [t for t in annotated if t not in self.entity_types]
        if unknown:
            raise ClinfedError(
                f"{flag} {folder}: type {unknown[0]} is not one of the run's "
                f"({', '.join(self.entity_types)}); map it with `public_types`"
            )
        for document in documents:
            document.site = PUBLIC_SITE
        # Under partial labels an O of the public text says nothing against a
        # run type it never annotates.
        self.site_types[PUBLIC_SITE] = set(annotated)
        try:
            examples = self.encode(documents, tokenizer, max_length, cache_dir)
        finally:
            del self.site_types[PUBLIC_SITE]
        return documents, examples, annotated, labelled

    def distant_labels(
        self, documents: list[Document], gazetteer: Any, run_types: tuple[str, ...]
    ) -> dict[str, int]:
        # A list is named as a type of the text (mapped as --types maps the
        # text's own) or as a run type; a list of no run type labels nothing.
        mapped = {kind: (self.types or {}).get(kind, kind) for kind in gazetteer.kinds}
        types = {kind: run for kind, run in mapped.items() if run in run_types}
        return label_listed_names(documents, gazetteer, types)

    def public_units(self, folder: Path, public_types: Any, problems: ProblemLog) -> list:
        from clinfed.tasks.i2b2.units import read_units

        reader = type(self)(format="auto", types=public_types)
        return read_units(reader, folder, problems)

    def public_mentions(self, units: list) -> dict[str, int]:
        from clinfed.tasks.i2b2.units import mentions

        return mentions(units)

    def write_public_sites(self, sites: dict[str, list], test: list, out: Path) -> None:
        from clinfed.tasks.i2b2.units import write_units

        write_units(sites, test, out)

    def forecast_settings(self) -> dict[str, Any]:
        return {"format": "conll", "types": ",".join(self.entity_types)}

    def public_probe(self, tokenizer, max_length: int, cache_dir: str) -> datasets.Dataset:
        from clinfed.tasks.i2b2.synth import generate

        folder = Path(cache_dir) / "probe"
        generate(folder, sites=3, docs=4, seed=PROBE_SEED)
        records = read_corpus(folder / "train", ProblemLog())  # the generator writes i2b2
        return self.encode(records, tokenizer, max_length, cache_dir).shuffle(seed=PROBE_SEED)
