"""Screenshot one page with headless Chromium over the DevTools protocol, once what it draws is there.

    python scripts/chromium_shot.py URL OUT.png [--size 1400,1000] [--wait tensorboard|page] [--timeout 90]

Used by scripts/dashboard_screenshots.sh. Unlike ``chromium --screenshot`` this waits in real time
for a condition and checks the page: ``--wait tensorboard`` waits until every chart of the
CUSTOM SCALARS tab has drawn a line per series, ``--wait page`` until the document and its
images have loaded. If the condition is not met within ``--timeout`` seconds, or the page threw an uncaught
JavaScript error, nothing is written and the exit status is 1, with the page's errors printed.
Needs ``websocket-client``; Chromium listens on 127.0.0.1 on a port it picks itself.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import websocket  # websocket-client

# Walks shadow roots (TensorBoard's dashboards are Polymer elements). Per CUSTOM SCALARS card: its
# title, how many data series it holds, and how many line paths its vz-line-chart2 has drawn.
CHARTS_JS = r"""(() => {
  const deep = (root, tag, out = []) => {
    root.querySelectorAll('*').forEach(el => {
      if (el.tagName === tag) out.push(el);
      if (el.shadowRoot) deep(el.shadowRoot, tag, out);
    });
    return out;
  };
  return JSON.stringify(deep(document, 'TF-CUSTOM-SCALAR-MULTI-LINE-CHART-CARD').map(card => {
    const lines = deep(card.shadowRoot || card, 'VZ-LINE-CHART2')
      .flatMap(chart => [...(chart.shadowRoot || chart).querySelectorAll('path.line')]);
    return {title: card.title || '', series: (card._seriesNames || []).length,
            drawn: lines.filter(p => (p.getAttribute('d') || '').length > 1).length};
  }));
})()"""

# TensorBoard's custom-scalars cards name a series "TAG (RUN)" and read the run back with the
# greedy /\((.*)\)$/ (tf-custom-scalar-helpers.ts, DataSeriesColorScale.parseRunName): a tag with
# "(" yields a run name that is not in the colour scale, which throws, and the chart draws nothing.
TAG_HINT = ("TensorBoard's CUSTOM SCALARS tab cannot draw a tag that contains '(': it reads the run back "
            "from 'TAG (RUN)' with a greedy /\\((.*)\\)$/ and its colour scale throws on the result.")

PAGE_JS = r"""(() => JSON.stringify(document.readyState === 'complete'
  && [...document.images].every(i => i.complete && i.naturalWidth > 0)))()"""


class Page:
    """One DevTools connection to a page target; remembers the page's uncaught errors."""

    def __init__(self, ws_url: str) -> None:
        self.ws = websocket.create_connection(ws_url, timeout=30, suppress_origin=True)
        self.next_id = 0
        self.errors: list[str] = []

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv())
            if message.get("method") == "Runtime.exceptionThrown":
                details = message["params"]["exceptionDetails"]
                self.errors.append((details.get("exception") or {}).get("description") or details.get("text", "?"))
            if message.get("id") == self.next_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})

    def value(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return json.loads(result.get("result", {}).get("value") or "null")


def start_chromium(chromium: str, profile: Path, size: tuple[int, int]) -> tuple[subprocess.Popen[bytes], int]:
    """Headless Chromium with DevTools on 127.0.0.1 and a port of its choosing (read back from the profile)."""
    proc = subprocess.Popen(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
         "--force-device-scale-factor=1", f"--window-size={size[0]},{size[1]}", f"--user-data-dir={profile}",
         "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0", "about:blank"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    port_file = profile / "DevToolsActivePort"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if port_file.is_file() and port_file.read_text().strip():
            return proc, int(port_file.read_text().split()[0])
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"{chromium} did not open its DevTools port within 30 s")


def page_target(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as response:
        targets = json.load(response)
    return next(t["webSocketDebuggerUrl"] for t in targets if t.get("type") == "page")


def ready(page: Page, wait: str, charts: int) -> tuple[bool, Any]:
    if wait == "page":
        state = page.value(PAGE_JS)
        return bool(state), state
    state = page.value(CHARTS_JS) or []
    return len(state) >= charts and all(0 < c["series"] <= c["drawn"] for c in state), state


def shoot(args: argparse.Namespace) -> int:
    size = tuple(int(v) for v in args.size.split(","))
    profile = Path(tempfile.mkdtemp(prefix="chromium-shot-"))
    proc, port = start_chromium(args.chromium, profile, size)  # type: ignore[arg-type]
    try:
        page = Page(page_target(port))
        page.call("Runtime.enable")
        page.call("Emulation.setDeviceMetricsOverride", width=size[0], height=size[1], deviceScaleFactor=1, mobile=False)
        page.call("Page.navigate", url=args.url)
        deadline = time.monotonic() + args.timeout
        ok, state = False, None
        while time.monotonic() < deadline and not page.errors:
            ok, state = ready(page, args.wait, args.charts)
            if ok:
                break
            time.sleep(0.5)
        if not ok or page.errors:
            why = "threw an error" if page.errors else f"not ready after {args.timeout:.0f} s"
            print(f"{args.url}: {why} (--wait {args.wait}); what it shows: {state}", file=sys.stderr)
            for error in dict.fromkeys(e.splitlines()[0] for e in page.errors):
                print(f"  uncaught in the page: {error}", file=sys.stderr)
            if any("was not in the domain" in e for e in page.errors):
                print(f"  {TAG_HINT}", file=sys.stderr)
            return 1
        time.sleep(args.settle)  # let transitions finish
        png = base64.b64decode(page.call("Page.captureScreenshot", format="png")["data"])
        tmp = Path(args.out).with_suffix(".png.tmp")
        tmp.write_bytes(png)
        os.replace(tmp, args.out)
        print(f"wrote {args.out}" + (f" ({state})" if args.wait == "tensorboard" else ""))
        return 0
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(profile, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url")
    parser.add_argument("out")
    parser.add_argument("--size", default="1400,1000", help="WIDTH,HEIGHT of the viewport")
    parser.add_argument("--wait", choices=("tensorboard", "page"), default="page")
    parser.add_argument("--charts", type=int, default=1, help="with --wait tensorboard: how many charts must draw lines")
    parser.add_argument("--timeout", type=float, default=90.0)
    parser.add_argument("--settle", type=float, default=2.0, help="seconds to wait after the page is ready")
    parser.add_argument("--chromium", default=shutil.which("chromium") or shutil.which("chromium-browser") or "chromium")
    return shoot(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
