"""Regenerate the README's dashboard screenshots from a real TensorBoard in a real browser.

    python docs/make_screenshots.py [--out docs/images] [--chromium /usr/bin/chromium]

Runs two demos (a healthy one and a deep sigmoid stack whose gradients vanish) into a
temporary folder, starts `tensorboard` on it with its default settings, and takes
screenshots of the Custom Scalars, Images and Text tabs with headless Chromium
(Debian: `apt-get install chromium`). Nothing here runs in the test suite.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gradwatch.demo import run_demo  # noqa: E402

TABS = {"custom_scalars": "dashboard-custom-scalars.png", "images": "dashboard-heatmap.png", "text": "dashboard-alerts.png"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(url: str, needle: str, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if needle in json.dumps(json.loads(response.read().decode())):
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"TensorBoard did not serve {needle} within {timeout} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "images"))
    parser.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium")
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        logdir = os.path.join(tmp, "runs")
        for fault in ("none", "vanishing"):
            run_demo(logdir=logdir, steps=args.steps, fault=fault, out=io.StringIO())
        port = _free_port()
        server = subprocess.Popen(
            [sys.executable, "-m", "tensorboard.main", "--logdir", logdir, "--host", "127.0.0.1", "--port", str(port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            _wait(f"http://127.0.0.1:{port}/data/plugin/images/tags", "gradwatch/gradient_flow_at_alerts")
            _wait(f"http://127.0.0.1:{port}/data/plugin/scalars/tags", "gradwatch/log10_grad_rms/50")
            for tab, name in TABS.items():
                path = os.path.join(args.out, name)
                subprocess.run(
                    [args.chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                     "--disable-background-networking", "--disable-component-update", "--disable-sync",
                     "--hide-scrollbars", f"--user-data-dir={os.path.join(tmp, 'profile-' + tab)}",
                     "--window-size=1400,1000", "--virtual-time-budget=20000", f"--screenshot={path}",
                     f"http://127.0.0.1:{port}/#{tab}"],
                    check=True, capture_output=True, timeout=120,
                )  # fmt: skip
                print(f"wrote {path}")
        finally:
            server.terminate()
            server.wait(timeout=30)


if __name__ == "__main__":
    main()
