"""The HTML report in a real browser: headless Chromium over the DevTools protocol, network off.

Loads the report from file://, then checks: no console errors or exceptions, key content visible,
the table script ran, and a module named <script>alert(1)</script> shows as text (no dialog, no
extra script element). Saves a screenshot to tests/artifacts/report.png. Needs only the standard
library: a small websocket client speaks the DevTools protocol.
"""

import base64
import json
import os
import shutil
import socket
import struct
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from gradaudit.report import html

CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None)
ARTIFACTS = Path(__file__).parent / "artifacts"

pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (CI installs it)")]


class DevTools:
    """Just enough of RFC 6455 and the DevTools protocol: masked text frames out, frames in."""

    def __init__(self, ws_url: str, timeout: float = 30.0) -> None:
        rest = ws_url.split("://", 1)[1]
        hostport, _, path = rest.partition("/")
        host, _, port = hostport.partition(":")
        self.sock = socket.create_connection((host, int(port)), timeout=timeout)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall((f"GET /{path} HTTP/1.1\r\nHost: {hostport}\r\nUpgrade: websocket\r\n"
                           f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
                           "Sec-WebSocket-Version: 13\r\n\r\n").encode())
        response = b""
        while b"\r\n\r\n" not in response:
            response += self.sock.recv(1)
        assert b" 101 " in response.split(b"\r\n", 1)[0], response
        self.next_id = 0
        self.events: list[dict] = []

    def _read(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            if not chunk:
                raise ConnectionError("DevTools connection closed")
            data += chunk
        return data

    def _frame(self) -> bytes:
        message = b""
        while True:
            first, second = self._read(2)
            length = second & 0x7F
            if length == 126:
                length = struct.unpack(">H", self._read(2))[0]
            elif length == 127:
                length = struct.unpack(">Q", self._read(8))[0]
            payload = self._read(length)
            message += payload
            if first & 0x80:  # FIN: the last fragment
                return message

    def send(self, method: str, **params) -> dict:
        self.next_id += 1
        payload = json.dumps({"id": self.next_id, "method": method, "params": params}).encode()
        header = bytes([0x81])
        if len(payload) < 126:
            header += bytes([0x80 | len(payload)])
        elif len(payload) < 1 << 16:
            header += bytes([0x80 | 126]) + struct.pack(">H", len(payload))
        else:
            header += bytes([0x80 | 127]) + struct.pack(">Q", len(payload))
        mask = os.urandom(4)
        self.sock.sendall(header + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))
        while True:
            message = json.loads(self._frame())
            if message.get("id") == self.next_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})
            self.events.append(message)

    def wait_for(self, method: str, timeout: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for event in self.events:
                if event.get("method") == method:
                    return event
            self.events.append(json.loads(self._frame()))
        raise TimeoutError(method)

    def evaluate(self, expression: str):
        result = self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        assert "exceptionDetails" not in result, result
        return result["result"].get("value")


@pytest.fixture
def browser(tmp_path):
    profile = tmp_path / "profile"
    process = subprocess.Popen(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={profile}", "--remote-debugging-port=0", "--window-size=1280,2000",
         "--hide-scrollbars",
         # networking unavailable: every host resolves nowhere and any proxy use goes to a dead port
         "--host-resolver-rules=MAP * ~NOTFOUND", "--proxy-server=127.0.0.1:9", "about:blank"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text().strip()):
            if time.monotonic() > deadline or process.poll() is not None:
                pytest.fail("chromium did not start its DevTools endpoint")
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as response:
            targets = json.load(response)
        page = next(t for t in targets if t["type"] == "page")
        tools = DevTools(page["webSocketDebuggerUrl"])
        yield tools
        tools.sock.close()
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()


def test_report_in_headless_chromium(browser, tmp_path, hostile_report, golden):
    report = hostile_report
    path = tmp_path / "report.html"
    path.write_text(html.render(report), encoding="utf-8")

    browser.send("Runtime.enable")
    browser.send("Log.enable")
    browser.send("Page.enable")
    browser.send("Network.enable")
    browser.send("Network.emulateNetworkConditions", offline=True, latency=0, downloadThroughput=-1,
                 uploadThroughput=-1)
    browser.send("Page.navigate", url=path.as_uri())
    browser.wait_for("Page.loadEventFired")

    assert browser.evaluate("document.title") == f"gradaudit: {report.model}"
    # key content visible: the cards, each section, the table filled by the script
    visible = browser.evaluate("""
        Array.from(document.querySelectorAll('.card, #memory .row, #findings .rule, svg.timeline, #tensor-table tbody tr'))
             .filter(e => { const r = e.getBoundingClientRect(); return r.width > 0 && r.height > 0; }).length""")
    cards = 5
    assert visible >= cards + len(report.modules) + 1 + len(report.tensors)
    cards_text = browser.evaluate("document.querySelector('#summary').innerText")
    assert "HELD BY AUTOGRAD" in cards_text.upper() and "40 KiB" in cards_text  # 40960 B, see text tests
    assert browser.evaluate("document.querySelector('#count').textContent") == \
        f"{len(report.tensors)} of {len(report.tensors)} saved tensors"

    # the module name is text everywhere, never markup: no dialog, no third script element
    assert browser.evaluate("document.querySelectorAll('script').length") == 2
    assert browser.evaluate(f"""
        Array.from(document.querySelectorAll('#tensor-table td')).some(td => td.textContent === {json.dumps(golden.MARKUP + '.1')})""")
    assert golden.MARKUP in browser.evaluate("document.querySelector('#memory').innerText")

    # filtering and sorting work
    browser.evaluate("""(() => { const f = document.getElementById('filter'); f.value = 'GA101';
        f.dispatchEvent(new Event('input')); return new Promise(r => setTimeout(r, 300)); })()""")
    ga101 = sum(1 for t in report.tensors if t.rule == "GA101")
    assert browser.evaluate("document.querySelectorAll('#tensor-table tbody tr').length") == ga101
    browser.evaluate("""(() => { const f = document.getElementById('filter'); f.value = '';
        f.dispatchEvent(new Event('input')); document.querySelector('th[data-key=view_bytes]').click(); })()""")
    first = browser.evaluate("document.querySelector('#tensor-table tbody tr td:nth-child(7)').textContent")
    largest = max(report.tensors, key=lambda t: t.view_nbytes)
    assert (largest.module, largest.attr) == ("fc", "mat2")  # fc.weight.t(): 512*10*4 = 20480 B
    assert first == "20 KiB"
    browser.evaluate("window.scrollTo(0, 0)")

    ARTIFACTS.mkdir(exist_ok=True)
    shot = browser.send("Page.captureScreenshot", format="png", captureBeyondViewport=False)
    (ARTIFACTS / "report.png").write_bytes(base64.b64decode(shot["data"]))

    errors = [e for e in browser.events
              if e.get("method") in ("Runtime.exceptionThrown", "Page.javascriptDialogOpening")
              or (e.get("method") == "Runtime.consoleAPICalled" and e["params"]["type"] in ("error", "assert"))
              or (e.get("method") == "Log.entryAdded" and e["params"]["entry"]["level"] == "error")]
    assert errors == []


def test_graph_panel_opens_on_the_first_op_of_a_long_sequential(browser, tmp_path):
    """A 10-layer nn.Sequential: the graph panel shows graph nodes when it opens (it used to open on an
    empty corner of a diagonal 3348 x 932 pt layout) and the graph runs top to bottom."""
    import torch
    from torch import nn

    import gradaudit

    if shutil.which("dot") is None:
        pytest.skip("the graph needs Graphviz's dot")
    torch.manual_seed(0)
    model = nn.Sequential(*[layer for _ in range(10) for layer in (nn.Linear(32, 32), nn.ReLU())])
    report = gradaudit.audit(model, torch.randn(8, 32))
    path = tmp_path / "report.html"
    path.write_text(html.render(report), encoding="utf-8")
    browser.send("Page.enable")
    browser.send("Page.navigate", url=path.as_uri())
    browser.wait_for("Page.loadEventFired")
    browser.evaluate("new Promise(r => setTimeout(r, 300))")  # the panel scrolls after load
    seen = browser.evaluate("""(() => {
        const panel = document.querySelector('#graph .graph');
        const box = panel.getBoundingClientRect();
        const nodes = Array.from(panel.querySelectorAll('svg g.node')).map(n => n.getBoundingClientRect());
        const inside = nodes.filter(r => r.right > box.left && r.left < box.right
                                         && r.bottom > box.top && r.top < box.top + panel.clientHeight);
        const svg = panel.querySelector('svg').getBBox();
        return {nodes: nodes.length, inside: inside.length, tall: svg.height > svg.width};
    })()""")
    assert seen["nodes"] > 20 and seen["inside"] >= 2 and seen["tall"], seen
