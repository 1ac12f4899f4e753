"""`mlx-locate-server --model M [--host 127.0.0.1] [--port 8080] ...` (also `python -m mlx_locate.server`).

Binds 127.0.0.1 by default; any other address prints a warning, since the model is then reachable from other
machines (set --api-key, and --allowed-host for the names clients use). The port is bound before the model
loads, so a port in use is reported at once; `/health` says "loading" (503) until the model is loaded and
warmed up, and then "serving on URL" is printed. A model that is missing or bad is one `error:` line, status 2.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import socket
import sys
import threading
from pathlib import Path
from urllib.parse import urlsplit

from ..commands import flags
from ..locate import load
from ..weights.checkpoint import resolve
from .protocol import DEFAULT_MAX_PIXELS, Settings
from .worker import ModelError, WorkerError

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """Flags shared with `mlx-locate-mcp`: what to load and what one request may cost."""
    flags.add_model(p)
    flags.add_max_pixels(p, DEFAULT_MAX_PIXELS)
    p.add_argument(
        "--max-queue",
        type=flags.positive_int,
        default=Settings.max_queue,
        help="requests waiting or decoding at once; more are refused (HTTP 503) (default: %(default)s)",
    )
    p.add_argument(
        "--timeout",
        type=flags.positive_float,
        default=Settings.timeout_s,
        help="seconds one request may take, queueing included (HTTP 504) (default: %(default)s)",
    )
    flags.add_rows(p)
    p.add_argument(
        "--no-warmup", action="store_true", help="say ready as soon as the model loads (first requests compile)"
    )


def origin(text: str) -> str:
    """An `--allow-origin` value: "*" or scheme://host[:port], as a browser sends it in `Origin`."""
    if text == "*":
        return text
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/") or parts.query:
        raise argparse.ArgumentTypeError(f"expected an origin such as http://localhost:5173 (or *), got {text!r}")
    return f"{parts.scheme}://{parts.netloc}"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mlx-locate-server",
        description="Serve LocateAnything over HTTP: /v1/locate, /v1/ground, /v1/chat/completions and a web page.",
    )
    add_model_flags(p)
    p.add_argument("--host", default=DEFAULT_HOST, help="address to bind (default: %(default)s, this machine only)")
    p.add_argument(
        "--port", type=flags.port_int, default=DEFAULT_PORT, help="port; 0: any free one (default: %(default)s)"
    )
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/* (HTTP 401 otherwise)")
    p.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a host name clients may use besides localhost and the bound address (Host/Origin checks); repeatable",
    )
    p.add_argument(
        "--max-body-mb",
        type=flags.byte_size(2**20),
        default=Settings.max_body_mb,
        help="largest request body (default: %(default)s)",
    )
    p.add_argument(
        "--max-image-mb",
        type=flags.byte_size(2**20),
        default=Settings.max_image_mb,
        help="megabytes of images the server holds, compressed while they wait and decoded once their turn comes; "
        "more are refused (HTTP 503) (default: %(default)s)",
    )
    p.add_argument("--allow-remote-images", action="store_true", help="fetch http(s) image URLs (off: no fetching)")
    p.add_argument(
        "--allow-origin",
        action="append",
        default=[],
        type=origin,
        metavar="URL",
        help="a web origin whose pages may call the API and read its answers (CORS), e.g. http://localhost:5173; "
        "repeatable; '*' for any (default: none)",
    )
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    return p


def bind_warning(host: str) -> str | None:
    """The warning printed when `host` is not a loopback address."""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        loopback = False
    if loopback:
        return None
    return (
        f"warning: binding to {host} makes the server reachable from other machines; "
        "set --api-key, and --allowed-host NAME for each name clients use to reach it"
    )


def model_loader(args: argparse.Namespace):
    """The model's folder checked (or downloaded) now; the returned function loads it on the worker thread
    (within --memory-limit where given)."""
    folder = resolve(args.model)
    if args.adapter is not None and not Path(args.adapter).is_dir():
        raise FileNotFoundError(f"adapter folder {args.adapter!r} does not exist")
    flags.apply_memory_limit(args)
    return lambda: load(folder, dtype=args.dtype, adapter_path=args.adapter)


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port); `OSError` with what to do when it cannot be."""
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    sock = socket.socket(family)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as e:
        sock.close()
        raise OSError(
            f"cannot listen on {host}:{port}: {e.strerror or e}; is another server using it? (--port)"
        ) from None
    return sock


def url_of(sock: socket.socket) -> str:
    """The http:// address of a bound socket (an IPv6 address in brackets)."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        import uvicorn

        from .app import create_app
    except ImportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        sock = listen(args.host, args.port)  # before anything slow: a port in use fails at once
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        load = model_loader(args)
    except FileNotFoundError as e:
        sock.close()
        print(f"error: {e}", file=sys.stderr)
        return 2
    warning = bind_warning(args.host)
    if warning:
        print(warning, file=sys.stderr)
    settings = Settings(
        model_name=args.model,
        host=args.host,
        allowed_hosts=tuple(args.allowed_host),
        api_key=args.api_key,
        max_body_mb=args.max_body_mb,
        max_pixels=args.max_pixels,
        max_queue=args.max_queue,
        max_image_mb=args.max_image_mb,
        timeout_s=args.timeout,
        allow_remote_images=args.allow_remote_images,
        max_rows=args.max_rows,
        allow_origins=tuple(args.allow_origin),
        warmup=not args.no_warmup,
    )
    app = create_app(load, settings)
    worker, url = app.state.worker, url_of(sock)
    # Our access log (one line per request, with its rows and steps) replaces uvicorn's, while the server runs.
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("mlx_locate.server")
    level = logger.level
    server = uvicorn.Server(uvicorn.Config(app, log_level=args.log_level, access_log=False))
    # uvicorn's own lines wait for the model: a model that fails to load is told in one line.
    uvicorn_logger = logging.getLogger("uvicorn.error")
    uvicorn_level = uvicorn_logger.level
    uvicorn_logger.setLevel(max(uvicorn_level, logging.WARNING))

    def watch_load() -> None:
        try:
            worker.wait_ready()
        except WorkerError:  # told once the server has stopped
            server.should_exit = True
            return
        uvicorn_logger.setLevel(uvicorn_level)
        print(f"serving on {url}", file=sys.stderr)

    logger.addHandler(handler)
    logger.setLevel(args.log_level.upper())
    try:
        with sock:
            threading.Thread(target=watch_load, name="watch-load", daemon=True).start()
            server.run(sockets=[sock])
    except KeyboardInterrupt:  # Ctrl-C: uvicorn has shut down, then raised the signal again for the exit status
        return 130
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        uvicorn_logger.setLevel(uvicorn_level)
    if worker.load_error is not None:
        print(f"error: {worker.load_error}", file=sys.stderr)
        return 2 if isinstance(worker.load_error, ModelError) else 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
