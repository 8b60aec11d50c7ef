"""A headless Chromium driven over the DevTools protocol, and the trainguard pages of the Temporal UI.

The protocol runs over a pipe (``--remote-debugging-pipe``: the browser reads commands on its
fd 3 and writes replies on its fd 4, each message JSON ended by a NUL byte), so nothing beyond
the standard library and Debian's ``chromium`` package is needed: no driver, no websocket
library, no browser download. Every wait polls the page with a deadline.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
import urllib.parse
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from infra.processes import log_tail, stop_pid

CHROMIUM = "/usr/bin/chromium"
# The browser talks to the local stack only: no proxy, nothing fetched in the background
# (a closed network refuses those connections and the browser keeps retrying them).
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--no-proxy-server",
    "--hide-scrollbars",
    "--remote-debugging-pipe",
)
_INSTALL_TIMEOUT_S = 900.0
_COMMAND_TIMEOUT_S = 60.0


class BrowserUnavailable(RuntimeError):
    """Chromium is not installed and cannot be installed here."""


class BrowserError(RuntimeError):
    """The browser refused a command, died, or a page never reached the awaited state."""


def find_chromium() -> str | None:
    """The Chromium binary: Debian's, else one on PATH."""
    if os.access(CHROMIUM, os.X_OK):
        return CHROMIUM
    return shutil.which("chromium") or shutil.which("chromium-browser")


def ensure_chromium() -> str:
    """The Chromium binary, installed with apt-get when missing and this process may (root)."""
    found = find_chromium()
    if found is not None:
        return found
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise BrowserUnavailable(
            "chromium is not installed and installing it needs apt-get as root: apt-get install chromium"
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "chromium"]  # with its recommended fonts
    problem = ""
    # Stale package lists make the first try fail: refresh them once and retry.
    for argv in (install, ["apt-get", "update"], install):
        try:
            done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=_INSTALL_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            problem = f"{' '.join(argv)} took over {_INSTALL_TIMEOUT_S:.0f}s"
            continue
        if argv is install and done.returncode == 0:
            break
        problem = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
    found = find_chromium()
    if found is None:
        raise BrowserUnavailable(f"apt-get install chromium failed: {problem}")
    return found


class Browser:
    """One headless Chromium with a fresh profile, stopped (profile removed) on exit."""

    def __init__(self, binary: str | None = None, log_path: Path | None = None) -> None:
        self.binary = binary or ensure_chromium()
        self.log_path = log_path
        self.pid: int | None = None
        self._profile: str | None = None
        self._to_browser: int | None = None
        self._from_browser: int | None = None
        self._log: Path | None = None
        self._buffer = b""
        self._next_id = 0

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def start(self) -> None:
        self._profile = tempfile.mkdtemp(prefix="tg-chromium-")
        cmd_read, cmd_write = os.pipe()
        reply_read, reply_write = os.pipe()
        self._log = self.log_path or Path(self._profile) / "chromium.log"
        log_fd = os.open(self._log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        # Sources above 10 so that placing them on fds 3 and 4 cannot overwrite one another.
        sources = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10) for fd in (cmd_read, reply_write, log_fd)]
        for fd in (cmd_read, reply_write, log_fd):
            os.close(fd)
        child_cmd, child_reply, child_log = sources
        argv = [self.binary, *FLAGS, f"--user-data-dir={self._profile}", "about:blank"]
        try:
            # posix_spawn, not Popen: only it places arbitrary fds on fixed numbers without
            # running Python in the child (unsafe while the Temporal client's threads run).
            self.pid = os.posix_spawn(
                self.binary,
                argv,
                os.environ,
                file_actions=[
                    (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                    (os.POSIX_SPAWN_DUP2, child_log, 1),
                    (os.POSIX_SPAWN_DUP2, child_log, 2),
                    (os.POSIX_SPAWN_DUP2, child_cmd, 3),
                    (os.POSIX_SPAWN_DUP2, child_reply, 4),
                ],
                setsid=True,  # its own group: stopping it stops its renderers too
            )
        finally:
            for fd in sources:
                os.close(fd)
        self._to_browser, self._from_browser = cmd_write, reply_read
        try:
            self.send("Browser.getVersion")  # the first reply: the browser is up
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for fd in (self._to_browser, self._from_browser):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._to_browser = self._from_browser = None
        if self.pid is not None:
            stop_pid(self.pid, grace_s=5.0)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(self.pid, 0)
            self.pid = None
        if self._profile is not None:
            shutil.rmtree(self._profile, ignore_errors=True)
            self._profile = None

    def send(
        self,
        method: str,
        params: dict[str, Any] | None = None,
        session: str | None = None,
        timeout_s: float = _COMMAND_TIMEOUT_S,
    ) -> dict[str, Any]:
        """One protocol command; its result (events that arrive meanwhile are dropped)."""
        if self._to_browser is None:
            raise BrowserError("the browser is not running")
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if session is not None:
            message["sessionId"] = session
        data = json.dumps(message).encode() + b"\0"
        try:
            while data:
                data = data[os.write(self._to_browser, data) :]
        except BrokenPipeError:
            raise self._exited(method) from None
        deadline = time.monotonic() + timeout_s
        while True:
            reply = self._read_message(deadline, method)
            if reply.get("id") != self._next_id:
                continue
            if "error" in reply:
                raise BrowserError(f"{method}: {reply['error'].get('message', reply['error'])}")
            result: dict[str, Any] = reply.get("result", {})
            return result

    def _read_message(self, deadline: float, method: str) -> dict[str, Any]:
        assert self._from_browser is not None
        while b"\0" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise BrowserError(f"{method}: no reply from the browser")
            readable, _, _ = select.select([self._from_browser], [], [], remaining)
            if not readable:
                continue
            chunk = os.read(self._from_browser, 1 << 16)
            if not chunk:
                raise self._exited(method)
            self._buffer += chunk
        raw, self._buffer = self._buffer.split(b"\0", 1)
        message: dict[str, Any] = json.loads(raw)
        return message

    def _exited(self, method: str) -> BrowserError:
        return BrowserError(f"{method}: the browser exited; its log ends:\n{log_tail(self._log)}")

    def new_page(self, width: int = 1440, height: int = 900) -> Page:
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        page = Page(self, session)
        page.send("Page.enable")
        page.send(
            "Emulation.setDeviceMetricsOverride",
            {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
        )
        return page


class Page:
    """One tab: navigate, evaluate JavaScript, wait on the DOM, take screenshots."""

    def __init__(self, browser: Browser, session: str) -> None:
        self.browser = browser
        self.session = session

    def send(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        return self.browser.send(method, params, session=self.session)

    def goto(self, url: str, timeout_s: float = 60.0) -> None:
        """Load ``url``; returns once the new document has loaded (never still the previous one)."""
        self.evaluate("window.__tgPrevious = true")
        reply = self.send("Page.navigate", {"url": url})
        if reply.get("errorText"):
            raise BrowserError(f"cannot open {url}: {reply['errorText']}")
        self.wait_for("!window.__tgPrevious && document.readyState === 'complete'", url, timeout_s)

    def evaluate(self, expression: str) -> Any:
        """The JSON value of a JavaScript expression (promises awaited)."""
        reply = self.send(
            "Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True}
        )
        if "exceptionDetails" in reply:
            details = reply["exceptionDetails"]
            text = details.get("exception", {}).get("description") or details.get("text")
            raise BrowserError(f"script failed: {text}")
        return reply["result"].get("value")

    def wait_for(self, expression: str, what: str, timeout_s: float = 60.0) -> Any:
        """Poll ``expression`` until it is truthy; its value. Fails naming ``what`` and the page."""
        deadline = time.monotonic() + timeout_s
        interval = 0.05
        problem = ""
        while True:
            try:
                value = self.evaluate(expression)
                if value:
                    return value
                problem = ""
            except BrowserError as exc:  # a navigation replaced the document mid-evaluation
                problem = f" ({exc})"
            if time.monotonic() > deadline:
                raise BrowserError(f"{what} not shown in {timeout_s:.0f}s on {self.url()}{problem}")
            time.sleep(interval)
            interval = min(interval * 1.5, 0.5)

    def follow(
        self, selector: str, arrived: str, what: str, timeout_s: float = 60.0, retry_s: float = 20.0
    ) -> None:
        """Click the element matching ``selector`` once it is there, until ``arrived`` holds.

        One click per ``retry_s``: a single-page app drops a navigation still loading when the
        link is clicked again, so clicking on every poll could keep it from ever arriving.
        """
        deadline = time.monotonic() + timeout_s
        element = f"document.querySelector({json.dumps(selector)})"
        while True:
            self.wait_for(f"!!{element}", f"the link to {what}", max(deadline - time.monotonic(), 0.0))
            self.evaluate(f"{element}?.click()")
            try:
                self.wait_for(arrived, what, min(retry_s, max(deadline - time.monotonic(), 0.0)))
                return
            except BrowserError:
                if time.monotonic() >= deadline:
                    raise

    def url(self) -> str:
        with contextlib.suppress(BrowserError):
            return str(self.evaluate("location.href"))
        return "?"

    def text(self) -> str:
        """The visible text of the page."""
        return str(self.evaluate("document.body ? document.body.innerText : ''"))

    def screenshot(self, path: Path) -> Path:
        data = self.send("Page.captureScreenshot", {"format": "png"})["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path


# ----- the Temporal UI -------------------------------------------------------------------------
# What the checks below rely on, as of Temporal UI 2.54 (the one `temporal server start-dev`
# serves): the workflow list takes a visibility query in `?query=`, its rows link to
# `/namespaces/NS/workflows/ID/RUN/...`, an empty result says "No Workflows Found", and a
# workflow's "User Metadata" tab renders its current details in a same-origin iframe.

NO_WORKFLOWS = "No Workflows Found"
CURRENT_DETAILS_FRAME = "user-metadata-current-details"


def workflows_url(ui_url: str, namespace: str, query: str) -> str:
    """The UI's workflow list filtered by a visibility query."""
    ns = urllib.parse.quote(namespace, safe="")
    return f"{ui_url}/namespaces/{ns}/workflows?query={urllib.parse.quote(query, safe='')}"


def show_workflows(page: Page, ui_url: str, namespace: str, query: str, timeout_s: float = 90.0) -> list[str]:
    """Open the workflow list for ``query``; the workflow ids it shows, once it shows any or none."""
    page.goto(workflows_url(ui_url, namespace, query))
    prefix = f"/namespaces/{urllib.parse.quote(namespace, safe='')}/workflows/"
    hrefs: list[str] = page.wait_for(
        f"""(() => {{
            const links = [...document.querySelectorAll('table a[href*={json.dumps(prefix)}]')];
            if (links.length) return links.map(a => a.getAttribute('href'));
            return document.body.innerText.includes({json.dumps(NO_WORKFLOWS)}) ? [''] : null;
        }})()""",
        f"the workflow list for {query!r}",
        timeout_s,
    )
    ids = [urllib.parse.unquote(h.split(prefix, 1)[1].split("/", 1)[0]) for h in hrefs if prefix in h]
    return list(dict.fromkeys(ids))


def open_job(page: Page, workflow_id: str, timeout_s: float = 90.0) -> str:
    """From the workflow list on ``page``, open the workflow at its current details; their text,
    one line per paragraph (the UI's Markdown shows a/b with a fraction slash, U+2044)."""
    link = json.dumps(f"/workflows/{urllib.parse.quote(workflow_id, safe='')}/")
    page.follow(
        f"table a[href*={link}]",
        f"location.pathname.includes({link})",
        f"the page of {workflow_id}",
        timeout_s,
    )
    page.follow(
        'a[href$="/user-metadata"]',
        "location.pathname.endsWith('/user-metadata')",
        f"the User Metadata tab of {workflow_id}",
        timeout_s,
    )
    frame = json.dumps(CURRENT_DETAILS_FRAME)
    text: str = page.wait_for(
        f"""(() => {{
            const body = document.getElementById({frame})?.contentDocument?.body;
            const text = body ? body.innerText.trim() : '';
            return text.includes({json.dumps(workflow_id)}) ? text : null;
        }})()""",
        f"the current details of {workflow_id}",
        timeout_s,
    )
    page.evaluate("document.activeElement && document.activeElement.blur()")  # no focus ring in shots
    return _lines(text)


def _lines(text: str) -> str:
    return "\n".join(line.strip() for line in text.splitlines() if line.strip())


def screenshot_job(page: Page, path: Path, timeout_s: float = 60.0) -> str:
    """Screenshot of a job's page opened by ``open_job``, its current details painted; the text
    of the details in the shot (newer than ``open_job``'s when the UI refreshed them).

    The details frame paints a little after its text is in the DOM, and the UI reloads it while
    the workflow changes: the shot is taken two animation frames after the text is there, and
    taken again if the frame's document was replaced meanwhile.
    """
    frame = json.dumps(CURRENT_DETAILS_FRAME)
    marked = f"""(() => {{
        const f = document.getElementById({frame});
        const d = f && f.contentDocument;
        if (!d || !d.body || !d.body.innerText.trim()) return false;
        d.__tgShot = true;
        const w = f.contentWindow;
        return new Promise(done => {{
            w.requestAnimationFrame(() => w.requestAnimationFrame(() => done(true)));
            setTimeout(() => done(false), 2000);  // a frame that is not rendered gets no animation frames
        }});
    }})()"""
    unchanged = f"""(() => {{
        const d = document.getElementById({frame})?.contentDocument;
        return d && d.__tgShot && d.body ? d.body.innerText.trim() : '';
    }})()"""
    deadline = time.monotonic() + timeout_s
    while True:
        page.wait_for(marked, "the painted current details", max(deadline - time.monotonic(), 0.0))
        page.screenshot(path)
        text = str(page.evaluate(unchanged))
        if text:
            return _lines(text)
        if time.monotonic() > deadline:
            raise BrowserError(f"the current details kept reloading for {timeout_s:.0f}s on {page.url()}")
