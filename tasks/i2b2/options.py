"""The i2b2 task's settings: flags of ``clinfed train`` and keys of a config
file like every other setting (declared here, composed into the run's schema
by ``clinfed.settings``)."""

from __future__ import annotations

from dataclasses import dataclass

from clinfed.core.schema import setting

# The model-free baselines the task offers (``clinfed baseline --kind``),
# declared beside its settings so the command line lists them without
# importing the task's model code.
BASELINES = ("dictionary",)


@dataclass
class I2b2Options:
    """Concept extraction: the annotation format and the entity types."""

    format: str = setting(
        "auto",
        "i2b2: the annotation format: i2b2 (.txt + .con), conll (token and tag columns, "
        "IOB/IOB2/IOBES), brat (.txt + .ann standoff), or auto (detected from the files).",
        choices=("auto", "i2b2", "conll", "brat"),
    )
    types: str | None = setting(
        None,
        "i2b2: the entity types to predict, declared: NAME=TYPE pairs, comma-separated "
        "(Disease=problem, with no spaces), map names; names alone (Disease) keep them; or "
        'a .toml file of NAME = "TYPE" pairs. '
        "Default: the i2b2 preset for .con files, the training split's types for CoNLL/BRAT.",
    )
    partial_labels: bool = setting(
        True,
        "i2b2: a site's O tokens are not evidence against a type the site never annotates "
        "(partial-label loss); off: they train as plain O.",
    )
    annotated_types: str | None = setting(
        None,
        "i2b2 under DP: the types each site annotates, declared (beth=problem,test;"
        "partners=problem). Under DP a site's set never comes from its data (one annotation "
        "would move every sentence's loss): without this, partial labels are off under DP. "
        "On Flower each node declares its own (node config annotated-types).",
    )
