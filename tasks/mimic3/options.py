"""The MIMIC-III task's settings: flags of ``clinfed train`` and keys of a
config file like every other setting (declared here, composed into the run's
schema by ``clinfed.settings``)."""

from __future__ import annotations

from dataclasses import dataclass

from clinfed.core.schema import setting

# The model-free baselines the task offers (``clinfed baseline --kind``),
# declared beside its settings so the command line lists them without
# importing the task's model code.
BASELINES = ("frequency", "keyword")


@dataclass
class Mimic3Options:
    """ICD-9 coding: which codes are labels and how notes are cut."""

    codes: str = setting(
        "diagnoses",
        "mimic3: which ICD-9 codes are labels.",
        choices=("diagnoses", "procedures", "both"),
    )
    top_k: int = setting(
        50,
        "mimic3: keep the first K codes of the public MIMIC-III-50 list (0: all of it).",
        minimum=0,
        maximum=100_000,
    )
    max_chunks: int = setting(8, "mimic3: windows kept per admission.", minimum=1, maximum=1_024)
    labels: list[str] | None = setting(
        None,
        "mimic3: the codes to predict instead of the public list (a file: one per line, or "
        "a run's labels.json).",
    )
