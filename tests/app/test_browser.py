"""End to end in a real browser: Playwright driving Debian's chromium (never a downloaded browser).

The server is `ttrace dashboard` on a copy of sample_traces/ (so the comparison cache stays out of
the repository), on a free port. Outside CI the test is skipped when chromium or playwright is
missing; in CI (.ci/run installs both) a missing browser fails it.
"""

import json
import os
import shutil
import subprocess
import sys
import urllib.parse
from pathlib import Path

import pytest

from tests.app.server import free_port, wait_healthy
from ttrace_dashboard.colours import contrast_ratio
from ttrace_examples.megatron_gpt.bugs import CULPRITS

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = "/usr/bin/chromium"
SAMPLES = json.loads((ROOT / "sample_traces" / "samples.json").read_text())
BUGGY = next(s for s in SAMPLES if s.get("expected_exit") == 1 and s.get("first_divergence"))

try:
    from playwright.sync_api import sync_playwright
except ImportError:  # pragma: no cover - CI installs it
    sync_playwright = None
if (sync_playwright is None or not Path(CHROMIUM).exists()) and not os.environ.get("CI"):
    pytest.skip("needs playwright and Debian's chromium (apt-get install -y chromium)", allow_module_level=True)
pytestmark = pytest.mark.slow  # a browser per test


@pytest.fixture(scope="module")
def dashboard(tmp_path_factory):
    root = tmp_path_factory.mktemp("dashboard") / "sample_traces"
    shutil.copytree(ROOT / "sample_traces", root, ignore=shutil.ignore_patterns(".ttrace"))
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "ttrace_core", "dashboard", str(root), "--port", str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, server)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield chromium
        chromium.close()


def _first_divergence_id() -> str:
    first = BUGGY["first_divergence"]
    return f"{first['phase']}/{first['fqn']}/{first['slot']}"


def _settled(page) -> None:
    page.wait_for_selector("[data-test-script-state=notRunning]", timeout=120_000)


def test_click_the_first_divergence_then_share_the_link(dashboard, browser):
    query = urllib.parse.urlencode({"ref": BUGGY["reference"], "cand": BUGGY["name"]})
    page = browser.new_page(viewport={"width": 1600, "height": 1400})
    page.goto(f"{dashboard}/heatmap?{query}")
    page.wait_for_selector(".js-plotly-plot .scatterlayer path.point", timeout=180_000)
    _settled(page)
    marked = page.locator(".js-plotly-plot").first.locator(".scatterlayer .trace").last.locator("path.point")
    assert marked.count() == 1, "the first divergence is not marked on the heatmap"
    box = marked.bounding_box()
    page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    page.locator(".hoverlayer .hovertext").first.wait_for(timeout=30_000)
    assert "catches errors above" in page.locator(".hoverlayer .hovertext").first.text_content()
    page.mouse.click(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    page.wait_for_function("() => location.pathname.endsWith('/tensor')", timeout=60_000)
    page.get_by_text("Shard map").wait_for(timeout=60_000)
    assert page.get_by_text("smallest error this comparison catches on this tensor: ").count() == 1
    shared = page.url
    assert urllib.parse.parse_qs(urllib.parse.urlparse(shared).query)["tensor"] == [_first_divergence_id()]
    assert page.locator("[data-testid=stException]").count() == 0

    fresh = browser.new_context(viewport={"width": 1600, "height": 1400}).new_page()
    fresh.goto(shared)
    fresh.get_by_text("Shard map").wait_for(timeout=60_000)
    assert fresh.get_by_role("heading", name=_first_divergence_id()).count() == 1
    assert fresh.locator("[data-testid=stException]").count() == 0
    fresh.context.close()
    page.close()


def test_the_runs_page_loads_the_chart_library_before_any_chart(dashboard, browser):
    """Streamlit's frontend loads plotly.js when a page first draws a chart; the dashboard has it loaded while Runs
    shows (ui.preload_charts), so the heatmap opened from there does not wait for it."""
    page = browser.new_page()
    page.goto(f"{dashboard}/runs?" + urllib.parse.urlencode({"ref": BUGGY["reference"], "cand": BUGGY["name"]}))
    page.get_by_role("link", name="Open the heatmap").wait_for(timeout=120_000)
    _settled(page)
    assert page.locator(".js-plotly-plot").count() == 0
    page.wait_for_function("() => performance.getEntriesByType('resource').some(e => /PlotlyChart\\.[^/]*\\.js$/.test(e.name))",
                           timeout=30_000)
    assert page.locator("[data-testid=stException]").count() == 0
    page.close()


def test_a_url_escaping_the_root_is_refused_on_the_page(dashboard, browser):
    page = browser.new_page()
    page.goto(f"{dashboard}/heatmap?" + urllib.parse.urlencode({"ref": BUGGY["reference"], "cand": "../../../etc"}))
    page.get_by_text("outside the dashboard root").wait_for(timeout=60_000)
    assert page.locator("[data-testid=stException]").count() == 0
    assert page.locator(".js-plotly-plot").count() == 0
    page.close()


def test_the_exported_report_draws_offline(dashboard, browser, tmp_path):
    page = browser.new_page(viewport={"width": 1600, "height": 1400})
    page.goto(f"{dashboard}/heatmap?" + urllib.parse.urlencode({"ref": BUGGY["reference"], "cand": BUGGY["name"]}))
    with page.expect_download(timeout=180_000) as download:
        page.get_by_role("button", name="Export report").click(timeout=180_000)
    report = tmp_path / "report.html"
    download.value.save_as(report)
    page.close()
    assert report.stat().st_size < 10 * 2**20
    offline = browser.new_context(offline=True)
    requests = []
    offline.route("**/*", lambda route: (requests.append(route.request.url),
                                         route.continue_() if route.request.url.startswith("file:") else route.abort()))
    viewer = offline.new_page()
    viewer.goto(report.as_uri())
    viewer.wait_for_selector(".js-plotly-plot .scatterlayer path.point", timeout=30_000)
    assert viewer.locator(".js-plotly-plot").count() >= 2  # heatmap and timeline
    assert [url for url in requests if not url.startswith("file:")] == []
    offline.close()


def _matrix_rows(page) -> list[str]:
    """The matrix's row labels, top to bottom as drawn."""
    ticks = page.locator(".js-plotly-plot").first.locator(".ytick text").all()
    return [tick.text_content() for tick in sorted(ticks, key=lambda tick: tick.bounding_box()["y"])]


def _outlines(page):
    return page.locator(".js-plotly-plot").first.locator(".scatterlayer .trace").last.locator("path.point")


def test_the_layout_matrix_opens_a_pairs_heatmap_at_its_module_and_its_link_reproduces_it(dashboard, browser):
    reference = BUGGY["reference"]
    layouts = {s["name"] for s in SAMPLES if s.get("reference") == reference}
    buggy = {s["name"] for s in SAMPLES if s.get("reference") == reference and s.get("expected_exit") == 1}
    page = browser.new_page(viewport={"width": 1600, "height": 1400})
    page.goto(f"{dashboard}/matrix?" + urllib.parse.urlencode({"ref": reference}))
    page.wait_for_selector(".js-plotly-plot .scatterlayer path.point", timeout=300_000)  # compares every pair once
    _settled(page)
    shared = page.url
    query = urllib.parse.parse_qs(urllib.parse.urlparse(shared).query)
    rows = query["cands"][0].split(",")
    assert query["ref"] == [reference] and set(rows) == layouts and query["rows"] == ["modules"]
    assert _matrix_rows(page) == rows
    outlines = _outlines(page)
    assert outlines.count() == len(buggy)  # one first divergence per buggy layout, none for the clean one
    outline = outlines.nth([row for row in rows if row in buggy].index(BUGGY["name"]))
    box = outline.bounding_box()
    page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    page.locator(".hoverlayer .hovertext").first.wait_for(timeout=30_000)
    hover = page.locator(".hoverlayer .hovertext").first.text_content()
    assert BUGGY["name"] in hover and "first divergence of this layout" in hover
    page.mouse.click(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    page.wait_for_function("() => location.pathname.endsWith('/heatmap')", timeout=60_000)
    page.get_by_text("the framed row is").wait_for(timeout=120_000)
    opened = urllib.parse.parse_qs(urllib.parse.urlparse(page.url).query)
    assert (opened["ref"], opened["cand"], opened["module"]) == ([reference], [BUGGY["name"]],
                                                                 [BUGGY["first_divergence"]["fqn"]])
    assert page.locator("[data-testid=stException]").count() == 0
    page.close()

    fresh = browser.new_context(viewport={"width": 1600, "height": 1400}).new_page()
    fresh.goto(shared)
    fresh.wait_for_selector(".js-plotly-plot .scatterlayer path.point", timeout=120_000)
    _settled(fresh)
    assert _matrix_rows(fresh) == rows and _outlines(fresh).count() == len(buggy)
    assert urllib.parse.parse_qs(urllib.parse.urlparse(fresh.url).query) == query
    assert fresh.locator("[data-testid=stException]").count() == 0
    fresh.context.close()


# Issue 41's walk follows the sample the dashboard lands on: its first divergence is one rank's shard.
WALK = next(s for s in SAMPLES if "single_rank_shard" in s)


def _query(page) -> dict[str, str]:
    return {name: values[0] for name, values in urllib.parse.parse_qs(urllib.parse.urlparse(page.url).query).items()}


def _sidebar_link(page, name: str) -> None:
    page.locator("[data-testid=stSidebar]").get_by_role("link", name=name).click()
    page.wait_for_function(f"() => location.pathname.endsWith('/{name.split()[-1].lower()}')", timeout=60_000)


def _no_dead_end(page) -> None:
    assert page.locator("[data-testid=stException]").count() == 0
    assert page.get_by_text("Pick a reference and a candidate on the Runs page first").count() == 0


def _sidebar_keeps_the_pair(page) -> None:
    for name in ("Heatmap", "Tensor", "Localize"):
        href = page.locator("[data-testid=stSidebar]").get_by_role("link", name=name).get_attribute("href")
        query = urllib.parse.parse_qs(urllib.parse.urlparse(href).query)
        assert (query.get("ref"), query.get("cand")) == ([WALK["reference"]], [WALK["name"]]), (name, href)


def _overlapping_headers(page) -> list[tuple[str, str]]:
    """Pairs of the heatmap's column headers whose drawn boxes intersect."""
    boxes = [(tick.text_content(), tick.bounding_box()) for tick in
             page.locator(".js-plotly-plot").first.locator(".xtick text").all()]
    return [(a, b) for i, (a, ba) in enumerate(boxes) for b, bb in boxes[i + 1:]
            if ba["x"] < bb["x"] + bb["width"] and bb["x"] < ba["x"] + ba["width"]
            and ba["y"] < bb["y"] + bb["height"] and bb["y"] < ba["y"] + ba["height"]]


def _plot_width(page) -> float:
    return page.locator(".js-plotly-plot").first.bounding_box()["width"]


def _brightness(rgb: str) -> float:
    return sum(int(v) for v in rgb[rgb.index("(") + 1:rgb.index(")")].split(",")[:3]) / 3


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_the_first_hour_walk_runs_heatmap_outlined_cell_tensor_localize_replay_matrix(dashboard, browser, scheme):
    """Issue 41's walk, clicked as a user would, in the browser's light and dark mode: Runs lands on the single-rank
    sample, "Open the heatmap", the centre of the outlined cell opens the first divergence, whose per-rank error
    shows one bad rank, "Open in Localize" replays the module around it and names the culprit (the zoo's ground
    truth), and the sidebar's Layout matrix shows the reference's layouts; every page keeps the pair, the plots
    follow the theme."""
    first = f"{WALK['first_divergence']['phase']}/{WALK['first_divergence']['fqn']}/{WALK['first_divergence']['slot']}"
    context = browser.new_context(viewport={"width": 1600, "height": 1400}, color_scheme=scheme)
    page = context.new_page()
    page.goto(f"{dashboard}/runs")
    page.get_by_text(f"first divergence at {first}").wait_for(timeout=180_000)  # the landing pair's verdict
    _settled(page)
    assert (_query(page)["ref"], _query(page)["cand"]) == (WALK["reference"], WALK["name"])
    _no_dead_end(page)

    page.get_by_role("link", name="Open the heatmap", exact=True).click()
    page.wait_for_function("() => location.pathname.endsWith('/heatmap')", timeout=60_000)
    page.wait_for_selector(".js-plotly-plot .scatterlayer path.point", timeout=180_000)
    _settled(page)
    assert (_query(page)["ref"], _query(page)["cand"]) == (WALK["reference"], WALK["name"])
    _no_dead_end(page)
    _sidebar_keeps_the_pair(page)
    background = page.evaluate("() => getComputedStyle(document.querySelector('.js-plotly-plot rect.bg')).fill")
    label = page.evaluate("() => getComputedStyle(document.querySelector('.js-plotly-plot .annotation-text')).fill")
    # In dark mode a dark plot area (it stayed white, its grey labels near-invisible); labels stand out in both modes.
    assert (_brightness(background) < 80) == (scheme == "dark"), background
    assert abs(_brightness(background) - _brightness(label)) > 80, (background, label)
    assert page.locator(".js-plotly-plot").first.locator(".xtick text").count() == 8
    assert _overlapping_headers(page) == []  # "param grad param after step" ran together
    if scheme == "light":  # a laptop's window, narrower than the figure: the headers stand up instead
        wide = _plot_width(page)
        page.set_viewport_size({"width": 1280, "height": 1400})
        page.wait_for_function(f"() => document.querySelector('.js-plotly-plot').getBoundingClientRect().width < {wide}")
        page.wait_for_timeout(500)  # plotly lays the ticks out again after the resize
        assert _overlapping_headers(page) == []
        page.set_viewport_size({"width": 1600, "height": 1400})
        page.wait_for_function(f"() => document.querySelector('.js-plotly-plot').getBoundingClientRect().width >= {wide}")
        page.wait_for_timeout(500)
    outline = page.locator(".js-plotly-plot").first.locator(".scatterlayer .trace").last.locator("path.point")
    assert outline.count() == 1
    box = outline.bounding_box()
    centre = (box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    page.mouse.move(*centre)
    page.locator(".hoverlayer .hovertext").first.wait_for(timeout=30_000)
    hover = page.locator(".hoverlayer .hovertext").first.text_content()
    assert hover.startswith(first) and "first divergence" in hover, hover

    page.mouse.click(*centre)
    page.wait_for_function("() => location.pathname.endsWith('/tensor')", timeout=60_000)
    page.get_by_text("Shard map").wait_for(timeout=60_000)
    _settled(page)
    assert _query(page)["tensor"] == first
    assert page.get_by_role("heading", name=first).count() == 1
    assert page.get_by_text("What ratio, mismatch and drift mean").count() == 1
    bad = WALK["single_rank_shard"]
    per_rank = page.locator("[data-testid=stMarkdownContainer]").filter(has_text="Beyond the tolerance (").inner_text()
    assert per_rank.startswith("Beyond the tolerance (") and f"): rank {bad} (" in per_rank, per_rank
    assert f"Within it: rank {1 - bad} (" in per_rank, per_rank  # the other rank of the two is right
    _no_dead_end(page)

    page.get_by_role("button", name="Open in Localize").click()
    page.wait_for_function("() => location.pathname.endsWith('/localize')", timeout=60_000)
    module = WALK["first_divergence"]["fqn"].rsplit(".", 1)[0]  # linear_fc2's input comes from its mlp
    assert (_query(page)["ref"], _query(page)["cand"], _query(page)["module"]) == (WALK["reference"], WALK["name"], module)
    _no_dead_end(page)
    replay = page.get_by_role("button", name="Replay with reference inputs")
    if scheme == "light":  # a laptop's window: the label was cut there ("Replay with referen...")
        page.set_viewport_size({"width": 1100, "height": 1400})
        replay.wait_for(timeout=60_000)
        assert replay.evaluate("b => [b, ...b.querySelectorAll('*')].every(e => e.scrollWidth <= e.clientWidth + 1)")
        page.set_viewport_size({"width": 1600, "height": 1400})
    replay.click(timeout=60_000)
    page.get_by_role("button", name="Cancel").wait_for(timeout=60_000)  # running (a finished one is replayed again)
    verdict = page.get_by_text("Culprit (introduces the error)")
    verdict.wait_for(timeout=300_000)
    assert f"Culprit (introduces the error): {module} " in verdict.inner_text(), verdict.inner_text()
    assert CULPRITS[WALK["bug"]].names_module(module)  # the zoo's ground truth (decoder.layers.*.mlp)
    _settled(page)
    _no_dead_end(page)

    _sidebar_link(page, "Layout matrix")
    page.wait_for_selector(".js-plotly-plot .scatterlayer path.point", timeout=300_000)
    _settled(page)
    layouts = [s["name"] for s in SAMPLES if s.get("reference") == WALK["reference"]]
    assert _query(page)["ref"] == WALK["reference"] and sorted(_query(page)["cands"].split(",")) == sorted(layouts)
    assert sorted(_matrix_rows(page)) == sorted(layouts) and _outlines(page).count() == 1  # one buggy layout
    bar = page.locator(".js-plotly-plot").first.locator(".colorbar").bounding_box()
    assert bar["width"] >= 300, bar  # readable: it was squashed to about 15 px
    # Faded cells (after the first divergence) keep their contrast on this theme's page: opacity made them vanish
    # into the dark one.
    faded = page.evaluate("() => document.querySelector('.js-plotly-plot').data"
                          ".find(t => t.name === 'after the first divergence').marker.color")
    page_background = page.evaluate("() => getComputedStyle(document.querySelector('.stApp')).backgroundColor")
    assert faded and min(contrast_ratio(colour, page_background) for colour in faded) >= 3, (faded, page_background)
    _no_dead_end(page)
    context.close()
