"""Regenerate the README's dashboard screenshots from a real TensorBoard in a real browser.

    python docs/make_screenshots.py [--out docs/images] [--chromium /usr/bin/chromium]

Runs two demos (a healthy one and a deep sigmoid stack whose gradients vanish) into a
temporary folder, starts `tensorboard` on it with its default settings (the dashboard
tests' server, tests/tensorboard_server.py), and takes screenshots with headless Chromium
(Debian: `apt-get install chromium`): the gradwatch tab at 1280x800 with the vanishing run
compared beside the healthy one after clicking its first alert (driven like the suite's
browser test, tests/browser.py), then the Custom Scalars, Images and Text tabs.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gradwatch.demo import run_demo  # noqa: E402
from tests.browser import Browser  # noqa: E402
from tests.tensorboard_server import TensorBoardServer  # noqa: E402

TABS = {"custom_scalars": "dashboard-custom-scalars.png", "images": "dashboard-heatmap.png", "text": "dashboard-alerts.png"}


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
        server = TensorBoardServer(logdir)
        try:
            server.wait_for("images", "gradwatch/gradient_flow_at_alerts")
            server.wait_for("scalars", "gradwatch/log10_grad_rms/50")
            tab_screenshot(server, os.path.join(args.out, "dashboard-tab.png"))
            for tab, name in TABS.items():
                path = os.path.join(args.out, name)
                subprocess.run(
                    [args.chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                     "--disable-background-networking", "--disable-component-update", "--disable-sync",
                     "--hide-scrollbars", f"--user-data-dir={os.path.join(tmp, 'profile-' + tab)}",
                     "--window-size=1400,1000", "--virtual-time-budget=20000", f"--screenshot={path}",
                     f"{server.url}/#{tab}"],
                    check=True, capture_output=True, timeout=120,
                )  # fmt: skip
                print(f"wrote {path}")
        finally:
            server.close()


def tab_screenshot(server: TensorBoardServer, path: str) -> None:
    """The gradwatch tab as a user sees it: the vanishing run beside the healthy one, its first alert clicked."""
    browser = Browser(1280, 800)
    try:
        browser.open(f"{server.url}/data/plugin_entry.html?name=gradwatch")
        browser.wait_for("document.querySelectorAll('canvas.heatmap').length === 1")
        runs = browser.evaluate("[...document.getElementById('run-a').options].map(o => o.value)")
        vanishing = next(r for r in runs if r.startswith("vanishing"))
        healthy = next(r for r in runs if r.startswith("none"))
        for select, run in (("run-a", vanishing), ("run-b", healthy)):
            browser.evaluate(f"(() => {{ const s = document.getElementById('{select}'); s.value = '{run}';"
                             " s.dispatchEvent(new Event('change')); })()")  # fmt: skip
            browser.wait_for(f"document.querySelector('.panel[data-run=\"{run}\"]') !== null")
        browser.evaluate("document.querySelectorAll('tr.alert')[0].click()")
        browser.wait_for("document.getElementById('zoom-label').textContent")
        browser.wait_for("document.querySelectorAll('canvas.heatmap').length === 2")
        browser.screenshot(path)
        print(f"wrote {path}")
    finally:
        browser.close()


if __name__ == "__main__":
    main()
