"""What a person sees on opening a run's TensorBoard: its first view in headless Chromium, as a screenshot and the
list of charts on screen.

    pip install playwright        # the browser driver; the browser is the machine's Chromium
    python scripts/tensorboard_view.py lightning_logs/gpt --out tensorboard.png

Starts ``tensorboard --logdir <logdir>`` on a free local port, opens it in Chromium (``--chromium``, default
``/usr/bin/chromium``: Debian's package ``chromium``) through Playwright at 1400 x 1000 pixels, as a browser would
(TensorBoard's own JavaScript fetching the runs and drawing the charts), waits until the charts are drawn, then
writes the screenshot and prints the charts on screen (TensorBoard renders a card only once it is in view), e.g.
``charts on screen: train/loss, train/lr, val/loss, val/ppl``. Exit status 1 when the first view lacks the
``train/loss`` or ``val/loss`` chart, or shows TensorBoard's ``hp_metric`` or Lightning's ``epoch`` (what a run's
first view must not open on: docs/training.md, TensorBoard); 2 for a user error (no event file, no browser or
Playwright, TensorBoard not starting).
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

EXPECTED = ("train/loss", "val/loss")
UNWANTED = ("hp_metric", "epoch")
# Chromium on a machine without network or display: no sandbox (root in a container), no calls home, software WebGL
# (TensorBoard draws its lines with WebGL).
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-quic", "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--enable-unsafe-swiftshader"]


def fail(message: str) -> None:
    print(f"tensorboard_view: error: {message}", file=sys.stderr)
    sys.exit(2)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until_serving(url: str, server: subprocess.Popen, log, timeout: float) -> None:
    """Until ``server`` answers on ``url``; ``log`` is the file its output goes to (a pipe nobody read could fill)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            log.seek(0)
            fail(f"tensorboard exited ({server.returncode}) before serving: {log.read().strip()[-500:]}")
        try:
            with urllib.request.urlopen(url + "data/runs", timeout=5) as reply:
                if reply.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    fail(f"tensorboard did not answer on {url} within {timeout:.0f} s")


def first_view(url: str, chromium: str, out: Path, settle_ms: int) -> list[str]:
    """Open ``url`` in ``chromium``, wait for the first chart and ``settle_ms`` more, screenshot to ``out``; the tags
    of the chart cards on screen (each card's title is a ``tb-truncated-path`` whose ``title`` is its tag)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(url)
            page.wait_for_selector("tb-truncated-path", timeout=120_000)
            page.wait_for_timeout(settle_ms)
            out.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(out))
            return sorted(set(page.eval_on_selector_all("tb-truncated-path", "cards => cards.map(c => c.title)")))
        finally:
            browser.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("logdir", type=Path, help="a run's log folder (e.g. lightning_logs/gpt)")
    parser.add_argument("--out", type=Path, default=Path("tensorboard.png"), help="the screenshot (PNG)")
    parser.add_argument("--chromium", default="/usr/bin/chromium", help="the browser's executable")
    parser.add_argument("--settle_ms", type=int, default=5000, help="time for the charts to draw after the first")
    args = parser.parse_args(argv)
    if not any(args.logdir.rglob("events.out.tfevents.*")):
        fail(f"no TensorBoard event file under {args.logdir}: pass a run's log folder (e.g. lightning_logs/gpt)")
    browser = shutil.which(args.chromium)
    if browser is None:
        fail(f"no browser '{args.chromium}' on this machine: install Chromium (Debian: apt-get install chromium) or "
             "pass --chromium")
    if importlib.util.find_spec("playwright") is None:
        fail("no Playwright: pip install playwright (the browser is the machine's own; no download)")
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    with tempfile.TemporaryFile("w+") as log:
        server = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(args.logdir), "--host",
                                   "127.0.0.1", "--port", str(port)], stdout=log, stderr=subprocess.STDOUT, text=True)
        try:
            wait_until_serving(url, server, log, timeout=120)
            shown = first_view(url, browser, args.out, args.settle_ms)
        finally:
            server.terminate()
            server.wait(timeout=30)
    print(f"tensorboard_view: {args.out}: charts on screen: {', '.join(shown) or 'none'}")
    missing = [tag for tag in EXPECTED if tag not in shown]
    unwanted = [tag for tag in shown if tag in UNWANTED]
    if missing or unwanted:
        print(f"tensorboard_view: the first view lacks {missing} or shows {unwanted}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
