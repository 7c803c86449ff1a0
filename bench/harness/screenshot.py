"""A screenshot of the live dashboard, as the docs show it: Chromium (Debian's) through
Playwright, a full page once it has drawn.

    fairq up                                  # prints DASHBOARD_URL
    fairq demo &                              # load
    python -m bench.harness.screenshot URL docs/img/dashboard.png --after 20
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

from playwright.sync_api import sync_playwright


def take(url: str, out: Path, after_s: float, width: int = 1400) -> None:
    chromium = shutil.which("chromium")
    if chromium is None:
        raise SystemExit("no chromium binary (apt-get install -y chromium)")
    time.sleep(after_s)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=chromium, headless=True, chromium_sandbox=False
        )
        try:
            page = browser.new_page(viewport={"width": width, "height": 900})
            page.goto(url)
            page.wait_for_timeout(3000)  # a few refreshes: rates and history drawn
            out.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(out), full_page=True)
        finally:
            browser.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.harness.screenshot", description=__doc__)
    parser.add_argument("url", help="the DASHBOARD_URL fairq up printed")
    parser.add_argument("out", type=Path, help="the PNG to write")
    parser.add_argument("--after", type=float, default=0.0, metavar="S", help="wait first")
    args = parser.parse_args(argv)
    take(args.url, args.out, args.after)
    return 0


if __name__ == "__main__":
    sys.exit(main())
