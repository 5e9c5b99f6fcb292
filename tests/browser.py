"""Headless Chromium for the tests that look at what a page shows (`make test` installs it)."""

from __future__ import annotations

import shutil
import subprocess

import matplotlib.image


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if shutil.which(name):
            return shutil.which(name)
    raise AssertionError(
        "headless Chromium is needed to render HTML in the tests: `make test` installs it (apt-get install chromium)"
    )


def screenshot(html_path, png_path, tmp_path, size="640,900"):
    """The page at ``html_path`` rendered by headless Chromium, as an RGB float array."""
    subprocess.run(
        [
            chromium(),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--hide-scrollbars",
            f"--window-size={size}",
            f"--screenshot={png_path}",
            html_path.as_uri(),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    return matplotlib.image.imread(png_path)[..., :3]
