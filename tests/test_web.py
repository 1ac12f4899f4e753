"""The web page in a real browser (Debian's chromium through Python Playwright): upload an image, ask the demo
model, check that the boxes drawn over the image sit where the API says.

Without /usr/bin/chromium the test skips, except under CI (`MLX_LOCATE_CI=1`, set by .ci/run), where it fails.
`MLX_LOCATE_SCREENSHOT=path.png` also saves a screenshot of the page (the README's).
"""

from __future__ import annotations

import base64
import os
from pathlib import Path

import httpx
import pytest

import mlx_locate
from mlx_locate.server.app import create_app, serve_in_thread

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
