"""Load on the server: 1, 4, 16 and 64 concurrent clients; requests/s, p50/p99 latency, every request answered
and equal to the same request sent alone. `--soak` adds a long run with bad requests mixed in (memory, losses).
`--mixed` measures fairness: small requests beside tiled and many-query calls, with the worker's fair admission
and with first-come order. `--burst N` measures memory: N different phone-sized JPEGs uploaded at once, a few
times, with the server's RSS (idle, peak, after each burst).

    python benchmarks/load_server.py --http                          # this machine: mlx-locate-server, demo model
    python benchmarks/load_server.py --http --soak 600 --json benchmarks/results/load_soak.json
    python benchmarks/load_server.py --mixed --json benchmarks/results/load_server_mixed_demo.json
    python benchmarks/load_server.py --preset 3b --in-memory         # the GPU machine: no FastAPI needed
    python benchmarks/load_server.py --http --burst 48 --json benchmarks/results/load_server_burst_demo.json

Two ways to drive it:
- `--http`: `mlx-locate-server` as a subprocess on 127.0.0.1 (a free port) and async HTTP clients here (httpx);
  the whole path, JSON and base64 included. Needs the `[server]` extra.
- in-process (the default): concurrent asyncio submitters drive the server's `Worker` (the one MLX thread and
  its engine) directly, as the HTTP handlers do, without FastAPI or uvicorn: this is what runs where only numpy,
  safetensors, tokenizers, pillow and mlx are installed. `--preset 3b --in-memory` draws the 3B architecture's
  random weights on the device (bench.py's `in_memory_model`, on the worker thread).

"Equal" compares the answer (text, objects, empty labels, truncated) with the same request sent alone through
the same path before the load starts. Prints a table; `--json` writes everything.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import platform
import random
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402

import mlx_locate  # noqa: E402
from mlx_locate import Request  # noqa: E402
from mlx_locate.server.protocol import result_json  # noqa: E402
from mlx_locate.server.worker import Job, Worker  # noqa: E402

ANSWER = ("text", "objects", "empty_labels", "truncated")
DEMO_QUERIES = ("square", "circle", "triangle", "star")
PRESET_QUERIES = ("red box", "car", "the person on the left")


@dataclass(frozen=True)
class Ask:
    """One distinct request of the pool."""

    image: str  # a name in the image table
    query: str
    mode: str


def demo_images() -> dict[str, Image.Image]:
    from mlx_locate.synthetic.scenes import make_sample

    images = {"example": Image.open(ROOT / "mlx_locate" / "demo" / "example.png").convert("RGB")}
    for i in range(3):
        images[f"scene{i}"] = make_sample(0, i, "eval").scene.image.convert("RGB")
    return images


def preset_images() -> dict[str, Image.Image]:
    from bench import IMAGES, make_image

    return {
        "640x480": Image.open(IMAGES["640x480"]).convert("RGB"),
        "1024x768": Image.open(make_image((1024, 768), ROOT / ".bench" / "1024x768.png")).convert("RGB"),
    }


def answer_of(d: dict) -> str:
    return json.dumps({k: d[k] for k in ANSWER}, sort_keys=True)


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


class InProcess:
    """Submitters drive the server's worker directly (no HTTP)."""

    def __init__(self, load, images: dict[str, Image.Image], max_tokens: int, max_queue: int):
        self.images, self.max_tokens = images, max_tokens
        self.worker = Worker(load, max_queue=max_queue).start()
        self.worker.wait_ready()

    async def ask(self, ask: Ask) -> dict:
        request = Request(self.images[ask.image], ask.query, mode=ask.mode, max_tokens=self.max_tokens)
        async with Job(self.worker, [request]) as job:
            (result,) = await job.results()
        return json.loads(json.dumps(result_json(result)))

    def memory_mb(self) -> float:
        return rss_mb(os.getpid())

    def close(self) -> None:
        self.worker.stop()


class OverHttp:
    """`mlx-locate-server` in a subprocess; requests as JSON with base64 images."""

    def __init__(self, model: str, images: dict[str, Image.Image], max_tokens: int, max_queue: int, flags=()):
        import httpx

        self.httpx = httpx
        self.max_tokens = max_tokens
        self.images = {name: png_base64(image) for name, image in images.items()}
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        command = [sys.executable, "-m", "mlx_locate.server", "--model", model, "--port", str(port)]
        command += ["--max-queue", str(max_queue), "--timeout", "600", "--log-level", "warning", *flags]
        self.process = subprocess.Popen(command, cwd=ROOT)
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{self.url}/health", timeout=1).json()["status"] == "ok":
                    break
            except (httpx.HTTPError, ValueError):
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.2)
        self.client = httpx.AsyncClient(base_url=self.url, timeout=600, limits=httpx.Limits(max_connections=128))

    def body(self, ask: Ask) -> dict:
        return {"image": self.images[ask.image], "query": ask.query, "mode": ask.mode, "max_tokens": self.max_tokens}

    async def ask(self, ask: Ask) -> dict:
        r = await self.client.post("/v1/locate", json=self.body(ask))
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.text[:200]}")
        return r.json()

    def memory_mb(self) -> float:
        return rss_mb(self.process.pid)

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(30)


def png_base64(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return base64.b64encode(buf.getvalue()).decode()


def rss_mb(pid: int, field: str = "VmRSS") -> float:
    """A process's resident memory (`VmHWM`: its peak since start or `reset_peak`), in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def reset_peak(pid: int) -> None:
    """Start the process's `VmHWM` again from its current RSS (Linux: clear_refs 5)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def photos(count: int, size: tuple[int, int]) -> list[bytes]:
    """`count` different JPEGs of `size` as a phone makes them (quality 95, sensor-like noise: about 5 MB at
    12 MP), a square on each; kept under .bench/photos."""
    folder = ROOT / ".bench" / "photos"
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / f"photo{i}_{size[0]}x{size[1]}.jpg" for i in range(count)]
    missing = [(i, p) for i, p in enumerate(paths) if not p.exists()]
    if missing:
        w, h = size
        rng = np.random.default_rng(0)
        noise = rng.normal(0, 8, (h, w, 3)).astype(np.int16)
        for i, path in missing:
            r = np.random.default_rng(i)
            ramp = np.linspace(*r.integers(20, 230, 2), w, dtype=np.float32).astype(np.int16)
            pixels = np.broadcast_to(ramp[None, :, None], (h, w, 3)) + np.roll(noise, (97 * i, 131 * i), (0, 1))
            x, y, side = int(r.integers(0, w // 2)), int(r.integers(0, h // 2)), int(r.integers(h // 8, h // 3))
            pixels[y : y + side, x : x + side] = r.integers(0, 255, 3)
            Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(path, "JPEG", quality=95)
    return [p.read_bytes() for p in paths]


async def burst(target: OverHttp, uploads: list[bytes], alone: list[str | None], query: str) -> dict:
    """Every upload at once (multipart); the statuses, the answers equal to alone, and the server's RSS peak
    (`VmHWM`, reset before) and samples, and its RSS once every answer is in and after a second."""

    async def send(data: bytes):
        form = {"query": query, "max_tokens": str(target.max_tokens)}
        return await target.client.post("/v1/locate", files={"image": ("photo.jpg", data, "image/jpeg")}, data=form)

    pid = target.process.pid
    before = rss_mb(pid)
    reset_peak(pid)
    samples: list[float] = []
    sampling = True

    def sample() -> None:
        while sampling:
            samples.append(rss_mb(pid))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    responses = await asyncio.gather(*(send(data) for data in uploads))
    wall = time.perf_counter() - t0
    sampling = False
    sampler.join()
    peak = rss_mb(pid, "VmHWM")
    after = rss_mb(pid)
    await asyncio.sleep(1.0)
    statuses = [r.status_code for r in responses]
    refused = [r for r in responses if r.status_code == 503]
    equal = sum(r.status_code == 200 and answer_of(r.json()) == a for r, a in zip(responses, alone, strict=True))
    return {
        "requests": len(uploads),
        "answered": statuses.count(200),
        "refused_503": len(refused),
        "refused_with_retry_after": sum("retry-after" in r.headers for r in refused),
        "other_statuses": sorted({s for s in statuses if s not in (200, 503)}),
        "equal_to_alone": equal,
        "wall_s": wall,
        "rss_mb": {"before": before, "peak": peak, "sampled_max": max(samples, default=before), "after": after},
        "rss_mb_1s_after": rss_mb(pid),
    }


async def bursts(target: OverHttp, args: argparse.Namespace, report: dict) -> None:
    """The photos alone, one at a time (their answers), then `args.bursts` bursts of all of them at once."""
    size = tuple(int(v) for v in args.photo.split("x"))
    uploads = photos(args.burst, size)
    lengths = [len(data) for data in uploads]
    report["photo"] = {"size": list(size), "mb": [round(n / 2**20, 2) for n in (min(lengths), max(lengths))]}
    report["rss_mb_idle"] = target.memory_mb()
    alone = []
    for data in uploads:
        r = await target.client.post(
            "/v1/locate",
            files={"image": ("photo.jpg", data, "image/jpeg")},
            data={"query": DEMO_QUERIES[0], "max_tokens": str(target.max_tokens)},
        )
        alone.append(answer_of(r.json()) if r.status_code == 200 else None)
    await asyncio.sleep(1.0)
    report["rss_mb_after_alone"] = target.memory_mb()
    report["alone_answered"] = sum(a is not None for a in alone)
    report["bursts"] = []
    for _ in range(args.bursts):
        b = await burst(target, uploads, alone, DEMO_QUERIES[0])
        report["bursts"].append(b)
        m = b["rss_mb"]
        print(
            f"burst of {b['requests']}: {b['answered']} answered ({b['equal_to_alone']} equal to alone), "
            f"{b['refused_503']} refused 503 ({b['refused_with_retry_after']} with Retry-After), other "
            f"{b['other_statuses']}; RSS {m['before']:.0f} -> peak {m['peak']:.0f} -> {m['after']:.0f} MB "
            f"({b['rss_mb_1s_after']:.0f} a second later), {b['wall_s']:.1f} s"
        )
    peak = max(b["rss_mb"]["peak"] for b in report["bursts"])
    report["rss_mb_peak_above_idle"] = peak - report["rss_mb_idle"]
    print(f"idle {report['rss_mb_idle']:.0f} MB; peak {peak:.0f} MB, {peak - report['rss_mb_idle']:.0f} MB above idle")


async def run_level(target, pool: list[Ask], alone: dict[Ask, str], clients: int, requests: int) -> dict:
    """`clients` concurrent clients share `requests` requests drawn from the pool in order."""
    queue: asyncio.Queue = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(pool[i % len(pool)])
    latencies, equal, errors = [], 0, []

    async def client() -> None:
        nonlocal equal
        while not queue.empty():
            ask = queue.get_nowait()
            t0 = time.perf_counter()
            try:
                answer = await target.ask(ask)
            except Exception as e:  # noqa: BLE001 - counted and reported, the run goes on
                errors.append(f"{type(e).__name__}: {e}")
                continue
            latencies.append(time.perf_counter() - t0)
            equal += answer_of(answer) == alone[ask]

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    wall = time.perf_counter() - t0
    return {
        "clients": clients,
        "requests": requests,
        "answered": len(latencies),
        "equal_to_alone": equal,
        "errors": errors[:5],
        "error_count": len(errors),
        "wall_s": wall,
        "requests_per_s": len(latencies) / wall,
        "p50_s": percentile(latencies, 50),
        "p99_s": percentile(latencies, 99),
    }


BAD_REQUESTS = {  # body -> the status the server must answer
    "not an image": ({"image": base64.b64encode(b"hello").decode(), "query": "x"}, 400),
    "unknown field": ({"image": "", "query": "x", "colour": "red"}, 400),
    "bad mode": ({"image": "", "query": "x", "mode": "turbo"}, 400),
    "no query": ({"image": "", "task": "detect"}, 400),
    "remote image": ({"image": "http://127.0.0.1:9/x.png", "query": "x"}, 400),
}


async def soak(target: OverHttp, pool: list[Ask], alone: dict[Ask, str], seconds: float, clients: int) -> dict:
    """`clients` loop for `seconds`: 4 in 5 good requests (checked against alone), the rest bad ones (each must
    get its 4xx) or a stream the client drops after its first event. Samples the server's memory."""
    httpx = target.httpx
    rng = random.Random(0)
    good_image = next(iter(target.images.values()))
    counts = {"good": 0, "good_equal": 0, "bad": 0, "bad_as_expected": 0, "dropped_streams": 0, "lost": 0}
    lost: list[str] = []
    memory: list[tuple[float, float]] = []
    t_start = time.perf_counter()
    deadline = t_start + seconds

    async def client(client_id: int) -> None:
        async with httpx.AsyncClient(base_url=target.url, timeout=600) as http:
            while time.perf_counter() < deadline:
                roll = rng.random()
                try:
                    if roll < 0.8:
                        ask = rng.choice(pool)
                        r = await http.post("/v1/locate", json=target.body(ask))
                        counts["good"] += 1
                        if r.status_code != 200:
                            raise RuntimeError(f"good request answered {r.status_code}: {r.text[:200]}")
                        counts["good_equal"] += answer_of(r.json()) == alone[ask]
                    elif roll < 0.95:
                        name, (body, status) = rng.choice(sorted(BAD_REQUESTS.items()))
                        body = {**body, "image": body["image"] or good_image}
                        r = await http.post("/v1/locate", json=body)
                        counts["bad"] += 1
                        if r.status_code != status or set(r.json()) != {"error"}:
                            raise RuntimeError(f"{name}: {r.status_code} {r.text[:200]}")
                        counts["bad_as_expected"] += 1
                    else:
                        body = {**target.body(rng.choice(pool)), "stream": True}
                        async with http.stream("POST", "/v1/locate", json=body) as r:
                            async for _ in r.aiter_lines():
                                break
                        counts["dropped_streams"] += 1
                except (httpx.HTTPError, RuntimeError, ValueError) as e:
                    counts["lost"] += 1
                    lost.append(f"{type(e).__name__}: {e}")

    async def sample() -> None:
        while time.perf_counter() < deadline:
            memory.append((time.perf_counter() - t_start, target.memory_mb()))
            await asyncio.sleep(min(10.0, seconds / 30))

    await asyncio.gather(sample(), *(client(i) for i in range(clients)))
    async with httpx.AsyncClient(base_url=target.url, timeout=60) as http:
        for _ in range(100):  # dropped streams finish their current step; then nothing may be pending
            health = (await http.get("/health")).json()
            if health["pending"] == 0:
                break
            await asyncio.sleep(0.1)
    memory.append((time.perf_counter() - t_start, target.memory_mb()))
    half = [m for t, m in memory if t >= seconds / 2]
    slope = np.polyfit([t for t, _ in memory if t >= seconds / 2], half, 1)[0] * 60 if len(half) > 2 else None
    return {
        "seconds": seconds,
        "clients": clients,
        **counts,
        "lost_examples": lost[:5],
        "pending_after": health["pending"],
        "memory_mb": {
            "first": memory[0][1],
            "max": max(m for _, m in memory),
            "last": memory[-1][1],
            "second_half_slope_mb_per_min": slope,
        },
        "memory_samples": memory,
    }


MIXED_TILES = (4, 4)  # a tiled call: 16 tiles and the whole image, 17 views
MIXED_QUERIES = 16  # a many-query call


async def mixed_run(load, image: Image.Image, fair: bool, args: argparse.Namespace) -> dict:
    """One tiled client and one many-query client loop while `args.small_clients` clients send
    `args.small_requests` one-query requests in turn; the small requests' latencies, and whether their tokens
    equal those of the same request alone."""
    worker = Worker(load, max_queue=100_000, fair=fair).start()
    worker.wait_ready()
    queries = [DEMO_QUERIES[i % len(DEMO_QUERIES)] for i in range(MIXED_QUERIES)]
    options = {"mode": "fast", "max_tokens": args.max_tokens}

    async def call(requests: list[Request]) -> list:
        async with Job(worker, requests) as job:
            return await job.results()

    alone = {q: (await call([Request(image, q, **options)]))[0].token_ids for q in DEMO_QUERIES}
    tiled = [Request(image, "square", tiles=MIXED_TILES, **options)]
    many = [Request(image, q, **options) for q in queries]
    # The shapes of this mix (tile sizes, batch sizes) compile once, before anything is timed.
    await asyncio.gather(call(tiled), call(many), *(call([Request(image, q, **options)]) for q in DEMO_QUERIES))
    done = asyncio.Event()
    big = {"tiled": 0, "many_query": 0}

    async def big_client(name: str, requests: list[Request]) -> None:
        while not done.is_set():
            await call(requests)
            big[name] += 1

    latencies, equal = [], 0

    async def small_client(k: int) -> None:
        nonlocal equal
        await asyncio.sleep(0.5)  # the big calls are queued first
        for i in range(k, args.small_requests, args.small_clients):
            query = DEMO_QUERIES[i % len(DEMO_QUERIES)]
            t0 = time.perf_counter()
            (result,) = await call([Request(image, query, **options)])
            latencies.append(time.perf_counter() - t0)
            equal += result.token_ids == alone[query]

    bigs = [asyncio.ensure_future(big_client("tiled", tiled)), asyncio.ensure_future(big_client("many_query", many))]
    t0 = time.perf_counter()
    await asyncio.gather(*(small_client(k) for k in range(args.small_clients)))
    wall = time.perf_counter() - t0
    done.set()
    await asyncio.gather(*bigs)
    worker.stop()
    return {
        "admission": "fair (round-robin across calls)" if fair else "first come",
        "small_requests": len(latencies),
        "small_equal_to_alone": equal,
        "small_p50_s": percentile(latencies, 50),
        "small_p99_s": percentile(latencies, 99),
        "small_max_s": max(latencies),
        "tiled_calls_done": big["tiled"],
        "many_query_calls_done": big["many_query"],
        "wall_s": wall,
    }


def print_mixed(runs: list[dict]) -> None:
    print("| admission | small p50 | small p99 | small max | small equal to alone | tiled calls | 16-query calls |")
    print("|---|---|---|---|---|---|---|")
    for r in runs:
        print(
            f"| {r['admission']} | {r['small_p50_s']:.2f} s | {r['small_p99_s']:.2f} s | {r['small_max_s']:.2f} s | "
            f"{r['small_equal_to_alone']}/{r['small_requests']} | {r['tiled_calls_done']} | "
            f"{r['many_query_calls_done']} |"
        )


async def measure(target, pool: list[Ask], args: argparse.Namespace, report: dict) -> None:
    """Each request alone, then each level of concurrency, then the soak; fills `report`."""
    t0 = time.perf_counter()
    alone = {ask: answer_of(await target.ask(ask)) for ask in pool}
    report["alone_s"] = time.perf_counter() - t0
    report["memory_mb_after_alone"] = target.memory_mb()
    report["levels"] = []
    for clients in args.clients:
        level = await run_level(target, pool, alone, clients, max(args.requests, clients))
        report["levels"].append(level)
        print_level(level)
    report["memory_mb_after_levels"] = target.memory_mb()
    if args.soak:
        report["soak"] = await soak(target, pool, alone, args.soak, args.soak_clients)
        print_soak(report["soak"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="demo", help="checkpoint folder or 'demo' (default)")
    p.add_argument("--preset", help="random weights of a preset (e.g. 3b) instead of --model; needs --in-memory")
    p.add_argument("--in-memory", action="store_true", help="with --preset: draw the weights on the device")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--http", action="store_true", help="through mlx-locate-server over HTTP (needs [server])")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--requests", type=int, default=64, help="requests per level (at least the clients)")
    p.add_argument("--modes", nargs="+", default=["hybrid", "fast"])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--soak", type=float, default=0, metavar="SECONDS", help="then soak for this long (--http)")
    p.add_argument("--soak-clients", type=int, default=8)
    p.add_argument("--mixed", action="store_true", help="fairness: small requests beside tiled and many-query calls")
    p.add_argument("--small-requests", type=int, default=40, help="with --mixed: one-query requests measured")
    p.add_argument("--small-clients", type=int, default=2, help="with --mixed: clients sending them")
    p.add_argument("--burst", type=int, default=0, metavar="N", help="N different photos at once (with --http)")
    p.add_argument("--bursts", type=int, default=3, help="with --burst: how many bursts (default: %(default)s)")
    p.add_argument("--photo", default="4032x3024", help="with --burst: the photos' size (default: %(default)s)")
    p.add_argument("--server-flag", action="append", default=[], help="with --http: a flag for the server")
    p.add_argument("--json", help="write the report here")
    args = p.parse_args(argv)
    if args.preset and (args.http or not args.in_memory):
        p.error("--preset runs in-process with --in-memory (no checkpoint file, no HTTP)")
    if (args.soak or args.burst) and not args.http:
        p.error("--soak and --burst need --http (their requests are HTTP requests)")

    if args.preset:
        from bench import in_memory_model

        images, queries = preset_images(), PRESET_QUERIES
        load = lambda: in_memory_model(args.preset, args.dtype)  # noqa: E731 - runs on the worker thread
    else:
        images, queries = demo_images(), DEMO_QUERIES
        load = lambda: mlx_locate.load(args.model)  # noqa: E731
    if args.mixed:
        report = {"model": args.preset or args.model, "machine": platform.machine(), "cpus": os.cpu_count()}
        report |= {"max_tokens": args.max_tokens, "tiles": list(MIXED_TILES), "many_queries": MIXED_QUERIES}
        image = next(iter(images.values()))
        report["runs"] = [asyncio.run(mixed_run(load, image, fair, args)) for fair in (True, False)]
        print_mixed(report["runs"])
        return write_report(args.json, report)
    pool = [Ask(i, q, m) for i in images for q in queries for m in args.modes]
    max_queue = max(256, max(args.clients) * 2)
    t0 = time.perf_counter()
    if args.http:
        target = OverHttp(args.model, images, args.max_tokens, max_queue, args.server_flag)
    else:
        target = InProcess(load, images, args.max_tokens, max_queue)
    report = {
        "path": "http" if args.http else "in-process",
        "model": args.preset or args.model,
        "dtype": args.dtype if args.preset else "as stored",
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "load_s": time.perf_counter() - t0,
        "pool": len(pool),
        "max_tokens": args.max_tokens,
    }
    if args.burst:
        report |= {"burst": args.burst, "server_flags": args.server_flag, "date": time.strftime("%Y-%m-%d")}
        report["command"] = " ".join(["python", "benchmarks/load_server.py", *sys.argv[1:]])
        report["malloc_env"] = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}
    try:
        asyncio.run(bursts(target, args, report) if args.burst else measure(target, pool, args, report))
    finally:
        target.close()
    return write_report(args.json, report)


def write_report(path: str | None, report: dict) -> int:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {path}")
    return 0


def print_level(level: dict) -> None:
    if level["p50_s"] is None:
        print(f"{level['clients']:>3} clients: nothing answered; errors {level['errors']}")
        return
    print(
        f"{level['clients']:>3} clients: {level['requests_per_s']:6.2f} req/s, p50 {level['p50_s']:.2f} s, "
        f"p99 {level['p99_s']:.2f} s, answered {level['answered']}/{level['requests']}, "
        f"equal to alone {level['equal_to_alone']}/{level['answered']}, errors {level['error_count']}"
    )


def print_soak(s: dict) -> None:
    m = s["memory_mb"]
    slope = m["second_half_slope_mb_per_min"]
    print(
        f"soak {s['seconds']:.0f} s x {s['clients']} clients: {s['good']} good ({s['good_equal']} equal to alone), "
        f"{s['bad']} bad ({s['bad_as_expected']} answered as expected), {s['dropped_streams']} dropped streams, "
        f"{s['lost']} lost, pending after {s['pending_after']}; server memory {m['first']:.0f} -> max {m['max']:.0f} "
        f"-> {m['last']:.0f} MB (second half {'-' if slope is None else f'{slope:+.2f}'} MB/min)"
    )


if __name__ == "__main__":
    raise SystemExit(main())
