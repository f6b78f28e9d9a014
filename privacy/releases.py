"""Everything a site may send, declared once: the one door of its replies.

Each field of a site's reply (training and evaluation replies, SAFL's layer
choice, its ledger, secure aggregation's stages) is declared here, and
nowhere else, as one of:

* **accounted**: covered by epsilon, the output of a mechanism charged on
  the site's ledger (DP-SGD, private layer selection, the noisy unit count
  under add/remove) or a function of such outputs and public settings;
* **declared**: released outside epsilon, on the report's first screen,
  with its cap (held-out evaluation counts; under replace-one the exact
  unit count and what derives from it);
* **public**: a function of public settings alone (the plan, the site's
  name and policy), or randomness independent of the data (secure
  aggregation's keys).

:func:`check_reply` is the door: both transports encode a reply with
:func:`clinfed.federated.messages.encode_reply`, which calls it and sends
nothing when a field is not declared here (or is declared as never leaving
a private site, as the training loss is). The report's release table
(:func:`release_table`) and the one in ``docs/privacy.md``
(``python -m clinfed.privacy.releases docs/privacy.md``) are generated
from the same rows,
so the words cannot drift from the code; ``tests/test_releases.py`` proves
it with a neighbour test (one unit removed or replaced, randomness pinned:
only accounted fields may differ).

The records a server writes (``metrics.jsonl``, ``privacy/policy.json``) are
built from these fields and the server's own public figures (bytes sent
down, timings of its own work).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from clinfed.privacy.errors import PrivacyError

ACCOUNTED, DECLARED, PUBLIC = "accounted", "declared", "public"
COVERS = (ACCOUNTED, DECLARED, PUBLIC)


@dataclass(frozen=True)
class Row:
    """One kind of quantity a site sends: a row of the release table.

    ``cover`` is how the row is covered with respect to one *training* unit
    and ``words`` says it for the report, under replace-one neighbours;
    ``add_remove`` overrides both under add/remove. ``held_out``: how it is
    covered with respect to one *held-out* unit (public for every row but
    the evaluation). ``under_dp`` False: never leaves a private site.
    """

    key: str
    what: str
    when: str
    cover: str
    words: str
    add_remove: tuple[str, str] | None = None
    under_dp: bool = True
    no_dp: str = "nothing (no DP)"
    held_out: str = PUBLIC

    def covered(self, relation: str) -> tuple[str, str]:
        """(cover, words) under ``relation``."""
        if relation == "add-remove" and self.add_remove is not None:
            return self.add_remove
        return self.cover, self.words


_COUNT_WORDS = (
    "accounted: a noisy count (std 20) drawn once per ledger (a Flower node: once per "
    "dataset, over every run; in process: once per run, whose folder holds the ledger), "
    "charged as the ledger's unit-count line; the weight, sampling rate, steps and default "
    "delta cap derive from it, never from the exact count (add/remove)"
)

ROWS: tuple[Row, ...] = (
    Row(
        "update",
        "model update: the planned parameters (see the grid below)",
        "each round it trained",
        ACCOUNTED,
        "accounted: DP-SGD, charged on the ledger each round it trained",
    ),
    Row(
        "weight",
        "its weight: the number of privacy units it trained on (never rows)",
        "each round it trained",
        DECLARED,
        "declared: released exactly; the accounting assumes it public (replace-one)",
        add_remove=(ACCOUNTED, _COUNT_WORDS),
        no_dp="declared, not protected",
    ),
    Row(
        "ledger",
        "ledger lines and the site's policy figures (epsilon this run and over every run "
        "of the dataset, noise, sample rate, steps, batch)",
        "each reply",
        DECLARED,
        "declared: they follow from public settings, the exact unit count (itself declared "
        "under replace-one) and what the dataset spent in other runs",
        add_remove=(
            ACCOUNTED,
            "accounted: they follow from public settings and the released noisy count, and "
            "what the dataset spent in other runs",
        ),
    ),
    Row(
        "selection",
        "layer choice (SAFL)",
        "each round it trained",
        ACCOUNTED,
        "accounted when private (noisy scores, charged each round); public when global or "
        "public (computed from public text and the global model)",
    ),
    Row(
        "evaluation",
        "evaluation counts (true/false positives on held-out units), the F1 computed from "
        "them, and the held-out size: exact, on held-out units outside epsilon, of weights "
        "the server chooses",
        "once per round",
        # Of a training unit, the counts are post-processing: the weights
        # evaluated are the server's (built from accounted updates) or the
        # site's own DP-trained ones. Of a held-out unit they are exact.
        ACCOUNTED,
        "declared and capped, not accounted: each global round's model once, never past the "
        "run's rounds; on Flower at most the node's max-evaluations per dataset over every "
        "run. The server chooses the weights evaluated, so each answer is a query it crafts",
        no_dp="declared and capped as under DP; nothing else protects them (no DP)",
        held_out=DECLARED,
    ),
    Row(
        "plan",
        "what the update holds: its tensor names, sizes and bytes, the blocks and shares "
        "of each layer sent, the clipping mode",
        "each round it trained",
        PUBLIC,
        "public: it follows from the plan and the model's shape",
        no_dp="public: it follows from the plan and the model's shape",
    ),
    Row(
        "refusal",
        "refusals and their reasons (budget spent, policy)",
        "when they happen",
        DECLARED,
        "declared: they follow from the site's public policy and its ledger",
        add_remove=(
            ACCOUNTED,
            "accounted: they follow from the site's public policy and its ledger, whose "
            "figures derive from the released noisy count",
        ),
        no_dp="declared: they follow from the site's public policy",
    ),
    Row(
        "identity",
        "the site's name, the round, the digest of the weights it received, and secure "
        "aggregation's public keys and encrypted shares",
        "each reply",
        PUBLIC,
        "public: the site's configuration, the server's own message, or randomness "
        "independent of the data",
        no_dp="public",
    ),
    Row(
        "timing",
        "reply timing (when each reply reaches the server)",
        "each reply",
        DECLARED,
        "declared, not accounted: it follows from the site's hardware and batch sizes",
        no_dp="declared, not accounted: it follows from the site's hardware and batch sizes",
    ),
    Row(
        "training",
        "training loss, tokens, wall time, evaluation time",
        "never under DP",
        DECLARED,
        "kept at the site under DP",
        under_dp=False,
        no_dp="released each round it trained; nothing protects them (no DP)",
    ),
)
ROW = {row.key: row for row in ROWS}

# Every field a reply can hold, as a path (``record.examples``; ``[]`` an
# item of a list, ``*`` any one key), and its row. A path declares the
# subtree under it; declare fields one by one where a new sibling must not
# pass unseen. A field not matched here is refused at the door.
FIELDS: dict[str, str] = {
    "site": "identity",
    "received": "identity",
    "upload": "update",
    "record.round": "identity",
    "record.site": "identity",
    "record.examples": "weight",
    "record.epsilon": "ledger",
    "record.bytes_up": "plan",
    "record.trainable_params": "plan",
    "record.uploaded_params": "plan",
    "record.sent_blocks": "plan",
    "record.sent_share": "plan",
    "record.num_layers": "plan",
    "record.clipping": "plan",
    "record.selection": "selection",
    "record.selection_mechanism": "selection",
    "record.layers": "selection",
    "record.scores": "selection",
    "record.refused": "refusal",
    "record.epsilon_if_trained": "refusal",
    "record.evaluation_only": "refusal",
    "record.train_loss": "training",
    "record.train_tokens": "training",
    "record.wall_s": "training",
    "evaluation.counts": "evaluation",
    "evaluation.examples": "evaluation",
    "evaluation.seconds": "training",
    "ledger.digest": "ledger",
    "ledger.budget": "identity",
    "ledger.policy": "ledger",
    **{
        f"ledger.lines[].{name}": "ledger"
        for name in (
            "site",
            "client",  # a ledger line written before "site" (a node's ledger lives on)
            "run",
            "round",
            "attempt",
            "state",
            "mechanism",
            "epsilon",
            "ledger_epsilon",
            "delta",
            "noise_multiplier",
            "sample_rate",
            "steps",
            "replace_sensitivity",
            "accountant",
            "relation",
            "not_private",
        )  # fmt: skip
    },
    **{
        f"ledger.site.{name}": "ledger"
        for name in (
            "examples",
            "noise_multiplier",
            "batch_size",
            "lr_scale",
            "sample_rate",
            "steps_per_round",
            "planned_epsilon",
        )  # fmt: skip
    },
    "secure.encrypt": "identity",
    "secure.mask": "identity",
    "secure.names": "plan",
    "secure.shares": "identity",
}

# Fields the server adds to a site's record in ``metrics.jsonl`` (its own
# figures about what it sent and how it summed), by row.
SERVER_FIELDS: dict[str, str] = {
    "bytes_down": "plan",
    "rejected": "update",  # the server's check of the update (shapes, finite)
    "secure": "plan",
    "secure_dropped": "identity",
}


def _segments(path: str) -> list[str]:
    return path.replace("[]", ".[]").split(".")


_PATTERNS = [(_segments(path), row) for path, row in FIELDS.items()]


def row_of(path: str) -> Row | None:
    """The row declaring ``path`` (a leaf's path, as :func:`leaves` gives it)."""
    segments = _segments(path)
    for pattern, row in _PATTERNS:
        if len(pattern) <= len(segments) and all(
            p == "*" or p == s for p, s in zip(pattern, segments, strict=False)
        ):
            return ROW[row]
    return None


def cover_of(path: str, relation: str) -> str | None:
    """``accounted``, ``declared`` or ``public`` for ``path`` under ``relation``."""
    row = row_of(path)
    return None if row is None else row.covered(relation)[0]


def leaves(value: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Every leaf of a reply's JSON part with its path (``a.b``, ``a[].c``)."""
    if isinstance(value, Mapping):
        # An empty container releases nothing but its presence: no leaf.
        for key, item in value.items():
            yield from leaves(item, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(value, list | tuple) and (
        not value or any(isinstance(v, Mapping) for v in value)
    ):
        for item in value:
            yield from leaves(item, f"{prefix}[]")
    else:
        yield prefix, value


def refused_fields(info: Mapping[str, Any], private: bool) -> list[str]:
    """The paths of ``info`` (a reply's JSON part, ``None`` values left
    out) that may not leave the site: undeclared, or never released under DP."""
    refused = []
    for path, _ in leaves({k: v for k, v in info.items() if v is not None}):
        row = row_of(path)
        if row is None or (private and not row.under_dp):
            refused.append(path)
    return sorted(set(refused))


def check_reply(info: Mapping[str, Any], private: bool, site: str = "") -> None:
    """The door: raise unless every field of ``info`` is declared here (and,
    at a private site, released under DP). Nothing is sent on a refusal."""
    refused = refused_fields(info, private)
    if refused:
        who = f"site {site}: " if site else ""
        raise PrivacyError(
            f"{who}the reply holds {', '.join(refused[:4])}, which clinfed.privacy.releases "
            "does not declare as releasable here: nothing was sent"
        )


def release_table(
    private: bool, relation: str, *, secure: bool = False, selection: str | None = None,
    label_source: str | None = None,
) -> list[list[str]]:  # fmt: skip
    """The report's "what left each hospital" rows: what, when, and how it
    is covered, for a run with or without DP under ``relation``."""
    rows = []
    for row in ROWS:
        cover, words = row.covered(relation)
        if not private:
            words = row.no_dp
        if row.key == "update" and secure:
            words += (
                "; secure aggregation: a server that follows the protocol sees only the sum "
                "over sites, but one that forges secure-min-sites - 1 keys recovers one site's "
                "update and weight at the mask stage (DP still covers them)"
            )
        if row.key == "selection" and selection is not None:
            words = selection
        if row.key == "ledger" and not private:
            continue
        when = row.when if (private or row.key != "training") else "each round it trained"
        rows.append([row.what, when, words])
    if label_source is not None:
        rows.append(["the label set", "once", label_source])
    return rows


def markdown(relation: str) -> str:
    """The release table of a private run under ``relation``, in Markdown
    (``docs/privacy.md`` holds both relations' tables as this prints them)."""
    lines = [
        "| what a site sends | when | how it is covered |",
        "| --- | --- | --- |",
    ]
    for what, when, words in release_table(True, relation):
        lines.append(f"| {what} | {when} | {words} |")
    return "\n".join(lines)


BEGIN = "<!-- release tables: generated by `python -m clinfed.privacy.releases FILE` -->"
END = "<!-- end of the release tables -->"


def tables() -> str:
    """Both relations' release tables, as ``docs/privacy.md`` holds them."""
    return "\n".join(
        f"Under {relation} neighbours{note}:\n\n{markdown(relation)}\n"
        for relation, note in (("add-remove", " (the default)"), ("replace-one", ""))
    )


def main(argv: list[str] | None = None) -> None:
    """Print the release tables, or with a file (``docs/privacy.md``) write
    them between its markers."""
    import sys
    from pathlib import Path

    args = sys.argv[1:] if argv is None else argv
    if not args:
        print(tables())
        return
    path = Path(args[0])
    text = path.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{path}: no release-table markers")
    head, rest = text.split(BEGIN, 1)
    path.write_text(f"{head}{BEGIN}\n\n{tables()}\n{END}{rest.split(END, 1)[1]}")


if __name__ == "__main__":
    main()
