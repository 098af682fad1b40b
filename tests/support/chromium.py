"""Headless Chromium: the HTML report looked at as a person's browser draws it."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from PIL import Image

CHROMIUM = "/usr/bin/chromium"


def screenshot(page: Path, shot: Path, *, size: tuple[int, int] = (1200, 2400)) -> Image.Image:
    """The page drawn at `size`, as RGB; the caller has checked Chromium is installed."""
    profile = shot.with_name(f"{shot.stem}-profile")
    subprocess.run(
        [
            shutil.which("chromium") or CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={profile}",
            f"--window-size={size[0]},{size[1]}",
            f"--screenshot={shot}",
            page.as_uri(),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    with Image.open(shot) as img:
        assert img.size == size
        return img.convert("RGB")


def colours(img: Image.Image) -> list[tuple[int, int, int]]:
    return [rgb for _, rgb in img.getcolors(maxcolors=1 << 20) or []]
