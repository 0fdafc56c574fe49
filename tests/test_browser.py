"""A failing report as a person sees it: rendered by headless Chromium (Debian's `chromium`).

Laws checked in a real browser:
- every <img> of index.html has loaded (complete, with a natural size), and every link inside the
  report resolves (an in-page anchor to an element, a relative path to a file of the folder);
- the first screen (1280 x 900) shows the verdict, the failing case's chart and its worst
  findings;
- the screenshot of that screen is not blank.

Where Chromium is missing the test is skipped with the command that installs it; CI sets
PRECISION_SUITE_REQUIRE_BROWSER=1 (.ci/run), which turns the skip into a failure.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

from precision_suite import cli
from precision_suite.reports import canvas, drift_chart, reports
from precision_suite.verdicts.findings import verdict
from precision_suite.verdicts.tolerances import compare
from synthetic_data import history_store, make_run_dataset

REQUIRE_ENV = "PRECISION_SUITE_REQUIRE_BROWSER"
INSTALL_HINT = "install it with `apt-get install chromium` (Debian/Ubuntu)"
WINDOW = (1280, 900)
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    f"--window-size={WINDOW[0]},{WINDOW[1]}",
)

# The checker page (never part of a report: reports carry no script) loads the report in a frame
# of the window's size and writes what the browser measured into its own DOM, which --dump-dom
# prints. --allow-file-access-from-files lets it read the frame's document from file://.
CHECKER = """<!DOCTYPE html><html><body style="margin:0">
<iframe id="report" src="index.html" width="{width}" height="{height}" style="border:0"></iframe>
<script>
document.getElementById("report").addEventListener("load", function () {{
  var doc = this.contentDocument, height = this.contentWindow.innerHeight, out = [];
  function onFirstScreen(el) {{
    if (!el) return "missing";
    var box = el.getBoundingClientRect();
    return box.top < height && box.bottom > 0 && box.width > 0 ? "yes" : "below:" + Math.round(box.top);
  }}
  Array.prototype.forEach.call(doc.images, function (img) {{
    out.push("image " + (img.complete && img.naturalWidth > 0 ? "loaded" : "BROKEN") + " " +
             img.getAttribute("data-chart"));
  }});
  var failing = doc.querySelector("section h2.fail");
  var section = failing && failing.parentNode;
  out.push("first-screen verdict " + onFirstScreen(doc.querySelector("h1")));
  out.push("first-screen chart " + onFirstScreen(section && section.querySelector("img")));
  out.push("first-screen worst " + onFirstScreen(section && section.querySelector(".worst li")));
  Array.prototype.forEach.call(doc.querySelectorAll("p.context"), function (p) {{
    out.push("context " + onFirstScreen(p) + " " + p.textContent);
  }});
  var pre = document.createElement("pre");
  pre.id = "measured";
  pre.textContent = out.join("\\n");
  document.body.appendChild(pre);
}});
</script></body></html>
"""


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        message = f"headless Chromium is not installed; {INSTALL_HINT}"
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{message} ({REQUIRE_ENV}=1 requires the browser test)", pytrace=False)
        pytest.skip(message)
    return found


def test_a_missing_browser_says_how_to_install_it_and_fails_where_required(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.delenv(REQUIRE_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="apt-get install chromium"):
        chromium()
    monkeypatch.setenv(REQUIRE_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match=f"apt-get install chromium.*{REQUIRE_ENV}=1"):
        chromium()


def _run_chromium(browser: str, profile: Path, *args: str) -> str:
    profile.mkdir(parents=True, exist_ok=True)  # a fresh profile: no state from other runs
    done = subprocess.run(
        [browser, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, f"chromium exited {done.returncode}: {done.stderr[-2000:]}"
    return done.stdout


class _Targets(HTMLParser):
    """img sources, link targets and element ids of a DOM dump."""

    def __init__(self) -> None:
        super().__init__()
        self.sources: list[str] = []
        self.links: list[str] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if "id" in attrs:
            self.ids.add(attrs["id"])
        if tag == "img":
            self.sources.append(attrs.get("src", ""))
        if tag == "a" and "href" in attrs:
            self.links.append(attrs["href"])


def _failing_report(folder: Path) -> Path:
    """A report of a GPT FP8 case with a planted underflow regression (a drift chart, figures A
    and B) beside two passing ViT cases (the variant overview)."""
    baseline = make_run_dataset(model="gpt", recipe="fp8-block", depth=18)
    current = baseline.copy(deep=True)
    for layer in (2, 9, 16):  # a regression in several layers: a chart with several panels
        cell = dict(layer=layer, tensor="gradient_transpose", layout="128x1")
        current["underflow"].loc[cell] = current["underflow"].loc[cell] + 0.1
    current["distortion"].loc[dict(layer=16)] = current["distortion"].loc[dict(layer=16)] - 0.01
    findings = compare(current, baseline)
    drift = canvas.save_figure(drift_chart.plot_drift(current, baseline, findings), folder / "drift.png")
    passing = [make_run_dataset(attention=name) for name in ("softmax", "x/1")]
    datasets = {ds.attrs["case"]: ds for ds in (current, *passing)}
    verdicts = [verdict(current.attrs["case"], findings, [str(drift)])]
    verdicts += [verdict(ds.attrs["case"], []) for ds in passing]
    return reports.write_report(verdicts, folder / "report", datasets=datasets)


def _resolves(target: str, report: Path, ids: set[str]) -> bool:
    parsed = urlparse(target)
    if parsed.scheme in ("http", "https"):
        return False  # a report opens offline: nothing outside its folder
    if target.startswith("#"):
        return unquote(target[1:]) in ids
    return (report / unquote(parsed.path)).is_file()


def rendered(browser: str, report: Path, profiles: Path) -> list[str]:
    """What Chromium measured of `report`/index.html (CHECKER's lines), after checking that every
    image source is embedded or resolves and every link leads somewhere in the folder."""
    index = report / "index.html"
    dom = _run_chromium(browser, profiles / "profile-dom", "--dump-dom", index.as_uri())
    targets = _Targets()
    targets.feed(dom)
    assert targets.sources, "the report shows no chart"
    for source in targets.sources:
        assert source.startswith("data:image/png;base64,") or _resolves(source, report, targets.ids), source
    unresolved = [link for link in targets.links if not _resolves(link, report, targets.ids)]
    assert not unresolved, f"links that lead nowhere: {unresolved}"

    checker = report / ".browser-check.html"  # beside index.html: the frame loads it relatively
    checker.write_text(CHECKER.format(width=WINDOW[0], height=WINDOW[1]), encoding="utf-8")
    measured_dom = _run_chromium(
        browser,
        profiles / "profile-check",
        "--allow-file-access-from-files",
        "--virtual-time-budget=10000",
        "--dump-dom",
        checker.as_uri(),
    )
    checker.unlink()
    measured = measured_dom.split('<pre id="measured">')[1].split("</pre>")[0].splitlines()
    images = [line for line in measured if line.startswith("image ")]
    assert len(images) == len(targets.sources)
    assert all(line.startswith("image loaded ") for line in images), images
    return measured


def test_failing_report_renders_with_every_image_and_link_and_a_readable_first_screen(tmp_path):
    browser = chromium()
    report = _failing_report(tmp_path)
    index = report / "index.html"
    measured = rendered(browser, report, tmp_path)
    first_screen = {line.split()[1]: line.split()[2] for line in measured if line.startswith("first-screen")}
    assert first_screen == {"verdict": "yes", "chart": "yes", "worst": "yes"}, first_screen

    screenshot = tmp_path / "first-screen.png"
    _run_chromium(browser, tmp_path / "profile-shot", f"--screenshot={screenshot}", index.as_uri())
    from PIL import Image

    with Image.open(screenshot) as shot:
        assert shot.size == WINDOW
        colours = shot.convert("RGB").getcolors(maxcolors=1 << 16)
        # a blank or unstyled page has a handful of colours; badges, charts and text have hundreds
        assert colours is None or len(colours) > 200, f"the screenshot looks blank ({len(colours)} colours)"
    saved = os.environ.get("PRECISION_SUITE_SCREENSHOT")
    if saved:  # keep the screenshot for a person to look at
        shutil.copyfile(screenshot, saved)


def test_history_report_loads_every_image_and_resolves_every_link(tmp_path):
    """`history report` of a store built from the committed baselines, one series planted."""
    browser = chromium()
    store = tmp_path / "store"
    history_store(
        store,
        Path(__file__).parents[1] / "baselines",
        ["gpt-softmax-fp8-block", "vit-softmax-fp32"],
        12,
        plant=(
            "gpt-softmax-fp8-block",
            "underflow",
            dict(layer=5, tensor="gradient", layout="1x128"),
            4.0,
            10.0,
            6,
        ),
    )
    report = tmp_path / "report"
    assert cli.main(["history", "report", "--store", str(store), "--report-dir", str(report)]) == 0
    measured = rendered(browser, report, tmp_path)
    assert len([line for line in measured if line.startswith("image loaded ")]) == 2  # a chart per case
    first_screen = {line.split()[1]: line.split()[2] for line in measured if line.startswith("first-screen")}
    assert first_screen["verdict"] == "yes" and first_screen["chart"] == "yes", (
        first_screen
    )  # the stepped case
