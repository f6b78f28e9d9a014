"""The report's page: its content (:mod:`clinfed.reporting.content`) as
Markdown, and as one self-contained HTML page; :func:`page_outline` reads
a rendered page back (tests, and ``tools/report_in_browser.py``)."""

from __future__ import annotations

from typing import Any

from clinfed.privacy.accountants import RELATION, reference_accountant


def possessive(name: str) -> str:
    """``beth`` -> ``beth's``, ``partners`` -> ``partners'``."""
    return f"{name}'" if name.endswith("s") else f"{name}'s"


def _fmt(value: Any, spec: str = ".3f") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return format(value, spec)
    return str(value)


def _cell(text: Any) -> str:
    """A Markdown table cell: pipes escaped, one line."""
    return str(text).replace("|", "\\|").replace("\n", " ")


SENT_SYMBOLS = {2: "■", 1: "◧", 3: "▫", 0: "·"}

RELATION_WORDS = {
    "replace-one": (
        "Neighbouring relation: replace-one (each site's unit count is released, so the "
        "guarantee is stated for datasets of the same size that differ in one unit)."
    ),
    "add-remove": (
        "Neighbouring relation: add/remove (each site released its unit count once, with "
        "Gaussian noise of std 20 accounted on its ledger, and derived everything else from "
        "it, so the guarantee is stated for datasets that differ in one unit added or "
        "removed)."
    ),
}


def markdown(content: dict[str, Any], images: dict[str, str]) -> str:
    """The report as Markdown; ``images``: each plot's Markdown image."""
    lines = ["# Privacy report", "", "| run | |", "|---|---|"]
    lines += [f"| {label} | {_cell(value)} |" for label, value in content["header"]]
    if content.get("summary"):
        lines += ["", "## In short"]
        for paragraph in content["summary"]:
            lines += ["", paragraph]
    lines += ["", "## Verdict", ""]
    lines += [f"- {line}" for line in content["verdicts"]]
    lines += _meaning(content)
    if content["pooled"]:
        lines += ["", "## Result", "", f"Final held-out F1: {_fmt(content['final_f1'], '.4f')}."]
        if "f1" in images:
            lines += ["", images["f1"]]
        return "\n".join(lines) + "\n"
    lines += ["", "## What left each hospital", ""]
    lines += ["| what | when | protected by |", "|---|---|---|"]
    lines += [f"| {' | '.join(_cell(c) for c in row)} |" for row in content["released"]]
    lines += _per_site(content, images)
    lines += _sent(content, images)
    lines += ["", "## Result", "", f"Final held-out F1: {_fmt(content['final_f1'], '.4f')}."]
    if content["reference_f1"] is not None:
        lines.append(f"The same run without DP: {content['reference_f1']:.4f}.")
    if content["stopped"]:
        lines.append(f"The run {content['stopped']}.")
    if "f1" in images:
        lines += ["", images["f1"]]
    lines += ["", "## Empirical check (membership inference)", ""]
    lines += _audit(content["audit"])
    return "\n".join(lines) + "\n"


def _meaning(content: dict[str, Any]) -> list[str]:
    """What epsilon means here, and the budget it was held to."""
    if not content["meaning"]:
        return []
    lines = ["", "## What epsilon means here", ""]
    for paragraph in content["meaning"]:
        lines += [paragraph, ""]
    relation = content.get("relation", RELATION)
    lines.append(
        f"Budget: epsilon {_fmt(content['target_epsilon'], 'g')} at delta "
        f"{_fmt(content['delta'], 'g')}; per-unit clipping norm "
        f"{_fmt(content['max_grad_norm'], 'g')}. Accountant: {content['accountant']} "
        "(budget checks use it). "
        + RELATION_WORDS.get(relation, "")
        + " The RDP figures are a looser bound by another analysis "
        f"({reference_accountant(relation).description}), "
        "for comparison."
    )
    return lines


def _per_site(content: dict[str, Any], images: dict[str, str]) -> list[str]:
    lines = ["", "## Per site", "", content["ledger_source"], ""]
    if content["sites"]:
        # Under add/remove the units a site released are its noisy count
        # (drawn once per ledger: per run in process, per dataset at a node).
        units = "units (noisy count)" if content.get("relation") == "add-remove" else "units"
        lines += [
            f"| site | {units} | noise multiplier | sample rate | steps / round | rounds "
            "| epsilon | epsilon (RDP bound) | MB sent | refused rounds |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for row in content["sites"]:
            lines.append(
                f"| {row['site']} | {_fmt(row['examples'])} | {_fmt(row['noise_multiplier'])} "
                f"| {_fmt(row['sample_rate'], '.4f')} | {_fmt(row['steps_per_round'])} "
                f"| {row['rounds_accounted']} | {row['epsilon']:.3f} | {row['epsilon_rdp']:.3f} "
                f"| {row['mb_sent']:.1f} | {', '.join(map(str, row['refused_rounds'])) or '-'} |"
            )
    else:
        lines.append("No privacy ledger: nothing was accounted.")
    if "epsilon" in images:
        lines += ["", "### Epsilon per round", "", images["epsilon"]]
    return lines


def _sent(content: dict[str, Any], images: dict[str, str]) -> list[str]:
    sent = content["sent"]
    if not sent:
        return []
    lines = [
        "",
        "### What each site sent",
        "",
        "■ the whole block sent, ◧ the layer sent without its frozen attention "
        "query/key, ▫ a small part of its numbers sent (adapters, bias terms), · not "
        "sent.",
        "",
        "| | " + " | ".join(sent["columns"]) + " |",
        "|---|" + "---|" * len(sent["columns"]),
    ]
    for row in sent["rows"]:
        cells = " | ".join(SENT_SYMBOLS[c] for c in row["cells"])
        lines.append(f"| {row['label']} | {cells} |")
    if "layers" in images:
        lines += ["", images["layers"]]
    return lines


ATTACKS = (
    ("loss_threshold", "loss threshold"),
    ("calibrated_loss", "loss calibrated by the initial model"),
)


def _audit(audit: dict[str, Any] | None) -> list[str]:
    """The membership inference check, and what it does and does not show."""
    if not audit or "final_model" not in audit:
        return ["Not run. Train with `--audit-holdout 0.1`, then `clinfed audit RUN` adds it."]
    final = audit["final_model"]
    lines = [
        f"Members: training rows; non-members: {_fmt(audit.get('holdout_share'), 'g')} of "
        "each site's training units, set aside at random before training (the same "
        f"distribution). {final['members']} members against {final['non_members']} "
        "non-members per target. 0.5 means the attack cannot tell them apart.",
        "",
        "| target | attack | AUC | 95% CI |",
        "|---|---|---|---|",
    ]
    targets = [("final model", final)] + [
        (f"{possessive(site)} last update", attack)
        for site, attack in sorted(audit.get("site_updates", {}).items())
    ]
    above = []  # attacks whose interval lies above chance
    for name, attack in targets:
        for key, label in ATTACKS:
            result = attack[key]
            interval = f"{result['ci_low']:.3f}-{result['ci_high']:.3f}"
            lines.append(f"| {name} | {label} | {result['auc']:.3f} | {interval} |")
            if result["ci_low"] > 0.5:
                above.append(f"{name} by {label} (AUC {result['auc']:.3f}, 95% CI {interval})")
    if above:
        # The words follow every interval, not the final model's alone.
        return lines + [
            "",
            f"In plain words: {len(above)} of the {2 * len(targets)} attacks tell training "
            f"rows from held-out ones better than chance: {'; '.join(above)}. What they "
            "attack leaks membership at least this much; epsilon is the guarantee.",
        ]
    lines += ["", f"In plain words: {final['loss_threshold']['reading']}."]
    threshold = final["loss_threshold"]
    if threshold["ci_low"] <= 0.5 <= threshold["ci_high"]:
        lines += [
            "",
            "An interval that holds 0.5 is no evidence of privacy: at small sizes this "
            "attack cannot tell a private model from one trained without DP either (at "
            "the demo's size it measured 0.526 against 0.501). The guarantee is the "
            "accounting above, not this check.",
        ]
    return lines


ALT = {
    "epsilon": "Epsilon spent per site by round, PLD and RDP",
    "layers": "What each site sent, by round and block",
    "f1": "Held-out F1 by round",
}

STYLE = """
body{font-family:system-ui,sans-serif;max-width:62em;margin:2em auto;padding:0 1em;
line-height:1.45;color:#222}
h1{border-bottom:2px solid #08519c;padding-bottom:.2em}
table{border-collapse:collapse;margin:.6em 0}
td,th{border:1px solid #ccc;padding:.25em .6em;text-align:left;vertical-align:top}
th{background:#f3f6fa}
img{max-width:100%}
code{background:#f4f4f4;padding:0 .2em}
"""


def html_page(markdown: str) -> str:
    """The report's Markdown as one HTML page (markdown-it-py, CommonMark
    with tables; raw HTML in the text is not passed through)."""
    from markdown_it import MarkdownIt

    body = MarkdownIt("commonmark", {"html": False}).enable("table").render(markdown)
    return (
        "<!doctype html>\n<html lang='en'><head><meta charset='utf-8'>"
        "<meta name='viewport' content='width=device-width, initial-scale=1'>"
        f"<title>clinfed privacy report</title><style>{STYLE}</style></head>"
        f"<body>\n{body}</body></html>\n"
    )


def page_outline(page: str) -> dict[str, Any]:
    """The structure of a report page, read back from its HTML (or a
    browser's rendered DOM): title, header rows, verdict lines, the columns
    of the "what each site sent" grid, section headings and image texts.
    Used to check the page a browser renders."""
    from html.parser import HTMLParser

    class Outline(HTMLParser):
        def __init__(self) -> None:
            super().__init__()
            self.headings: list[str] = []
            self.tables: list[dict[str, Any]] = []
            self.items: dict[str, list[str]] = {}
            self.images: list[str] = []
            self._tag: str | None = None
            self._text = ""
            self._row: list[str] | None = None

        def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
            if tag in ("h1", "h2", "h3", "li", "td", "th"):
                self._tag, self._text = tag, ""
            elif tag == "table":
                self.tables.append(
                    {"after": self.headings[-1] if self.headings else "", "rows": []}
                )
            elif tag == "tr":
                self._row = []
            elif tag == "img":
                self.images.append(dict(attrs).get("alt") or "")

        def handle_endtag(self, tag: str) -> None:
            text = " ".join(self._text.split())
            if tag in ("h1", "h2", "h3") and self._tag == tag:
                self.headings.append(text)
            elif tag == "li" and self._tag == "li":
                self.items.setdefault(self.headings[-1] if self.headings else "", []).append(text)
            elif tag in ("td", "th") and self._row is not None:
                self._row.append(text)
            elif tag == "tr" and self._row is not None and self.tables:
                self.tables[-1]["rows"].append(self._row)
                self._row = None
            if tag == self._tag:
                self._tag = None

        def handle_data(self, data: str) -> None:
            if self._tag is not None:
                self._text += data

    parser = Outline()
    parser.feed(page)
    header = next((t for t in parser.tables if t["after"] == "Privacy report"), None)
    sent = next((t for t in parser.tables if t["after"] == "What each site sent"), None)
    return {
        "title": parser.headings[0] if parser.headings else "",
        "headings": parser.headings,
        "header": {
            row[0]: row[1] for row in (header["rows"][1:] if header else []) if len(row) > 1
        },
        "verdicts": parser.items.get("Verdict", []),
        "sent_columns": sent["rows"][0][1:] if sent else [],
        "sent_rows": len(sent["rows"]) - 1 if sent else 0,
        "images": parser.images,
    }
