"""The server's image budget (`server.images`): the bytes it holds for waiting and decoding calls stay within
`--max-image-mb` under a burst, over it a call is refused with 503 and Retry-After, and every call it takes is
answered as alone. No timing: the burst arrives while the engine is held (its steps wait on an event)."""

from __future__ import annotations

import asyncio
import io
import threading
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
from conftest import demo_waiting_before_steps
from PIL import Image

import mlx_locate
from mlx_locate.preprocess import target_size
from mlx_locate.request import Request
from mlx_locate.server import app as server_app
from mlx_locate.server.app import create_app, serve_in_thread
from mlx_locate.server.images import ImageBudget, decoded_bytes
from mlx_locate.server.protocol import Settings
from mlx_locate.server.worker import QueueFull, TooLarge
from mlx_locate.synthetic.scenes import make_sample
from mlx_locate.tiles import split_request

BURST = 8


def jpeg(i: int) -> bytes:
    """A different demo scene as a camera JPEG of 640 x 480, its noise making most of its compressed bytes."""
    scene = make_sample(0, i, "eval").scene.image.convert("RGB").resize((640, 480))
    pixels = np.asarray(scene, dtype=np.int16)
    noise = np.random.default_rng(i).normal(0, 8, pixels.shape).astype(np.int16)
    buf = io.BytesIO()
    Image.fromarray(np.clip(pixels + noise, 0, 255).astype(np.uint8)).save(buf, "JPEG", quality=95)
    return buf.getvalue()


# -- the budget alone -----------------------------------------------------------------------------------


def test_waiting_calls_hold_compressed_bytes_and_decode_in_turn_within_half_the_budget():
    async def run():
        budget = ImageBudget(100)
        a, b, c = budget.admit(5, 40), budget.admit(5, 40), budget.admit(5, 10)
        await a.turn()  # decoded at once: 40 of half the budget's 50
        assert budget.held == 55 and budget.decoding == 40 and budget.waiting == 2
        assert not b.granted.done() and not c.granted.done()  # c fits, but waits behind b: arrival order
        a.release()
        await b.turn()
        await c.turn()
        assert budget.held == 60 and budget.decoding == 50
        b.release(), c.release(), c.release()  # released once
        assert budget.held == 0 and budget.decoding == 0 and budget.peak == 60
        return budget

    assert asyncio.run(run()).admitted == 3


def test_a_call_over_the_budget_is_refused_now_or_for_good():
    async def run():
        budget = ImageBudget(100)
        with pytest.raises(TooLarge, match="never run here"):
            budget.admit(10, 91)
        first = budget.admit(10, 60)  # alone, decoded beyond half the budget
        await first.turn()
        with pytest.raises(QueueFull, match="--max-image-mb.*retry shortly"):
            budget.admit(40, 0)  # the held bytes would pass the budget
        budget.admit(20, 0)
        # 20 + 5 waiting compressed and a 80-byte image to decode after them would never fit: refused now
        with pytest.raises(QueueFull):
            budget.admit(5, 80)
        assert budget.refused == 2 and budget.held == 90
        first.release()
        assert budget.held == 20

    asyncio.run(run())


def test_the_first_in_line_is_always_decoded_once_the_calls_before_it_end():
    """Admission keeps room for the widest waiting image beside all waiting compressed bytes: without it, the
    compressed bytes of the calls behind could keep the first in line from ever decoding."""

    async def run():
        rng = np.random.default_rng(0)
        budget = ImageBudget(1000)
        admitted = []
        for _ in range(300):
            try:
                admitted.append(budget.admit(int(rng.integers(1, 60)), int(rng.integers(0, 500))))
            except QueueFull:
                pass
            assert budget.held <= budget.max_bytes
            if admitted and rng.random() < 0.3:  # the oldest decoded call ends
                decoded = [h for h in admitted if h.granted.done()]
                if decoded:
                    decoded[0].release()
                    admitted.remove(decoded[0])
            await asyncio.sleep(0)
        while admitted:  # every call left gets its turn as the ones before it end
            await asyncio.wait_for(admitted[0].turn(), 1)
            admitted.pop(0).release()
            assert budget.held <= budget.max_bytes
        assert budget.held == 0 and budget.refused > 0

    asyncio.run(run())


def test_a_call_that_stops_waiting_frees_its_place():
    async def run():
        budget = ImageBudget(100)
        first = budget.admit(5, 60)
        await first.turn()
        second, third = budget.admit(5, 30), budget.admit(5, 30)
        waiting = asyncio.ensure_future(second.turn())
        await asyncio.sleep(0)
        waiting.cancel()  # gave up (a timeout, a client gone)
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert budget.held == 70 and budget.waiting == 1
        first.release()
        await third.turn()
        assert budget.held == 35

    asyncio.run(run())


def test_decoded_bytes_cover_what_a_prepared_image_keeps():
    """Pillow keeps 4 bytes a pixel (twice where the image policy turns or converts it); the engine keeps each
    view's patches."""
    runtime = mlx_locate.load("demo").runtime
    image = Image.open(io.BytesIO(jpeg(0)))
    image.load()
    kept = 4 * image.width * image.height
    prepared = runtime.prepare(image)
    need = decoded_bytes(image.size, image.mode, runtime.in_token_limit, runtime.patch_size)
    final = np.prod(target_size(*image.size, runtime.in_token_limit, runtime.patch_size).final)
    assert prepared.pre.pixels.nbytes == 3 * final
    assert kept + prepared.pre.pixels.nbytes < need <= 2 * kept + 13 * final
    request = Request(image, "square", tiles=(2, 2))
    views = split_request(request, image, runtime.in_token_limit, runtime.patch_size)
    crops = sum(4 * v.image.width * v.image.height for v in views)
    patches = sum(runtime.prepare(v.image).pre.pixels.nbytes for v in views)
    assert kept + crops + patches < decoded_bytes(image.size, "RGB", runtime.in_token_limit, runtime.patch_size, 5)


# -- a burst through the server ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def burst_server():
    gate = threading.Event()
    gate.set()
    uploads = [jpeg(i) for i in range(BURST)]
    runtime = mlx_locate.load("demo").runtime
    need = decoded_bytes((640, 480), "RGB", runtime.in_token_limit, runtime.patch_size)
    small, large = min(map(len, uploads)), max(map(len, uploads))
    assert 2.5 * small > 2 * large  # so any two calls fit beside each other and no three
    # The first call decodes alone (past half the budget), the second waits compressed, the third is over it.
    budget_mb = (need + 2 * large + small / 2) / 2**20
    app = create_app(demo_waiting_before_steps(gate.wait), Settings(max_image_mb=budget_mb, warmup=False))
    with serve_in_thread(app) as url:
        yield SimpleNamespace(url=url, app=app, gate=gate, uploads=uploads)


def post(client, data: bytes):
    form = {"query": "square", "max_tokens": "48"}
    return client.post("/v1/locate", files={"image": ("photo.jpg", data, "image/jpeg")}, data=form)


def answer_of(body: dict) -> dict:
    return {k: body[k] for k in ("objects", "empty_labels", "truncated", "text")}


def test_a_burst_over_the_image_budget_is_refused_with_503_and_the_rest_answered_as_alone(burst_server, monkeypatch):
    s, images, worker = burst_server, burst_server.app.state.images, burst_server.app.state.worker
    with httpx.Client(base_url=s.url, timeout=60) as client:
        alone = [answer_of(post(client, data).json()) for data in s.uploads]
    decoded, decode = [], server_app.decode_image

    def counted_decode(header, *args):
        decoded.append(decode(header, *args))
        return decoded[-1]

    monkeypatch.setattr(server_app, "decode_image", counted_decode)
    arrived = images.admitted + images.refused

    async def run():
        async with httpx.AsyncClient(base_url=s.url, timeout=60) as client:
            calls = [asyncio.ensure_future(post(client, data)) for data in s.uploads]
            # Every call has arrived, and the first one decoded reached the (held) engine.
            for _ in range(6000):  # 60 s at most: a call that fails before the engine must not hang the test
                if images.admitted + images.refused - arrived >= BURST and worker.pending:
                    break
                await asyncio.sleep(0.01)
            held = images.held, images.waiting, len(decoded)
            s.gate.set()
            return held, await asyncio.gather(*calls)

    s.gate.clear()
    try:
        (held, waiting, decoded_while_held), responses = asyncio.run(run())
    finally:
        s.gate.set()
    # While the engine held the first call, it alone was decoded; the second waited with its compressed bytes.
    assert waiting == 1 and decoded_while_held == 1
    assert held == images.peak <= images.max_bytes
    refusals = [r for r in responses if r.status_code == 503]
    assert len(refusals) == BURST - 2
    for r in refusals:
        assert r.json()["error"]["code"] == "queue_full" and r.headers["retry-after"] == "1"
        assert "--max-image-mb" in r.json()["error"]["message"]
    answered = [(answer_of(r.json()), a) for r, a in zip(responses, alone, strict=True) if r.status_code == 200]
    assert len(answered) == 2 and all(body == a for body, a in answered)
    assert images.held == 0 and images.decoding == 0
    for image in decoded:  # each call's end freed its pixels, whatever still refers to the image
        with pytest.raises(ValueError, match="closed image"):
            image.im  # noqa: B018


def test_an_image_that_never_fits_the_budget_is_400(burst_server):
    big = io.BytesIO()
    Image.new("RGB", (1500, 1500), (200, 10, 10)).save(big, "PNG")
    with httpx.Client(base_url=burst_server.url, timeout=60) as client:
        r = post(client, big.getvalue())
    assert r.status_code == 400 and r.json()["error"]["code"] == "request_too_large", r.text
    assert "--max-image-mb" in r.json()["error"]["message"]
