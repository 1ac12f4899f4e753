"""The web page in a real browser (Debian's chromium through Python Playwright): upload an image, ask the demo
model, check that the boxes drawn over the image sit where the API says.

Without /usr/bin/chromium the test skips, except under CI (`MLX_LOCATE_CI=1`, set by .ci/run), where it fails.
`MLX_LOCATE_SCREENSHOT=path.png` also saves a screenshot of the page (the README's).
"""

from __future__ import annotations

import base64
import http.server
import json
import os
import threading
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

import mlx_locate
from mlx_locate.server.app import create_app, serve_in_thread
from mlx_locate.server.protocol import Settings

pytestmark = pytest.mark.slow  # Chromium driving the web page

IMAGE = Path(mlx_locate.__file__).parent / "demo" / "example.png"
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
QUERIES = ["square", "circle", "star"]


@pytest.fixture(scope="module")
def browser():
    if not CHROMIUM.exists():
        message = f"{CHROMIUM} is missing (apt-get install -y chromium)"
        if os.environ.get("MLX_LOCATE_CI"):
            pytest.fail(message)
        pytest.skip(message)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        # A preloaded BLAS (benchmarks set LD_PRELOAD) makes chromium's GPU process fail to start.
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, env=env)
        yield browser
        browser.close()


def test_page_draws_the_streamed_boxes_where_the_api_says(browser):
    app = create_app(lambda: mlx_locate.load("demo"))
    with serve_in_thread(app) as url:
        page = browser.new_page(viewport={"width": 1100, "height": 700})
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(url)
        page.wait_for_function("document.getElementById('model').textContent.includes('demo')")
        page.set_input_files("#file", str(IMAGE))
        page.wait_for_function("document.getElementById('image').naturalWidth > 0")
        page.fill("#queries", "\n".join(QUERIES))
        page.select_option("#mode", "fast")
        page.click("#run")
        page.wait_for_function("document.getElementById('json').textContent.length > 0", timeout=60_000)

        image = f"data:image/png;base64,{base64.b64encode(IMAGE.read_bytes()).decode()}"
        api = httpx.post(f"{url}/v1/locate", json={"image": image, "query": QUERIES, "mode": "fast"}, timeout=60)
        expected = [o["box"] for q in api.json()["queries"] for o in q["objects"]]
        frame = page.locator("#image").bounding_box()
        # Each drawn rectangle's geometry mapped to the screen by the browser (viewBox, layout, scaling).
        drawn = page.evaluate(
            """[...document.querySelectorAll('#overlay rect.box')].map((r) => {
                const b = r.getBBox(), m = r.getScreenCTM();
                return [b.x * m.a + m.e, b.y * m.d + m.f, (b.x + b.width) * m.a + m.e, (b.y + b.height) * m.d + m.f];
            })"""
        )
        rows = page.locator("#objects tbody tr").all_inner_texts()
        status = page.locator("#status").text_content()
        if os.environ.get("MLX_LOCATE_SCREENSHOT"):
            page.screenshot(path=os.environ["MLX_LOCATE_SCREENSHOT"])
        page.close()

    assert not errors
    assert len(expected) == 3 and len(rows) == 4  # two squares and a circle; the star is not there
    assert [r for r in rows if "not found" in r] == [r for r in rows if "star" in r] and len(rows) == 4
    assert "3 found" in status
    scale = frame["width"] / 224
    assert scale > 1.5 and frame["height"] / 224 == pytest.approx(scale, abs=0.01)  # drawn larger than stored
    fx, fy = frame["x"], frame["y"]
    on_screen = [
        [(x1 - fx) / scale, (y1 - fy) / scale, (x2 - fx) / scale, (y2 - fy) / scale] for x1, y1, x2, y2 in drawn
    ]
    for got, want in zip(sorted(on_screen), sorted(expected), strict=True):
        assert got == pytest.approx(want, abs=0.5 / scale)  # within half a screen pixel


PAGE = """<!doctype html><html><body><script>
fetch(API + "/v1/locate", {method: "POST", headers: {"Content-Type": "application/json"},
                           body: JSON.stringify({image: IMAGE, query: "square", mode: "fast"})})
  .then((r) => r.json()).then((body) => { window.answer = body; })
  .catch((e) => { window.answer = {refused: String(e)}; });
</script></body></html>"""


@contextmanager
def page_host(html: str):
    """A web page on an origin of its own (another port): what a local dev server serves."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.end_headers()
            self.wfile.write(html.encode())

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()


def test_a_page_on_another_origin_reads_answers_only_when_allowed(browser):
    """CORS: `--allow-origin` lets a page served elsewhere (its JSON POST needs a preflight) read the answer;
    a page on an origin not in the list is refused by the browser."""
    image = base64.b64encode(IMAGE.read_bytes()).decode()
    holder = {}
    script = PAGE.replace("<script>", "<script>const API = window.location.hash.slice(1); const IMAGE = IMG;\n")
    script = script.replace("IMG;", f"{json.dumps(image)};")
    with page_host(script) as allowed, page_host(script) as other:
        app = create_app(lambda: mlx_locate.load("demo"), Settings(allow_origins=(allowed,), warmup=False))
        with serve_in_thread(app) as url:
            for origin in (allowed, other):
                page = browser.new_page()
                page.goto(f"{origin}/#{url}")
                page.wait_for_function("window.answer !== undefined", timeout=60_000)
                holder[origin] = page.evaluate("window.answer")
                page.close()
            api = httpx.post(f"{url}/v1/locate", json={"image": image, "query": "square", "mode": "fast"}, timeout=60)
    assert holder[allowed]["objects"] == api.json()["objects"] and len(api.json()["objects"]) == 2
    assert set(holder[other]) == {"refused"} and "Failed to fetch" in holder[other]["refused"]
