"""A real `tensorboard` server for the dashboard tests and docs/make_screenshots.py."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request

from tests.dist_helpers import free_port


def get_json(url: str):
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read().decode())


class TensorBoardServer:
    """A real `tensorboard` server on 127.0.0.1 with its default settings (as users run it)."""

    def __init__(self, logdir: str) -> None:
        self.port = free_port()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tensorboard.main", "--logdir", logdir, "--host", "127.0.0.1", "--port", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        self.url = f"http://127.0.0.1:{self.port}"
        self.base = f"{self.url}/data/plugin"

    def get(self, path: str):
        return get_json(f"{self.base}/{path}")

    def wait_for(self, plugin: str, tag: str, timeout: float = 90) -> dict:
        """The plugin's tags once ``tag`` is loaded (default reload: every 5 s)."""
        deadline = time.monotonic() + timeout
        tags: dict = {}
        while time.monotonic() < deadline:
            try:
                tags = self.get(f"{plugin}/tags")
                if any(tag in run_tags for run_tags in tags.values()):
                    return tags
            except OSError:
                pass
            time.sleep(0.5)
        raise AssertionError(f"{tag} not served by {plugin} within {timeout}s: {tags}")

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)
