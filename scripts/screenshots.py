"""Full-page screenshots of every page of the docs site, to look at before a release.

    python scripts/screenshots.py                 # builds the site, writes site-screenshots/*.png
    python scripts/screenshots.py --site /tmp/site --out shots --width 1280

Builds the site with ``mkdocs build --strict`` (unless ``--site`` names a built one), serves it
on a local port and drives headless Chromium from the OS packages (``apt-get install chromium``)
over the DevTools pipe: each page is loaded, its scripts (KaTeX) are given time to run, and the
whole page height is captured. Needs no Python package beyond the ``docs`` extra.
"""

from __future__ import annotations

import argparse
import base64
import functools
import http.server
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "chrome")


class DevTools:
    """The Chrome DevTools protocol over ``--remote-debugging-pipe`` (fds 3 and 4)."""

    def __init__(self, browser: str) -> None:
        self.to_r, self.to_w = os.pipe()
        self.from_r, self.from_w = os.pipe()
        self.profile = tempfile.mkdtemp(prefix="treecompile-chromium-")
        args = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                "--remote-debugging-pipe", f"--user-data-dir={self.profile}", "--no-first-run",
                "--force-device-scale-factor=1", "about:blank"]

        def fds() -> None:
            os.dup2(self.to_r, 3)
            os.dup2(self.from_w, 4)

        self.proc = subprocess.Popen(args, pass_fds=(3, 4), preexec_fn=fds,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(self.to_r)
        os.close(self.from_w)
        self.buf = b""
        self.next_id = 0
        self.session = None

    def send(self, method: str, params: dict | None = None, session: bool = True) -> dict:
        self.next_id += 1
        msg = {"id": self.next_id, "method": method, "params": params or {}}
        if session and self.session:
            msg["sessionId"] = self.session
        os.write(self.to_w, json.dumps(msg).encode() + b"\0")
        while True:
            reply = self._read()
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def _read(self) -> dict:
        while b"\0" not in self.buf:
            chunk = os.read(self.from_r, 1 << 20)
            if not chunk:
                raise RuntimeError("chromium closed the DevTools pipe")
            self.buf += chunk
        raw, self.buf = self.buf.split(b"\0", 1)
        return json.loads(raw)

    def open_tab(self) -> None:
        target = self.send("Target.createTarget", {"url": "about:blank"}, session=False)["targetId"]
        self.session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True},
                                 session=False)["sessionId"]
        self.send("Page.enable")
        self.send("Runtime.enable")

    def evaluate(self, expr: str):
        return self.send("Runtime.evaluate", {"expression": expr, "returnByValue": True})["result"].get("value")

    def screenshot(self, url: str, path: Path, width: int) -> int:
        self.send("Emulation.setDeviceMetricsOverride",
                  {"width": width, "height": 900, "deviceScaleFactor": 1, "mobile": False})
        self.send("Page.navigate", {"url": url})
        deadline = time.time() + 20
        while time.time() < deadline and self.evaluate("document.readyState") != "complete":
            time.sleep(0.05)
        self.evaluate("document.fonts.ready.then(() => 1)")
        time.sleep(0.3)  # scripts that run on load (KaTeX) and web fonts
        height = int(self.evaluate("Math.ceil(document.documentElement.scrollHeight)") or 900)
        self.send("Emulation.setDeviceMetricsOverride",
                  {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False})
        time.sleep(0.1)
        shot = self.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True})
        path.write_bytes(base64.b64decode(shot["data"]))
        return height

    def close(self) -> None:
        try:
            self.send("Browser.close", session=False)
        except Exception:
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        shutil.rmtree(self.profile, ignore_errors=True)


def find_browser() -> str:
    for name in BROWSERS:
        if path := shutil.which(name):
            return path
    sys.exit("no headless Chromium found: apt-get install -y chromium (Debian) or chromium-browser (Ubuntu)")


def pages(site: Path) -> list[Path]:
    """Every page of the built site (directory URLs: one index.html per page), 404 left out."""
    skip = {"404.html"}
    return sorted(p.relative_to(site) for p in site.rglob("index.html")
                  if not any(part in {"assets", "search"} for part in p.relative_to(site).parts)
                  and p.name not in skip)


def serve(site: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

    handler = functools.partial(Quiet, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--site", type=Path, help="a built site (default: build one into a temporary folder)")
    ap.add_argument("--out", type=Path, default=ROOT / "site-screenshots", help="where the PNGs go")
    ap.add_argument("--width", type=int, default=1280, help="viewport width in CSS pixels")
    ap.add_argument("--only", nargs="*", default=None, help="page paths to take (e.g. rl/ api/compile/)")
    args = ap.parse_args(argv)
    browser = find_browser()
    site = args.site
    if site is None:
        site = Path(tempfile.mkdtemp(prefix="treecompile-site-"))
        env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
        subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(site)],
                       cwd=ROOT, env=env, check=True)
    args.out.mkdir(parents=True, exist_ok=True)
    server, base = serve(site)
    tools = DevTools(browser)
    try:
        tools.open_tab()
        for page in pages(site):
            rel = page.parent.as_posix()
            rel = "" if rel == "." else rel + "/"
            if args.only is not None and rel not in args.only:
                continue
            name = (rel.strip("/").replace("/", "_") or "index") + ".png"
            height = tools.screenshot(base + rel, args.out / name, args.width)
            print(f"{args.out / name}: {args.width}x{height}")
    finally:
        tools.close()
        server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
