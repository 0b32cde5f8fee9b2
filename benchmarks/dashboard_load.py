"""How long the gradwatch tab takes to load a large run, and how large its event file is.

    python benchmarks/dashboard_load.py                         # 500 layers, 2,000 and 10,000 steps
    python benchmarks/dashboard_load.py --layers 500 --steps 100000
    python benchmarks/dashboard_load.py --steps 2000 --browser /tmp/tab-500.png  # and the page in Chromium

Writes a synthetic run the way gradwatch's TensorBoard sink does (one event per step holding every
layer's value; here grad_norm and log10_grad_rms for every layer, plus the layer list), starts a
real `tensorboard` with its default flags, waits until it has loaded the run, then times the tab's
requests as the page makes them: `runs`, then the heatmap's and the lines' tables at 1280 px.
TensorBoard keeps 1000 points per scalar tag by default (reservoir sampling at load), so what the
tab reads does not grow with the steps beyond 1000; the time TensorBoard itself takes to read the
event files does, and is reported beside it.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import urllib.request

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gradwatch.sinks.tensorboard import LAYERS_TAG, layers_markdown  # noqa: E402
from tests.tensorboard_server import TensorBoardServer, get_json  # noqa: E402


def write_run(folder: str, layers: int, steps: int) -> int:
    """A run of ``layers`` x ``steps``; returns the event files' bytes."""
    from tensorboard.compat.proto.summary_pb2 import Summary
    from torch.utils.tensorboard import SummaryWriter

    names = [f"blocks.{i // 2}.{i % 2}" for i in range(layers)]
    writer = SummaryWriter(log_dir=folder, max_queue=1000)
    writer.add_text(LAYERS_TAG, layers_markdown(names, types={n: "Linear" for n in names}), 0)
    rng = np.random.default_rng(0)
    level = -np.linspace(1, 6, layers)
    norm_tags = [f"gradwatch/grad_norm/{n}" for n in names]
    rms_tags = [f"gradwatch/log10_grad_rms/{n}" for n in names]
    file_writer = writer._get_file_writer()
    for step in range(steps):
        rms = level + 0.1 * rng.standard_normal(layers)
        values = [Summary.Value(tag=t, simple_value=float(10**v)) for t, v in zip(norm_tags, rms)]
        values += [Summary.Value(tag=t, simple_value=float(v)) for t, v in zip(rms_tags, rms)]
        file_writer.add_summary(Summary(value=values), step)
    writer.close()
    return sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))


def timed(url: str) -> tuple[float, int]:
    start = time.perf_counter()
    with urllib.request.urlopen(url, timeout=600) as r:
        body = r.read()
    return time.perf_counter() - start, len(body)


def measure(layers: int, steps: int, screenshot: str | None = None) -> None:
    with tempfile.TemporaryDirectory() as root:
        t0 = time.perf_counter()
        size = write_run(os.path.join(root, "big"), layers, steps)
        written = time.perf_counter() - t0
        server = TensorBoardServer(root)
        try:
            t0 = time.perf_counter()
            last_tag = f"gradwatch/log10_grad_rms/blocks.{(layers - 1) // 2}.{(layers - 1) % 2}"
            while True:  # loaded: the last tag has its last step
                try:
                    tags = get_json(f"{server.base}/scalars/tags").get("big", {})
                    if tags.get(last_tag, {}) and get_json(
                        f"{server.base}/scalars/scalars?run=big&tag={urllib.request.quote(last_tag)}")[-1][1] == steps - 1:
                        break
                except OSError:
                    pass
                time.sleep(1)
            loaded = time.perf_counter() - t0
            runs, _ = timed(f"{server.base}/gradwatch/runs")
            heat, heat_bytes = timed(f"{server.base}/gradwatch/table?run=big&stat=log10_grad_rms&max_steps=1280")
            lines, _ = timed(f"{server.base}/gradwatch/table?run=big&stat=grad_norm&max_steps=1280")
            page = in_browser(server, screenshot) if screenshot else None
        finally:
            server.close()
    print(f"| {layers} | {steps:,} | {size / 2**20:.0f} MiB | {written:.0f} s | {loaded:.0f} s | "
          f"{runs:.2f} s | {heat:.2f} s ({heat_bytes / 2**20:.1f} MiB) | {lines:.2f} s | **{runs + heat + lines:.2f} s** | "
          + (f"**{page:.2f} s** |" if page is not None else "- |"), flush=True)  # fmt: skip


def in_browser(server: TensorBoardServer, screenshot: str) -> float:
    """Seconds from opening the tab's page in headless Chromium (1280x800) to its heatmap drawn."""
    from tests.browser import Browser

    browser = Browser(1280, 800)
    try:
        start = time.perf_counter()
        browser.open(f"{server.url}/data/plugin_entry.html?name=gradwatch")
        browser.wait_for("document.querySelectorAll('canvas.heatmap').length === 1", timeout=600)
        elapsed = time.perf_counter() - start
        browser.screenshot(screenshot)
        return elapsed
    finally:
        browser.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=500)
    parser.add_argument("--steps", type=int, nargs="+", default=[2000, 10000])
    parser.add_argument("--browser", metavar="PNG", help="also time the page in headless Chromium; screenshot here")
    args = parser.parse_args()
    print("| layers | steps | event files | writing | TensorBoard loading | runs | heatmap table | lines table "
          "| the tab's requests | page drawn in Chromium |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for steps in args.steps:
        measure(args.layers, steps, args.browser)


if __name__ == "__main__":
    main()
