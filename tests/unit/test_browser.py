"""The DevTools-over-pipe browser on pages served locally: evaluation, waits with deadlines,
screenshots, a clean stop, and the Temporal UI walk against a miniature of its pages."""

from __future__ import annotations

import threading
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from infra import browser as browser_mod
from infra.browser import (
    Browser,
    BrowserError,
    BrowserUnavailable,
    Page,
    open_job,
    screenshot_job,
    show_workflows,
    workflows_url,
)
from infra.processes import pid_alive
from trainguard.agent.ports import LOOPBACK

DETAILS = "<p><strong>job-a</strong> — phase <code>running</code>, step 7/80</p>\n\n<p>ETTR 0.5</p>"


def _ui_page(path: str, query: dict[str, list[str]]) -> str:
    """A miniature of the UI: the list (filtered by phase), a job page, its User Metadata tab."""
    base = "/namespaces/default/workflows"
    if path == base:
        rows = ""
        if "running" in query.get("query", [""])[0]:
            rows = "".join(
                f'<tr><td><a href="{base}/{wf}/run-1/history">{wf}</a></td>'
                f'<td><a href="{base}/{wf}/run-1/history">run-1</a></td></tr>'
                for wf in ("job-a", "job-b")
            )
        empty = "" if rows else "<p>No Workflows Found</p>"
        # Rows appear later, as when the UI fetches them after the page loads.
        return (
            f"<table><tbody id='rows'></tbody></table>{empty}"
            f"<script>setTimeout(() => document.getElementById('rows').innerHTML = {rows!r}, 300)</script>"
        )
    if path.endswith("/history"):
        return f'<h1>job</h1><a href="{path.rsplit("/", 1)[0]}/user-metadata">User Metadata</a>'
    if path.endswith("/user-metadata"):
        src = "/render?content=" + urllib.parse.quote(DETAILS)
        return f'<iframe id="user-metadata-current-details" src="{src}"></iframe>'
    if path == "/render":
        return query["content"][0]
    return "<p>nothing here</p>"


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        body = _ui_page(url.path, urllib.parse.parse_qs(url.query)).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def ui_url() -> Iterator[str]:
    server = ThreadingHTTPServer((LOOPBACK, 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://{LOOPBACK}:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def browser(chromium: str) -> Iterator[Browser]:
    with Browser(chromium) as b:
        yield b


@pytest.fixture
def page(browser: Browser) -> Page:
    return browser.new_page(width=800, height=600)


def test_evaluate_wait_and_screenshot(page: Page, ui_url: str, tmp_path: Path) -> None:
    page.goto(f"{ui_url}/anything")
    assert page.evaluate("1 + 2") == 3
    assert "nothing here" in page.text()
    page.evaluate("setTimeout(() => document.body.dataset.late = 'yes', 200)")
    assert page.wait_for("document.body.dataset.late", "a late attribute", timeout_s=10) == "yes"
    with pytest.raises(BrowserError, match="never shown not shown"):
        page.wait_for("false", "never shown", timeout_s=0.3)
    with pytest.raises(BrowserError, match="script failed"):
        page.evaluate("no_such_name")
    shot = page.screenshot(tmp_path / "shot.png")
    assert shot.read_bytes().startswith(b"\x89PNG")


def test_walks_list_to_current_details(page: Page, ui_url: str, tmp_path: Path) -> None:
    assert show_workflows(page, ui_url, "default", 'TgPhase = "completed"') == []
    assert show_workflows(page, ui_url, "default", 'TgPhase = "running"') == ["job-a", "job-b"]
    details = open_job(page, "job-a")
    assert details == "job-a — phase running, step 7/80\nETTR 0.5"
    assert page.url().endswith("/job-a/run-1/user-metadata")
    assert screenshot_job(page, tmp_path / "job.png") == details
    assert (tmp_path / "job.png").read_bytes().startswith(b"\x89PNG")


def test_close_stops_the_browser(chromium: str) -> None:
    b = Browser(chromium)
    b.start()
    pid = b.pid
    assert pid is not None and pid_alive(pid)
    b.close()
    assert not pid_alive(pid)
    with pytest.raises(BrowserError, match="not running"):
        b.send("Browser.getVersion")


def test_workflows_url_quotes_the_query() -> None:
    url = workflows_url("http://h:1", "default", 'TgPhase = "running"')
    assert url == "http://h:1/namespaces/default/workflows?query=TgPhase%20%3D%20%22running%22"


def test_no_chromium_and_no_way_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(browser_mod, "find_chromium", lambda: None)
    monkeypatch.setattr(browser_mod.os, "geteuid", lambda: 1000)
    with pytest.raises(BrowserUnavailable, match="apt-get as root"):
        browser_mod.ensure_chromium()


def test_a_browser_that_dies_at_start_is_reported_with_its_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = tmp_path / "chromium"
    fake.write_text("#!/bin/sh\necho 'cannot open display' >&2\nexit 1\n")
    fake.chmod(0o755)
    profile = tmp_path / "profile"
    monkeypatch.setattr(browser_mod.tempfile, "mkdtemp", lambda prefix: str(profile.mkdir() or profile))
    b = Browser(str(fake))
    with pytest.raises(BrowserError, match=r"the browser exited(.|\n)*cannot open display"):
        b.start()
    assert b.pid is None  # reaped
    assert not profile.exists()
