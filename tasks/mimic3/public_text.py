"""What ICD coding does with public text: the warm start's admissions
(the model's codes only, never counted from the text) and the probe a
digest is taken on. Public text only: nothing here reads a site's notes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import datasets

from clinfed.core.errors import ClinfedError, ProblemLog
from clinfed.tasks.base import PUBLIC_SITE

# The fixed synthetic admissions a model's behaviour is probed on.
PROBE_SEED = 20_101


class PublicAdmissions:
    """The public-text part of :class:`~clinfed.tasks.mimic3.adapter.Mimic3Task`
    (a mixin: it reads the task's labels, reader and encoder)."""

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
    ) -> tuple[datasets.Dataset, Any, list[str], dict[str, int]]:
        if public_types:
            raise ClinfedError(
                f"`public_types` maps entity types; task {self.name} reads ICD-9 codes, "
                "which keep their names"
            )
        del name_lists  # they mark the input; an admission's codes take no span labels
        records, codes = self.public_admissions(folder, flag, problems)
        records = records.map(lambda _: {"site": PUBLIC_SITE}, input_columns="site")
        return records, self.encode(records, tokenizer, max_length, cache_dir), codes, {}

    def public_admissions(
        self, folder: Path, flag: str, problems: ProblemLog
    ) -> tuple[datasets.Dataset, list[str]]:
        """A public warm start's text (``flag``: the option that named
        ``folder``): every admission of the folder, both splits, that has a
        discharge summary and one of the model's codes; and the codes they
        carry. The label set stays the model's (public, never counted from
        the text); other codes are left out, as for a site."""
        records = self.read_documents(folder, problems)
        kept = set(self.labels)
        records = records.filter(lambda codes: any(c in kept for c in codes), input_columns="codes")
        if not len(records):
            raise ClinfedError(
                f"{flag} {folder}: no admission has a discharge summary and one of the run's "
                f"{len(self.labels)} label codes"
            )
        return records, sorted({c for codes in records["codes"] for c in codes if c in kept})

    def public_probe(self, tokenizer, max_length: int, cache_dir: str) -> datasets.Dataset:
        from clinfed.tasks.mimic3.synth import generate

        folder = Path(cache_dir) / "probe"
        generate(folder, sites=1, docs=24, seed=PROBE_SEED)
        records = self.read_documents(folder, ProblemLog())
        return self.encode(records, tokenizer, max_length, cache_dir).shuffle(seed=PROBE_SEED)
