"""Open a run's privacy report in headless Chromium, check the page it
renders and save a screenshot.

The check reads the DOM the browser built (``--dump-dom``) with the same
outline the tests use (:func:`clinfed.reporting.report.page_outline`): the
header, one verdict per site, and a "what each site sent" grid with a
column for every encoder layer (plus embeddings and head).

    .venv/bin/python tools/report_in_browser.py RUN --screenshot docs/report.png

Needs Chromium (Debian: ``apt-get install chromium``). Exit status 1 when
the page is not as it should be.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
]


def chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


def render(page: Path, screenshot: Path | None = None, height: int = 2400) -> str:
    """The DOM Chromium renders for ``page`` (and a screenshot, if asked)."""
    browser = chromium()
    if browser is None:
        raise SystemExit("no Chromium on this machine (apt-get install chromium)")
    with tempfile.TemporaryDirectory(prefix="clinfed-chromium-") as profile:
        base = [browser, *FLAGS, f"--user-data-dir={profile}"]
        url = page.resolve().as_uri()
        dom = subprocess.run(
            [*base, "--dump-dom", url], capture_output=True, text=True, timeout=120, check=True
        ).stdout
        if screenshot is not None:
            screenshot.parent.mkdir(parents=True, exist_ok=True)
            subprocess.run(
                [*base, f"--window-size=1100,{height}", f"--screenshot={screenshot}", url],
                capture_output=True,
                timeout=120,
                check=True,
            )
    return dom


def problems(outline: dict, layers: int, sites: list[str]) -> list[str]:
    """What is wrong with a report page's outline (empty: nothing)."""
    found = []
    if outline["title"] != "Privacy report":
        found.append(f"title is {outline['title']!r}")
    for key in ("Task", "Strategy", "Model", "Versions (at training)", "Command"):
        if key not in outline["header"]:
            found.append(f"header lacks {key}")
    if sites and len(outline["verdicts"]) < len(sites):
        found.append(f"{len(outline['verdicts'])} verdict lines for {len(sites)} sites")
    for site in sites:
        if not any(line.startswith(f"{site}:") for line in outline["verdicts"]):
            found.append(f"no verdict for {site}")
    expected = ["embeddings", *[f"layer {i}" for i in range(layers)], "head"]
    if sites and outline["sent_columns"] != expected:
        found.append(f"sent grid columns {outline['sent_columns']}, expected {expected}")
    return found


def model_layers(run: Path) -> int:
    """The encoder layers of the run's saved model (its own configuration)."""
    saved = json.loads((run / "model" / "model.json").read_text())
    found = []

    def walk(value) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                if key in ("num_hidden_layers", "n_layers") and isinstance(inner, int):
                    found.append(inner)
                walk(inner)

    walk(saved)
    if not found:
        raise SystemExit(f"{run}/model/model.json: no layer count")
    return found[0]


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from clinfed.reporting.report import page_outline

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path)
    parser.add_argument("--screenshot", type=Path)
    parser.add_argument("--height", type=int, default=2400)
    args = parser.parse_args()
    page = args.run / "report" / "report.html"
    outline = page_outline(render(page, args.screenshot, args.height))
    content = json.loads((args.run / "report" / "privacy.json").read_text())
    layers = model_layers(args.run)
    sites = [row["site"] for row in content["sites"]]
    found = problems(outline, layers, sites)
    print(json.dumps({"outline": outline, "problems": found}, indent=2))
    raise SystemExit(1 if found else 0)


if __name__ == "__main__":
    main()
