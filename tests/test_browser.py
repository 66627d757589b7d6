"""The course's widgets render and respond in a real browser.

Widgets that never render are the most common complaint about widget courses, and no kernel-side
test can see them: the JavaScript half of ipywidgets lives in JupyterLab. This test starts
JupyterLab on a free localhost port over scratch copies of the solution notebooks, opens each in
headless Chromium (Debian's /usr/bin/chromium, driven by Playwright; no browser is downloaded),
runs the notebook down to its widget cell, moves a slider with the keyboard and checks that the
chart the widget draws changed and that nothing reported an error. Screenshots of the widget
before and after the move are saved under test-artifacts/browser/.

Needs the `chromium` Debian package (`make system-deps` installs it) and the `playwright` Python
package (the dev extra); without either the test skips and says which is missing.
"""

from __future__ import annotations

import base64
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import nbformat
import pytest

from autograder.settings import REPO_ROOT
from tests.lab_server import Lab, running_lab

pytestmark = pytest.mark.slow

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = REPO_ROOT / "test-artifacts" / "browser"
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
# JupyterLab settings for the test server: attach every cell to the DOM (so a cell can be found
# by its index) and never ask about, or fetch, news and updates.
LAB_SETTINGS = {
    "@jupyterlab/notebook-extension:tracker": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension:notification": {"fetchNews": "false",
                                                    "checkForUpdates": False},
}
OPEN_TIMEOUT_MS = 120_000  # page load, kernel start
RUN_TIMEOUT_MS = 180_000  # every cell above the widget, then the widget cell
UPDATE_TIMEOUT_MS = 60_000  # the widget's callback after one slider move


class WidgetCase(NamedTuple):
    notebook: Path  # a solution notebook
    marker: str  # text that identifies the widget cell
    slider: str  # the description of the slider to move


CASES = [
    WidgetCase(REPO_ROOT / "solutions/day01_logits/day01_logits.ipynb",
               "widgets.interact(plot_temperature", "temperature"),
]
DAY07 = REPO_ROOT / "solutions/day07_sampling/day07_sampling.ipynb"
if DAY07.exists():
    CASES.append(WidgetCase(DAY07, "# Sampling explorer", "temperature"))


def widget_cell_index(notebook: Path, marker: str) -> int:
    """Index of the first code cell whose source contains `marker`."""
    nb = nbformat.read(str(notebook), as_version=4)
    for index, cell in enumerate(nb.cells):
        if cell.cell_type == "code" and marker in cell.source:
            return index
    raise AssertionError(f"no code cell of {notebook.name} contains {marker!r}")


@pytest.fixture(scope="module")
def playwright_api() -> Any:
    """Playwright's sync API; skips the module when the browser or the package is missing."""
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} not found: install Debian's chromium (make system-deps)")
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="playwright is not installed (pip install -e '.[dev]')")
    return sync_api


@pytest.fixture(scope="module")
def lab(playwright_api, tmp_path_factory) -> Iterator[Lab]:
    """One JupyterLab for the module, serving scratch copies of the notebooks under test."""
    scratch = tmp_path_factory.mktemp("browser-lab")
    served = scratch / "notebooks"
    served.mkdir()
    for case in CASES:
        shutil.copy(case.notebook, served / case.notebook.name)
    with running_lab(scratch, command="jupyter", root_dir=served, user_settings=LAB_SETTINGS,
                     extra_args=("--LabApp.expose_app_in_browser=True",)) as server:
        yield server


@pytest.fixture(scope="module")
def browser_context(playwright_api, lab, tmp_path_factory) -> Iterator[Any]:
    """Headless Chromium with a fresh profile that may only talk to the test server."""
    profile = tmp_path_factory.mktemp("chromium-profile")
    with playwright_api.sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(profile), executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS,
            viewport={"width": 1280, "height": 900})
        blocked: list[str] = []

        def only_localhost(route: Any) -> None:
            if route.request.url.startswith(lab.base + "/"):
                route.continue_()
            else:
                blocked.append(route.request.url)
                route.abort()

        context.route("**/*", only_localhost)
        try:
            yield context
        finally:
            context.close()
    if blocked:
        print(f"requests to hosts other than {lab.base} were blocked: {sorted(set(blocked))}")


# JavaScript run in the page. `window.jupyterapp` exists because the server was started with
# --LabApp.expose_app_in_browser; `cell(i)` is the DOM node of cell i of the open notebook.
JS_HELPERS = """
window.tinygptTest = {
  notebook() {
    const widget = window.jupyterapp.shell.currentWidget;
    return widget && widget.content && widget.sessionContext ? widget : null;
  },
  cell(index) {
    const nb = this.notebook();
    return nb && nb.content.widgets[index] ? nb.content.widgets[index].node : null;
  },
  errors(node) {  // texts of tracebacks, errors and broken widgets in the outputs under node
    const texts = [];
    for (const out of node ? node.querySelectorAll('.jp-OutputArea-output') : []) {
      const text = out.innerText;
      const stderr = out.dataset.mimeType === 'application/vnd.jupyter.stderr';
      if ((stderr && /Error|Traceback/.test(text))
          || /Error displaying widget|Failed to load model/.test(text)) texts.push(text);
    }
    return texts;
  },
  chart(index) {  // the last image in the outputs of cell index, or null
    const cell = this.cell(index);
    const images = cell ? cell.querySelectorAll('.jp-OutputArea-output img') : [];
    return images.length ? images[images.length - 1] : null;
  },
};
"""

KERNEL_IDLE = """() => {
  const nb = window.jupyterapp && window.jupyterapp.shell.currentWidget;
  const kernel = nb && nb.sessionContext && nb.sessionContext.session
                 && nb.sessionContext.session.kernel;
  return Boolean(kernel && kernel.status === 'idle' && nb.content.widgets.length > 0);
}"""

# Clear the saved outputs (so everything on screen comes from this run), then run every cell
# above the widget cell and the widget cell; stops at the first cell that raises.
RUN_TO_WIDGET = """async (index) => {
  const app = window.jupyterapp;
  const nb = window.tinygptTest.notebook();
  await app.commands.execute('notebook:clear-all-cell-outputs');
  nb.content.activeCellIndex = index;
  nb.content.deselectAll();
  window.tinygptTest.run = {done: false, ok: null};
  app.commands.execute('notebook:run-all-above')
    .then(ok => ok === false ? false : app.commands.execute('notebook:run-cell'))
    .then(ok => { window.tinygptTest.run = {done: true, ok: ok !== false}; },
          err => { window.tinygptTest.run = {done: true, ok: false, error: String(err)}; });
}"""

# Resolves once something happened: errors in the notebook, or the cells have run and the widget
# cell shows a slider and a chart image element that has not been seen before (the widget's
# callback draws a new image each time it runs; seen ones are marked).
NEW_CHART_OR_ERROR = """(index) => {
  const t = window.tinygptTest;
  const cellErrors = t.errors(t.cell(index));
  if (cellErrors.length) return {errors: cellErrors};
  if (!t.run.done) return null;
  if (!t.run.ok) {
    const errors = t.errors(t.notebook().node);
    return {errors: errors.length ? errors : ['running the cells failed: ' + t.run.error]};
  }
  const chart = t.chart(index);
  const slider = t.cell(index).querySelector('.widget-slider .noUi-handle');
  if (!slider || !chart || chart.dataset.tinygptSeen || !chart.complete) return null;
  chart.dataset.tinygptSeen = 'yes';
  return {chart: chart.getAttribute('src')};
}"""


SHOW_FIRST_ERROR = """() => {
  const nb = window.tinygptTest && window.tinygptTest.notebook();
  const errors = nb ? window.tinygptTest.errors(nb.node) : [];
  const first = nb && [...nb.node.querySelectorAll('.jp-OutputArea-output')]
    .find(out => errors.includes(out.innerText));
  if (first) first.scrollIntoView({block: 'center'});
}"""


def slider_parts(cell: Any, description: str) -> tuple[Any, Any]:
    """(handle, readout) locators of the slider labelled `description` in `cell`."""
    label = cell.page.locator(f"label.widget-label:text-is('{description}')")
    slider = cell.locator(".widget-slider").filter(has=label)
    return slider.locator(".noUi-handle"), slider.locator(".widget-readout")


def wait_for_new_chart(page: Any, index: int, timeout_ms: int, what: str) -> str:
    """The src of the next new chart in cell `index`; fails on notebook errors or a timeout."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    try:
        outcome = page.wait_for_function(NEW_CHART_OR_ERROR, arg=index,
                                         timeout=timeout_ms, polling=200).json_value()
    except PlaywrightTimeout:
        pytest.fail(f"no new chart within {timeout_ms / 1000:.0f} s {what}")
    assert "errors" not in outcome, f"the notebook reported errors {what}:\n" + "\n---\n".join(
        outcome["errors"])
    return outcome["chart"]


def png_bytes(src: str) -> bytes:
    """The bytes of an <img> src written as a data: URL of a PNG."""
    prefix = "data:image/png;base64,"
    assert src.startswith(prefix), f"the chart is not an inline PNG: {src[:60]!r}"
    return base64.b64decode(src[len(prefix):])


@pytest.mark.parametrize("case", CASES, ids=[case.notebook.stem for case in CASES])
def test_widget_renders_and_responds(case: WidgetCase, lab: Lab, browser_context: Any,
                                     playwright_api: Any) -> None:
    index = widget_cell_index(case.notebook, case.marker)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    stem = case.notebook.stem
    before, after = ARTIFACTS / f"{stem}-before.png", ARTIFACTS / f"{stem}-after.png"
    failure = ARTIFACTS / f"{stem}-failure.png"
    for old in (before, after, failure):
        old.unlink(missing_ok=True)
    page = browser_context.new_page()
    page_errors: list[str] = []
    page.on("pageerror", lambda err: page_errors.append(str(err)))
    try:
        # ?reset: a fresh workspace, so no tab of an earlier case is restored.
        page.goto(lab.url(f"/lab/tree/{case.notebook.name}?reset"))
        page.wait_for_function(KERNEL_IDLE, timeout=OPEN_TIMEOUT_MS)
        page.evaluate(JS_HELPERS)
        panel = page.evaluate("window.tinygptTest.notebook().node.id")
        cell = page.locator(f"[id='{panel}'] .jp-Notebook .jp-Cell").nth(index)
        page.evaluate(RUN_TO_WIDGET, index)
        chart_before = wait_for_new_chart(page, index, RUN_TIMEOUT_MS,
                                          "after running the notebook down to the widget")

        outputs = cell.locator(".jp-Cell-outputArea")
        outputs.scroll_into_view_if_needed()
        outputs.screenshot(path=str(before))
        handle, readout = slider_parts(cell, case.slider)
        value_before = readout.inner_text()
        handle.focus()
        page.keyboard.press("PageDown")  # five steps down
        playwright_api.expect(readout).not_to_have_text(value_before, timeout=10_000)
        value_after = readout.inner_text()
        chart_after = wait_for_new_chart(
            page, index, UPDATE_TIMEOUT_MS,
            f"after moving {case.slider!r} from {value_before} to {value_after}")
        outputs.screenshot(path=str(after))
        print(f"screenshots: {before} {after}")
        same_chart = png_bytes(chart_after) == png_bytes(chart_before)
        assert not same_chart, (
            f"moving {case.slider!r} from {value_before} to {value_after} redrew the chart "
            "without changing it")
        assert not page_errors, f"JavaScript errors in the page: {page_errors}"
    except BaseException:
        try:
            page.evaluate(SHOW_FIRST_ERROR)
            page.screenshot(path=str(failure))
            print(f"screenshot of the page at the failure: {failure}")
        except Exception as err:
            print(f"no screenshot of the page at the failure: {err}")
        print(f"end of the server log:\n{lab.log_text()[-4000:]}")
        raise
    finally:
        shutdown_kernel(page)
        page.close()


def shutdown_kernel(page: Any) -> None:
    """Shut the notebook's kernel down so the next case starts with the CPU to itself."""
    try:
        page.evaluate("""async () => {
          const nb = window.jupyterapp && window.jupyterapp.shell.currentWidget;
          if (nb && nb.sessionContext) await nb.sessionContext.shutdown();
        }""")
    except Exception as err:  # the page may already be gone; the server's stop ends the kernel
        print(f"kernel shutdown from the page failed: {err}")
