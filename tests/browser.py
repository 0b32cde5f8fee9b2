"""Headless Chromium driven over the DevTools protocol, with the standard library only (a websocket
client of a few lines): the dashboard tests and docs/make_screenshots.py load pages, click and take
screenshots with it. ``chromium_path()`` is None where no Chromium is installed (Debian:
``apt-get install chromium``); the tests that need it are skipped then."""

from __future__ import annotations

import base64
import json
import os
import shutil
import socket
import struct
import subprocess
import tempfile
import time
import urllib.request
from typing import Any

from tests.dist_helpers import free_port


def chromium_path() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


class Browser:
    """One headless Chromium with one page, ``width`` x ``height`` CSS pixels."""

    def __init__(self, width: int = 1280, height: int = 800) -> None:
        path = chromium_path()
        if path is None:
            raise RuntimeError("no Chromium found (Debian: apt-get install chromium)")
        self._profile = tempfile.mkdtemp(prefix="gradwatch-chromium-")
        port = free_port()
        self._process = subprocess.Popen(
            [path, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--hide-scrollbars",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--remote-debugging-port={port}", f"--user-data-dir={self._profile}",
             f"--window-size={width},{height}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        target = self._page_target(port)
        self._socket = _connect(target["webSocketDebuggerUrl"])
        self._next_id = 0
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)

    def _page_target(self, port: int, timeout: float = 30) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=5) as r:
                    pages = [t for t in json.loads(r.read()) if t.get("type") == "page"]
                if pages:
                    return pages[0]
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("Chromium did not open its DevTools port")
            time.sleep(0.2)

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        """One DevTools command; its result (events in between are skipped)."""
        self._next_id += 1
        _send(self._socket, json.dumps({"id": self._next_id, "method": method, "params": params}))
        while True:
            message = json.loads(_receive(self._socket))
            if message.get("id") == self._next_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})

    def open(self, url: str) -> None:
        self.call("Page.navigate", url=url)

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (a promise is awaited)."""
        result = self.call("Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 60) -> Any:
        """Evaluate ``expression`` until it is truthy; its value."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                value = self.evaluate(expression)
            except RuntimeError:
                value = None
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"not true within {timeout}s: {expression}")
            time.sleep(0.25)

    def screenshot(self, path: str) -> None:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        with open(path, "wb") as f:
            f.write(base64.b64decode(data))

    def close(self) -> None:
        try:
            self._socket.close()
        finally:
            self._process.terminate()
            self._process.wait(timeout=30)
            shutil.rmtree(self._profile, ignore_errors=True)


# A websocket client, enough for the DevTools protocol: text frames, masked from the client.
def _connect(url: str) -> socket.socket:
    rest = url.split("://", 1)[1]
    hostport, _, path = rest.partition("/")
    host, _, port = hostport.partition(":")
    sock = socket.create_connection((host, int(port)), timeout=60)
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall((f"GET /{path} HTTP/1.1\r\nHost: {hostport}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                  f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())  # fmt: skip
    response = b""
    while b"\r\n\r\n" not in response:
        response += sock.recv(4096)
    if b" 101 " not in response.split(b"\r\n", 1)[0]:
        raise RuntimeError(f"websocket handshake refused: {response[:200]!r}")
    return sock


def _send(sock: socket.socket, text: str) -> None:
    payload = text.encode()
    header = bytes([0x81])
    n = len(payload)
    if n < 126:
        header += bytes([0x80 | n])
    elif n < 1 << 16:
        header += bytes([0x80 | 126]) + struct.pack(">H", n)
    else:
        header += bytes([0x80 | 127]) + struct.pack(">Q", n)
    mask = os.urandom(4)
    sock.sendall(header + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))


def _receive(sock: socket.socket) -> str:
    chunks = []
    while True:
        first, second = _exactly(sock, 2)
        n = second & 0x7F
        if n == 126:
            n = struct.unpack(">H", _exactly(sock, 2))[0]
        elif n == 127:
            n = struct.unpack(">Q", _exactly(sock, 8))[0]
        payload = _exactly(sock, n)
        if first & 0x0F in (0x1, 0x0):  # text or continuation
            chunks.append(payload)
            if first & 0x80:  # final fragment
                return b"".join(chunks).decode()


def _exactly(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("Chromium closed the DevTools connection")
        data += chunk
    return bytes(data)
