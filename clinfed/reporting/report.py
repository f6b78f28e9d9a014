"""``clinfed report RUN``: what a run released and what it cost, for a
privacy officer.

Reads only the run folder's own records (config, policy, ledgers, metrics,
summary, audit), never the data, so no note text can reach the report.
Writes ``RUN/report/report.html`` (one self-contained page, plots inlined),
``report.md`` (same text, plots beside it as PNG) and ``privacy.json``.
The work by job: :mod:`~clinfed.reporting.verify` (the run folder read
strictly and cross-checked), :mod:`~clinfed.reporting.content` (what the
report says, as data), :mod:`~clinfed.reporting.plots`,
:mod:`~clinfed.reporting.render` (Markdown and HTML).
"""

from __future__ import annotations

import base64
from pathlib import Path

from clinfed.core.runs import atomic_write_json, atomic_write_text
from clinfed.reporting.content import build, evaluation_queries, record_row
from clinfed.reporting.render import ALT, html_page, markdown, page_outline

__all__ = ["build", "evaluation_queries", "page_outline", "record_row", "write_report"]


def write_report(run: Path, reference: Path | None = None, folder: Path | None = None) -> Path:
    """Write ``RUN/report/`` (``report.html``, ``report.md`` with its PNGs,
    ``privacy.json``); return that folder. ``reference``: a run folder of
    the same run without DP, for the F1 plot (found beside ``run`` in a
    sweep otherwise). ``folder``: write there instead (an export's copy)."""
    run = Path(run)
    content = build(run, reference)
    plots = content.pop("_plots")
    folder = Path(folder) if folder is not None else run / "report"
    folder.mkdir(exist_ok=True)
    for name, png in plots.items():
        (folder / f"{name}.png").write_bytes(png)
    md = markdown(content, {k: f"![{k}]({k}.png)" for k in plots})
    atomic_write_text(folder / "report.md", md)
    inline = {
        k: f"![{ALT[k]}](data:image/png;base64,{base64.b64encode(v).decode()})"
        for k, v in plots.items()
    }
    page = html_page(markdown(content, inline))
    atomic_write_text(folder / "report.html", page)
    atomic_write_json(folder / "privacy.json", content)
    return folder
