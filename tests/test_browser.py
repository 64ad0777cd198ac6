"""The notebooks in a real JupyterLab, driven with Chromium; and `workbench lab`.

The browser tests copy notebooks/ into a temporary directory, start JupyterLab on a
free loopback port with a random token (isolated Jupyter config, data and runtime
directories, nothing fetched from the network), open the notebooks in headless
Chromium (Playwright, with the system's browser: $WORKBENCH_CHROMIUM, or chromium
on PATH), run all cells and use the widgets as a person would. Screenshots go to
test-artifacts/ at the repository root ($WORKBENCH_TEST_ARTIFACTS overrides it).
"""

from __future__ import annotations

import http.client
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from workbench.cli import lab_command, main

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = REPO / "notebooks"
ARTIFACTS = Path(os.environ.get("WORKBENCH_TEST_ARTIFACTS", REPO / "test-artifacts"))
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--disable-dev-shm-usage"]
# Offline JupyterLab: no news feed, no update check, no PyPI extension listing.
LAB_OFFLINE = ["--LabApp.news_url=None",
               "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
               "--LabApp.extension_manager=readonly"]
SERVER_START_S = 120
RUN_ALL_S = 240  # first kernel start, model load and numba compilation included
QUESTION = "What is the capital of France?"


# -- helpers -------------------------------------------------------------------------------
def _chromium() -> str:
    path = os.environ.get("WORKBENCH_CHROMIUM") or shutil.which("chromium") or \
        shutil.which("chromium-browser")
    if not path:
        pytest.fail("no Chromium: install it (Debian: apt-get install chromium) or set "
                    "$WORKBENCH_CHROMIUM to its executable")
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _jupyter_env(home: Path) -> dict:
    """Environment for a JupyterLab that reads no user config and asks nobody about news."""
    env = dict(os.environ)
    for name in ("config", "data", "runtime", "workspaces", "settings"):
        (home / name).mkdir(parents=True, exist_ok=True)
    env.update(JUPYTER_CONFIG_DIR=str(home / "config"), JUPYTER_DATA_DIR=str(home / "data"),
               JUPYTER_RUNTIME_DIR=str(home / "runtime"),
               JUPYTERLAB_WORKSPACES_DIR=str(home / "workspaces"),
               JUPYTERLAB_SETTINGS_DIR=str(home / "settings"), PYTHONUNBUFFERED="1")
    env.pop("JUPYTER_TOKEN", None)
    notification = home / "settings" / "@jupyterlab" / "apputils-extension"
    notification.mkdir(parents=True, exist_ok=True)
    (notification / "notification.jupyterlab-settings").write_text(
        json.dumps({"fetchNews": "false", "checkForUpdates": False}))
    return env


def _wait_http(url: str, timeout: float, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"JupyterLab exited ({proc.returncode}):\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    pytest.fail(f"JupyterLab did not answer {url} in {timeout} s:\n{log.read_text()[-4000:]}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Lab:
    def __init__(self, url: str, token: str, root: Path, artifacts: Path):
        self.url, self.token, self.root, self.artifacts = url, token, root, artifacts

    def api(self, method: str, path: str) -> object:
        req = urllib.request.Request(f"{self.url}{path}", method=method,
                                     headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(req, timeout=30) as r:
            body = r.read()
        return json.loads(body) if body else None


def _lab(tmp_path_factory, **env: str):
    """A JupyterLab on a copy of notebooks/ (see the module docstring); `env` is added to
    the environment of the server and of its kernels."""
    tmp = tmp_path_factory.mktemp("lab")
    root = tmp / "notebooks"
    shutil.copytree(NOTEBOOKS, root, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    port, token = _free_port(), secrets.token_hex(24)
    log = tmp / "jupyterlab.log"
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1",
           f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
           f"--ServerApp.token={token}", f"--ServerApp.root_dir={root}",
           "--ServerApp.allow_root=True", *LAB_OFFLINE]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env={**_jupyter_env(tmp / "jupyter"), **env})
    url = f"http://127.0.0.1:{port}"
    artifacts = tmp / "artifacts"
    artifacts.mkdir()
    server = Lab(url, token, root, artifacts)
    try:
        _wait_http(f"{url}/api/status?token={token}", SERVER_START_S, proc, log)
        yield server
    finally:
        try:
            for kernel in server.api("GET", "/api/kernels") or []:
                server.api("DELETE", f"/api/kernels/{kernel['id']}")
        except OSError:
            pass
        _stop(proc)
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        for f in [*artifacts.iterdir(), log]:
            shutil.copy2(f, ARTIFACTS / (f.name if not env else f"cold-{f.name}"))


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    for stale in [*ARTIFACTS.glob("*.png"), ARTIFACTS / "jupyterlab.log",
                  ARTIFACTS / "cold-jupyterlab.log"]:
        stale.unlink(missing_ok=True)
    yield from _lab(tmp_path_factory)


@pytest.fixture(scope="module")
def cold_lab(tmp_path_factory, lab):
    """A JupyterLab whose kernels start with an empty kernel cache (a new NUMBA_CACHE_DIR)."""
    cache = tmp_path_factory.mktemp("kernel-cache")
    yield from _lab(tmp_path_factory, NUMBA_CACHE_DIR=str(cache))


@pytest.fixture(scope="module")
def playwright():
    """One Playwright driver for the module (a second sync_playwright() cannot start)."""
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        yield p


@pytest.fixture(scope="module")
def browser_context(playwright, tmp_path_factory):
    profile = tmp_path_factory.mktemp("chromium-profile")
    context = playwright.chromium.launch_persistent_context(
        str(profile), executable_path=_chromium(), headless=True, args=CHROMIUM_ARGS,
        viewport={"width": 1400, "height": 1000})
    try:
        yield context
    finally:
        context.close()


def _new_page(browser_context):
    page = browser_context.new_page()
    page.set_default_timeout(60_000)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.console_errors = errors
    return page


@pytest.fixture
def page(browser_context, lab):
    page = _new_page(browser_context)
    yield page
    page.close()


@pytest.fixture
def cold_page(browser_context, cold_lab):
    page = _new_page(browser_context)
    yield page
    page.close()


def _shot(page, lab: Lab, name: str, locator=None) -> Path:
    path = lab.artifacts / f"{name}.png"
    if locator is not None:
        locator.scroll_into_view_if_needed()
    page.screenshot(path=str(path))
    return path


# Records when each code cell's prompt first shows its execution count ("[7]:").
RECORD_CELL_TIMES = """() => {
    const panel = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden)');
    const done = window.__wbCellsDone = [[0, performance.now(), '']];
    const seen = new Set();
    new MutationObserver(() => {
        for (const cell of panel.querySelectorAll('.jp-CodeCell')) {
            const m = /\\[(\\d+)\\]/.exec(cell.querySelector('.jp-InputPrompt').textContent);
            if (!m || seen.has(m[1])) continue;
            seen.add(m[1]);
            const line = cell.querySelector('.cm-line');
            done.push([Number(m[1]), performance.now(), line ? line.textContent : '']);
        }
    }).observe(panel, {subtree: true, childList: true, characterData: true});
}"""


def _open_and_run_all(page, lab: Lab, notebook: str, before_run: str | None = None,
                      while_running=None, run_all_s: float = RUN_ALL_S
                      ) -> list[tuple[float, str]]:
    """Open `notebook`, wait for its kernel, run all cells, wait until every cell has run.
    `before_run`: JavaScript evaluated before Run All; `while_running(page)` is called once
    the cells have started. Returns (seconds, "[count] first line") per code cell, slowest
    first."""
    # ?reset: a fresh workspace holding this notebook only (not the one open before)
    page.goto(f"{lab.url}/lab/tree/{notebook}?reset&token={lab.token}")
    page.wait_for_selector(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook .jp-Cell",
                           timeout=SERVER_START_S * 1000)
    page.wait_for_selector(
        ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook-ExecutionIndicator"
        "[data-status='idle']", timeout=SERVER_START_S * 1000)
    page.wait_for_selector(".jp-StatusBar-TextItem:has-text('Idle')",
                           timeout=SERVER_START_S * 1000)
    if before_run:
        page.evaluate(before_run)
    page.evaluate(RECORD_CELL_TIMES)
    started = """() => [...document.querySelectorAll(
        '.jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell .jp-InputPrompt')]
        .some(p => /\\[(\\*|\\d+)\\]/.test(p.textContent))"""
    for attempt in range(3):  # a Run All right after the page opened can be lost: retry
        page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell").first.click()
        page.keyboard.press("Escape")  # command mode, the notebook focused
        page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
        page.locator(".lm-Menu-item:not(.lm-mod-disabled) .lm-Menu-itemLabel",
                     has_text="Run All Cells").first.click()
        try:
            page.wait_for_function(started, timeout=20_000, polling=250)
            if attempt:
                print(f"\n{notebook}: Run All needed {attempt + 1} clicks")
            break
        except Exception:
            if attempt == 2:
                _shot(page, lab, f"{Path(notebook).stem}-run-all-not-started")
                raise
    if while_running is not None:
        while_running(page)
    # Every code cell ends with a numeric prompt such as "[7]:" (not "[ ]:" or "[*]:").
    try:
        page.wait_for_function(
            """() => {
                const panel = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden)');
                const prompts = [...panel.querySelectorAll('.jp-CodeCell .jp-InputPrompt')];
                return prompts.length > 0
                    && prompts.every(p => /\\[\\d+\\]/.test(p.textContent));
            }""", timeout=run_all_s * 1000, polling=500)
    except Exception:
        _shot(page, lab, f"{Path(notebook).stem}-run-all-timeout")
        raise
    errors = page.locator(".jp-OutputArea-output[data-mime-type="
                          "'application/vnd.jupyter.error']")
    if errors.count():
        _shot(page, lab, f"{Path(notebook).stem}-error", errors.first)
        pytest.fail(f"{notebook}: a cell raised:\n{errors.first.inner_text()[:3000]}")
    done = sorted(page.evaluate("() => window.__wbCellsDone"))
    return sorted(((round((t - t_before) / 1000, 1), f"[{n}] {line[:40]}")
                   for (_, t_before, _), (n, t, line) in zip(done, done[1:])), reverse=True)


def _walk_to(page, lab: Lab, locator, what: str) -> None:
    """Bring `locator` into the DOM: JupyterLab renders the cells near the view only, so
    walk down from the first cell (command mode's "j" moves to the next cell and scrolls it
    into view) until it is there."""
    page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell").first.click()
    page.keyboard.press("Escape")
    for _ in range(60):
        if locator.count():
            locator.first.scroll_into_view_if_needed()
            return
        page.keyboard.press("j")
        page.wait_for_timeout(300)
    _shot(page, lab, "no-" + what.replace(" ", "-"))
    pytest.fail(f"no {what} in the notebook")


def _send_chat(page, chat, text: str) -> str:
    """Send `text` from the chat cell `chat` (a `.wb-chat` locator); wait for the answer."""
    assistant = chat.locator(".wb-msg.wb-msg-assistant")
    before = assistant.count()
    chat.locator(".wb-chat-input").fill(text)
    chat.locator(".wb-chat-send").click()
    chat.locator(".wb-msg-assistant[data-streaming='false']").nth(before).wait_for(
        timeout=120_000)
    page.wait_for_function("root => root.dataset.generating === 'false'",
                           arg=chat.element_handle(), timeout=120_000)
    return assistant.nth(before).inner_text().strip()


def _pin_a_token(page, lab: Lab, view, name: str) -> str:
    """Click a token of the TokenView `view` (a `.wb-tokens-root` locator) and check that its
    popup sits just below the clicked token, after the redraw the click causes and after
    another (colour by surprisal); returns the popup's title."""
    # a token on one line (a wrapped token has two boxes), not the first, and not selected
    # already (a click on the selected token changes nothing, so nothing is redrawn)
    index = view.evaluate("""root => {
        const spans = [...root.querySelectorAll('.wb-token[data-index]')];
        const ok = spans.find((s, i) => i >= 1 && s.getClientRects().length === 1
                                         && s.textContent.trim()
                                         && !s.classList.contains('wb-selected'));
        return ok ? Number(ok.dataset.index) : -1;
    }""")
    assert index >= 0, view.inner_html()[:2000]
    token = view.locator(f".wb-token[data-index='{index}']")
    popup = view.locator(".wb-alternatives")
    token.scroll_into_view_if_needed()
    token.click()
    popup.wait_for(state="visible", timeout=10_000)
    view.locator(f".wb-token.wb-selected[data-index='{index}']").wait_for(timeout=10_000)

    def check(when: str) -> None:
        page.wait_for_timeout(500)  # the kernel's answer to the click (figures) comes back
        assert popup.is_visible(), f"{when}: the popup closed"
        assert popup.get_attribute("data-index") == str(index)
        t = view.locator(f".wb-token[data-index='{index}']").bounding_box()
        b = popup.bounding_box()
        # just below the token: not at the widget's top-left corner, over the text
        assert abs(b["x"] - t["x"]) <= 3 and 0 <= b["y"] - (t["y"] + t["height"]) <= 30, (
            f"{when}: popup at ({b['x']:.0f}, {b['y']:.0f}), token {index} at "
            f"({t['x']:.0f}, {t['y']:.0f}) to y={t['y'] + t['height']:.0f}")

    check("after the click")
    _shot(page, lab, name, None)
    view.locator(".wb-color-by select").select_option("surprisal")
    check("after colouring by surprisal")
    title = popup.locator(".wb-alternatives-title").inner_text()
    view.locator(".wb-color-by select").select_option("probability")
    return title


# -- the notebooks in the browser ----------------------------------------------------------
@pytest.mark.browser
def test_chat_notebook_in_the_browser(page, lab):
    t0 = time.monotonic()
    _open_and_run_all(page, lab, "01_chat.ipynb")
    run_s = time.monotonic() - t0
    chat_input = page.locator(".wb-chat-input").first
    chat_input.wait_for(state="visible")
    assistant = page.locator(".wb-msg.wb-msg-assistant")
    # The notebook's own `chat.send(...)` cell has answered already.
    assert assistant.count() >= 1 and "Paris" in assistant.first.inner_text()
    before = assistant.count()
    _shot(page, lab, "01_chat-ran", chat_input)

    # Record every state the busy badge and the last assistant message go through.
    page.evaluate("""() => {
        window.__wb = {states: [], texts: []};
        const look = () => {
            for (const b of document.querySelectorAll('.wb-busy'))
                window.__wb.states.push(b.getAttribute('data-state'));
            const msgs = document.querySelectorAll('.wb-msg-assistant');
            if (msgs.length) window.__wb.texts.push(msgs[msgs.length - 1].textContent);
        };
        new MutationObserver(look).observe(document.body, {subtree: true, childList: true,
            attributes: true, attributeFilter: ['data-state'], characterData: true});
    }""")
    chat_input.fill(QUESTION)
    t1 = time.monotonic()
    page.locator(".wb-chat-send").first.click()
    page.wait_for_function("() => window.__wb.states.includes('busy')", timeout=30_000)
    page.wait_for_function(
        f"""() => document.querySelectorAll('.wb-msg-assistant').length > {before}
              && [...document.querySelectorAll('.wb-busy')]
                   .every(b => b.getAttribute('data-state') === 'idle')""",
        timeout=120_000)
    answer_s = time.monotonic() - t1
    answer = assistant.last.inner_text().strip()
    _shot(page, lab, "01_chat-answered", assistant.last)
    assert answer, "the assistant message is empty"
    assert "Paris" in answer, answer
    texts = page.evaluate("() => window.__wb.texts")
    print(f"\n01_chat: run all {run_s:.1f} s, answer {answer_s:.1f} s, "
          f"{len(set(texts))} distinct assistant texts seen while streaming: {answer!r}")
    assert not page.console_errors, page.console_errors


@pytest.mark.browser
def test_tour_shows_its_kernels_compiling_on_a_cold_cache(cold_page, cold_lab):
    """With an empty kernel cache, the tour's first model cell shows the busy badge in its
    compiling state ("⚙ compiling 2/6") while the kernels are prepared, then idle; the
    next cell waits for them and answers."""
    page, lab = cold_page, cold_lab
    record = """() => {
        window.__wb = {states: [], labels: []};
        new MutationObserver(() => {
            for (const b of document.querySelectorAll('.wb-badge.wb-busy')) {
                window.__wb.states.push(b.getAttribute('data-state'));
                window.__wb.labels.push(b.textContent);
            }
        }).observe(document.body, {subtree: true, childList: true, attributes: true,
                                   attributeFilter: ['data-state'], characterData: true});
    }"""

    def compiling(page) -> None:
        page.wait_for_function("() => window.__wb.states.includes('compiling')",
                               timeout=RUN_ALL_S * 1000, polling=100)
        _shot(page, lab, "00_tour-compiling", page.locator(".wb-badge.wb-busy").first)

    t0 = time.monotonic()
    _open_and_run_all(page, lab, "00_tour.ipynb", before_run=record, while_running=compiling)
    labels = page.evaluate("() => window.__wb.labels")
    assert any(label.startswith("⚙ compiling ") and "/" in label for label in labels), labels
    badge = page.locator(".wb-badge.wb-busy").first
    assert badge.get_attribute("data-state") == "idle"
    answer = page.locator(".jp-OutputArea-output", has_text="The capital of France is Paris.")
    assert answer.count() >= 1
    _shot(page, lab, "00_tour-ran", answer.first)
    print(f"\n00_tour on a cold kernel cache: run all {time.monotonic() - t0:.1f} s; badge "
          f"labels seen: {sorted(set(labels))}")
    assert not page.console_errors, page.console_errors


@pytest.mark.browser
def test_json_notebook_shows_an_answer_closed_at_the_budget(page, lab):
    """03_json in the browser: the cell asked for a long poem inside 24 tokens shows a
    valid object, a badge that says so, and "closed at the budget" on its stats line."""
    t0 = time.monotonic()
    _open_and_run_all(page, lab, "03_json.ipynb")
    run_s = time.monotonic() - t0
    cells = page.locator(".wb-json")
    closed = cells.filter(has=page.locator(".wb-chat-stats", has_text="closed at the budget"))
    _walk_to(page, lab, closed, "JSON cell closed at the budget")
    assert closed.count() == 1
    badge = closed.first.locator(".wb-json-badge")
    assert badge.get_attribute("data-state") == "valid", badge.get_attribute("title")
    tree = closed.first.locator(".wb-json-output")
    assert "poem" in tree.inner_text() and "lines" in tree.inner_text()
    _shot(page, lab, "03_json-closed-at-the-budget", closed.first)
    stats = closed.first.locator(".wb-chat-stats").inner_text()

    # Generate once more from the browser: the cell generates, then shows a valid answer.
    cell = closed.first.element_handle()  # its stats line changes while it generates
    cell.evaluate("""root => {
        window.__wb = {generating: []};
        new MutationObserver(() => window.__wb.generating.push(root.dataset.generating))
            .observe(root, {attributes: true, attributeFilter: ['data-generating']});
    }""")
    t1 = time.monotonic()
    cell.query_selector(".wb-json-run").click()
    page.wait_for_function("() => window.__wb.generating.includes('true')", timeout=30_000)
    page.wait_for_function("root => root.dataset.generating === 'false'", arg=cell,
                           timeout=120_000)
    generate_s = time.monotonic() - t1
    badge = cell.query_selector(".wb-json-badge")
    assert badge.get_attribute("data-state") == "valid", badge.get_attribute("title")
    assert cell.query_selector(".wb-json-output .wb-json-node"), cell.inner_html()[-2000:]
    assert cell.query_selector(".wb-error").inner_text() == ""
    _shot(page, lab, "03_json-generated-in-the-browser", closed.first)
    print(f"\n03_json: run all {run_s:.1f} s; {stats}; Generate clicked: valid in "
          f"{generate_s:.1f} s, {cell.query_selector('.wb-chat-stats').inner_text()}")
    assert not page.console_errors, page.console_errors


@pytest.mark.browser
def test_logits_notebook_in_the_browser(page, lab):
    t0 = time.monotonic()
    _open_and_run_all(page, lab, "02_logits_and_entropy.ipynb")
    run_s = time.monotonic() - t0
    tokens = page.locator(".wb-token[data-index]")
    tokens.first.wait_for(state="visible")
    n = tokens.count()
    assert n >= 2
    token = tokens.nth(1)
    token.scroll_into_view_if_needed()
    token.hover()
    popup = page.locator(".wb-alternatives").first
    try:
        popup.wait_for(state="visible", timeout=5_000)
    except Exception:  # the contract allows hover or click
        token.click()
        popup.wait_for(state="visible", timeout=10_000)
    rows = popup.locator(".wb-alt[data-id]")
    assert rows.count() >= 2, popup.inner_html()
    _shot(page, lab, "02_logits-alternatives", None)
    pinned = _pin_a_token(page, lab, page.locator(".wb-tokens-root").first,
                          "02_logits-token-clicked")
    # The figures rendered as images.
    figures = page.locator(".jp-OutputArea-output img")
    assert figures.count() >= 3
    print(f"\n02_logits: run all {run_s:.1f} s, {n} tokens, {rows.count()} alternatives: "
          f"{rows.first.inner_text()!r}; clicked {pinned!r}")
    assert not page.console_errors, page.console_errors


@pytest.mark.browser
def test_branching_notebook_pins_a_token(page, lab):
    """07_branching in the browser: a click on a token of its logits cell shows the
    alternatives just below that token."""
    t0 = time.monotonic()
    cells = _open_and_run_all(page, lab, "07_branching.ipynb", run_all_s=2 * RUN_ALL_S)
    run_s = time.monotonic() - t0
    views = page.locator(".wb-tokens-root")
    _walk_to(page, lab, views, "logits cell")
    pinned = _pin_a_token(page, lab, views.first, "07_branching-token-clicked")
    assert page.locator(".wb-branches").count() >= 1  # compare(0, k=4) listed branches
    print(f"\n07_branching: run all {run_s:.1f} s (slowest cells: {cells[:3]}); "
          f"clicked {pinned!r}")
    assert not page.console_errors, page.console_errors


@pytest.mark.browser
def test_embeddings_notebook_searches_in_the_browser(page, lab):
    """04_embeddings in the browser: a query typed into the similarity cell's search box
    lists the sentences closest in meaning."""
    t0 = time.monotonic()
    _open_and_run_all(page, lab, "04_embeddings.ipynb")
    run_s = time.monotonic() - t0
    cells = page.locator(".wb-similarity")
    _walk_to(page, lab, cells, "similarity cell")
    cell = cells.first
    cell.locator(".widget-text input").fill("someone is having a meal")
    t1 = time.monotonic()
    cell.locator("button", has_text="Search").click()
    results = cell.locator(".wb-neighbours", has=page.locator(
        "caption", has_text="someone is having a meal"))
    results.wait_for(timeout=60_000)
    search_s = time.monotonic() - t1
    best = results.locator("tr").nth(1).inner_text()  # row 0 holds the headings
    _shot(page, lab, "04_embeddings-searched", results)
    assert "A man is eating" in best, results.inner_text()
    print(f"\n04_embeddings: run all {run_s:.1f} s, search {search_s:.1f} s: {best!r}")
    assert not page.console_errors, page.console_errors


@pytest.mark.browser
def test_serve_notebook_keeps_serving_after_run_all(page, lab):
    """06_serve in the browser: after Run All the serve cell still serves, its remote chat
    cell answers from the browser, and Stop then Start serve again on the same URL."""
    t0 = time.monotonic()
    _open_and_run_all(page, lab, "06_serve.ipynb")
    run_s = time.monotonic() - t0
    serve = page.locator(".wb-serve")
    _walk_to(page, lab, serve, "serve cell")
    serve = serve.first
    url = serve.locator(".wb-serve-url")
    assert "serving at http://127.0.0.1:" in url.inner_text(), url.inner_text()
    assert "running" in serve.locator(".wb-serve-counters").inner_text()
    base_url = url.locator("a").inner_text().strip()
    _shot(page, lab, "06_serve-serving", serve)

    chats = page.locator(".wb-chat")
    _walk_to(page, lab, chats, "chat cell")
    t1 = time.monotonic()
    answer = _send_chat(page, chats.first, QUESTION)
    answer_s = time.monotonic() - t1
    _shot(page, lab, "06_serve-remote-chat-answered", chats.first)
    assert "Paris" in answer, answer

    _walk_to(page, lab, page.locator(".wb-serve"), "serve cell")
    serve.locator("button", has_text="Stop").click()
    url.filter(has_text="stopped").wait_for(timeout=30_000)
    serve.locator("button", has_text="Start").click()
    url.filter(has_text="serving at").wait_for(timeout=30_000)
    assert url.locator("a").inner_text().strip() == base_url  # the same port again
    with urllib.request.urlopen(f"{base_url}/models", timeout=30) as r:
        models = [m["id"] for m in json.loads(r.read())["data"]]
    assert "smollm2-135m" in models, models
    _shot(page, lab, "06_serve-restarted", serve)
    print(f"\n06_serve: run all {run_s:.1f} s, remote chat answer {answer_s:.1f} s: "
          f"{answer!r}; restarted at {base_url}")
    assert not page.console_errors, page.console_errors


def _top(locator) -> None:
    """Scroll the notebook so that `locator` starts at the top of the view."""
    locator.evaluate("el => el.scrollIntoView({block: 'start'})")
    locator.page.wait_for_timeout(300)


@pytest.mark.browser
def test_inside_the_model_notebook_in_the_browser(page, lab):
    """08: hover a cell of the lens grid (its top 5), click it (that layer's distribution
    beside the final layer's), switch to the Attention tab (heatmap, head selector, lines
    from the chosen token); screenshots of the grid and of the attention view."""
    t0 = time.monotonic()
    _open_and_run_all(page, lab, "08_inside_the_model.ipynb")
    run_s = time.monotonic() - t0
    lens = page.locator(".wb-lens").first
    lens.wait_for(state="visible")
    cells = lens.locator(".wb-lens-cell[data-layer]")
    n = cells.count()
    assert n == 30 * 10, n  # 30 layers x the 10 tokens of the prompt
    cell = lens.locator(".wb-lens-cell[data-layer='28'][data-pos='9']")
    cell.scroll_into_view_if_needed()
    assert "Paris" in cell.text_content()
    cell.hover()
    popup = lens.locator(".wb-lens-popup")
    popup.wait_for(state="visible", timeout=10_000)
    rows = popup.locator(".wb-lens-popup-row")
    assert rows.count() == 5 and "Paris" in rows.first.inner_text(), popup.inner_html()
    _shot(page, lab, "08_lens-grid-hover", None)
    cell.click()
    detail = lens.locator(".wb-lens-detail")
    detail.wait_for(state="visible", timeout=10_000)
    columns = detail.locator(".wb-lens-dist")
    assert columns.count() == 2
    assert "layer 28" in columns.nth(0).inner_text()
    assert "final layer 29" in columns.nth(1).inner_text()
    assert "Paris" in columns.nth(1).locator(".wb-lens-dist-row").first.inner_text()
    assert "wb-selected" in (cell.get_attribute("class") or "")
    page.mouse.move(0, 0)
    _top(lens)
    _shot(page, lab, "08_lens-grid-detail", None)
    by_probability = cell.evaluate("el => el.style.background")
    lens.locator(".wb-lens-color select").select_option("entropy")
    page.wait_for_function(
        "([el, before]) => el.style.background !== before",
        arg=[cell.element_handle(), by_probability], timeout=10_000)

    lens.locator(".wb-lens-tab[data-tab='attention']").click()
    panel = lens.locator(".wb-attn-panel")
    panel.wait_for(state="visible", timeout=10_000)
    assert lens.locator(".wb-lens-panel").is_hidden()
    heatmap = panel.locator("canvas.wb-attn-heatmap")
    assert heatmap.evaluate("c => c.width") > 0
    heads = panel.locator("select.wb-attn-head option")
    assert heads.count() == 9
    panel.locator("select.wb-attn-head").select_option("4")
    page.wait_for_function(
        "el => el.querySelector('select.wb-attn-head').value === '4'",
        arg=panel.element_handle(), timeout=10_000)
    lines = panel.locator("line.wb-attn-line")
    assert lines.count() >= 1
    weights = [float(lines.nth(i).get_attribute("data-weight")) for i in range(lines.count())]
    assert 0.9 <= sum(weights) <= 1.1 + 0.004 * len(weights), weights
    _top(lens)
    _shot(page, lab, "08_attention-tab", None)
    # the second cell opens on the attention tab: ' it' looking at ' cat'
    second = page.locator(".wb-lens").nth(1)
    _top(second)
    title = second.locator(".wb-attn-lines-title")
    title.wait_for(state="visible", timeout=10_000)
    assert "it" in title.text_content(), title.text_content()
    strongest = max(second.locator("line.wb-attn-line").all(),
                    key=lambda el: float(el.get_attribute("data-weight")))
    assert strongest.get_attribute("data-key") == "1"  # ' cat'
    _shot(page, lab, "08_attention-it-cat", None)
    print(f"\n08_inside_the_model: run all {run_s:.1f} s, {n} grid cells, "
          f"{lines.count()} attention lines")
    assert not page.console_errors, page.console_errors


@pytest.fixture(scope="module")
def mic_context(playwright, tmp_path_factory):
    """Chromium whose microphone plays jfk.wav (its fake capture device), permission granted."""
    from tests.support.shared import shared_file

    jfk = shared_file("data", "whisper", "jfk.wav")
    profile = tmp_path_factory.mktemp("chromium-mic-profile")
    args = [*CHROMIUM_ARGS, "--use-fake-device-for-media-stream",
            "--use-fake-ui-for-media-stream", f"--use-file-for-fake-audio-capture={jfk}"]
    context = playwright.chromium.launch_persistent_context(
        str(profile), executable_path=_chromium(), headless=True, args=args,
        viewport={"width": 1400, "height": 1000}, permissions=["microphone"])
    try:
        yield context
    finally:
        context.close()


@pytest.mark.browser
def test_microphone_cell_records_and_transcribes(mic_context, lab):
    from tests.support.speech import JFK, words

    page = mic_context.new_page()
    page.set_default_timeout(60_000)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    try:
        _open_and_run_all(page, lab, "05_whisper.ipynb")
        record = page.locator(".wb-mic-record").first
        record.wait_for(state="visible")
        record.click()
        page.wait_for_selector(".wb-mic[data-state='recording']", timeout=10_000)
        page.wait_for_timeout(12_000)  # JFK is 11 s; the fake device loops it
        level = page.evaluate("() => document.querySelector('.wb-mic-level').style.width")
        _shot(page, lab, "05_whisper-recording", record)
        page.locator(".wb-mic-stop").first.click()
        page.wait_for_function(
            "() => (document.querySelector('.wb-mic-text') || {}).textContent", timeout=120_000)
        text = page.locator(".wb-mic-text").first.inner_text()
        segments = page.locator(".wb-mic-segment").count()
        _shot(page, lab, "05_whisper-transcribed", record)
        heard = set(words(text)) & set(words(JFK))
        print(f"\n05_whisper: level during recording {level}, {segments} segments: {text!r}")
        assert len(heard) >= 8, text  # a 12 s window of the looping 11 s clip
        assert segments >= 1
        assert page.locator(".wb-mic .wb-error").first.inner_text() == ""
        assert not errors, errors
    finally:
        page.close()


# -- workbench lab ---------------------------------------------------------------------------
def test_lab_help(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["lab", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "usage: workbench lab" in out and "--no-browser" in out and "--port" in out


def test_lab_command_is_offline_and_opens_the_tour(tmp_path):
    cmd = lab_command(tmp_path, "00_tour.ipynb", port=9999, no_browser=True)
    assert cmd[:3] == [sys.executable, "-m", "jupyterlab"]
    assert f"--ServerApp.root_dir={tmp_path}" in cmd
    assert "--ServerApp.default_url=/lab/tree/00_tour.ipynb" in cmd
    assert "--ServerApp.port=9999" in cmd and "--ServerApp.open_browser=False" in cmd
    assert "--LabApp.news_url=None" in cmd


def test_lab_needs_the_notebook(capsys):
    assert main(["lab", "--no-browser", "--notebook", "no_such.ipynb"]) == 1
    assert "no notebook 'no_such.ipynb'" in capsys.readouterr().err


@pytest.mark.browser
def test_lab_serves_the_tour_until_ctrl_c(tmp_path):
    port = _free_port()
    log = tmp_path / "lab.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "workbench.cli", "lab", "--no-browser", "--port", str(port)],
            stdout=out, stderr=subprocess.STDOUT, env=_jupyter_env(tmp_path / "jupyter"),
            start_new_session=True,
            # as from a terminal: a pytest-xdist worker ignores SIGINT, and a child inherits
            # that (JupyterLab without a terminal leaves Ctrl-C to Python's default handler)
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + SERVER_START_S
        location = None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                conn.request("GET", "/")
                location = conn.getresponse().getheader("Location")
                conn.close()
                break
            except OSError:
                time.sleep(0.5)
        assert location and "/lab/tree/00_tour.ipynb" in location, log.read_text()
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in the terminal reaches the whole group
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"JupyterLab still ran 60 s after Ctrl-C:\n{log.read_text()}")
        assert code == 0, log.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
