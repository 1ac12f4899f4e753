"""A small desktop app: pick an image, type queries (one per line), see the boxes, save them as JSON.

    python examples/desktop.py [--model M]                      # the Tk window
    python examples/desktop.py --headless IMAGE Q [Q ...] --json out.json [--png out.png]

The model is a checkpoint folder or hub id (default: $MLX_LOCATE_MODEL, else the bundled "demo"). Tk is only
imported when the window opens, so `--headless` and `import desktop` work without a display.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from PIL import Image

import mlx_locate
from mlx_locate.draw import draw_objects

MODES = ("hybrid", "fast", "slow")
VIEW_SIZE = (960, 720)  # the largest size the image is shown at


def locate_all(
    model: mlx_locate.LocateModel, image: Image.Image, queries: list[str], mode: str = "hybrid", max_tokens: int = 512
) -> tuple[list[mlx_locate.Result], Image.Image]:
    """Every query on one image (one session), and the image with all their objects drawn."""
    results = model.locate(image, queries, mode=mode, max_tokens=max_tokens)
    drawn = draw_objects(image, [obj for result in results for obj in result.objects])
    return results, drawn


def results_json(image_path: str | Path, queries: list[str], results: list[mlx_locate.Result]) -> dict:
    """What "Save JSON" writes: the image and, per query, its objects and timings."""
    return {
        "image": str(image_path),
        "queries": [
            {"query": q, "objects": r.to_dict()["objects"], "empty_labels": r.empty_labels, "stats": r.stats}
            for q, r in zip(queries, results, strict=True)
        ],
    }


def headless(
    model_path: str, image_path: str, queries: list[str], json_path: str, png_path: str | None = None, **options
) -> dict:
    """What the window does, without one: locate, save the JSON (and the drawing); returns the JSON object."""
    model = mlx_locate.load(model_path)
    image = Image.open(image_path)
    results, drawn = locate_all(model, image, queries, **options)
    data = results_json(image_path, queries, results)
    Path(json_path).write_text(json.dumps(data, indent=1))
    if png_path:
        drawn.save(png_path)
    return data


def run_window(model_path: str, max_tokens: int = 512) -> None:
    import tkinter as tk
    from tkinter import filedialog, messagebox, ttk

    from PIL import ImageTk

    root = tk.Tk()
    root.title(f"mlx-locate: {model_path}")
    state = {"model": None, "path": None, "image": None, "queries": [], "results": None, "photo": None}

    bar = ttk.Frame(root, padding=4)
    bar.pack(side=tk.TOP, fill=tk.X)
    queries_box = tk.Text(root, height=4, width=60)
    queries_box.insert("1.0", "car\nperson")
    queries_box.pack(side=tk.TOP, fill=tk.X, padx=4)
    mode = tk.StringVar(value=MODES[0])
    status = tk.StringVar(value="Open an image, type one query per line, press Locate.")
    view = ttk.Label(root)
    view.pack(side=tk.TOP, expand=True)
    ttk.Label(root, textvariable=status, anchor=tk.W).pack(side=tk.BOTTOM, fill=tk.X, padx=4)

    def show(image: Image.Image) -> None:
        shown = image.copy()
        shown.thumbnail(VIEW_SIZE)
        state["photo"] = ImageTk.PhotoImage(shown)  # keep a reference, or Tk shows nothing
        view.configure(image=state["photo"])

    def open_image() -> None:
        path = filedialog.askopenfilename(filetypes=[("Images", "*.png *.jpg *.jpeg *.bmp *.webp"), ("All", "*")])
        if path:
            state.update(path=path, image=Image.open(path), results=None)
            show(state["image"])
            status.set(f"{path}: {state['image'].width}x{state['image'].height}")

    def locate() -> None:
        queries = [q.strip() for q in queries_box.get("1.0", tk.END).splitlines() if q.strip()]
        if state["image"] is None or not queries:
            messagebox.showinfo("mlx-locate", "Open an image and type at least one query first.")
            return
        status.set("Loading the model..." if state["model"] is None else "Locating...")
        root.update_idletasks()
        if state["model"] is None:
            state["model"] = mlx_locate.load(model_path)
        results, drawn = locate_all(state["model"], state["image"], queries, mode.get(), max_tokens)
        state.update(queries=queries, results=results)
        show(drawn)
        found = ", ".join(f"{q}: {len(r.objects)}" for q, r in zip(queries, results, strict=True))
        status.set(f"{found}  ({sum(r.stats['decode_s'] for r in results):.2f}s decoding)")

    def save() -> None:
        if state["results"] is None:
            messagebox.showinfo("mlx-locate", "Nothing to save yet: press Locate first.")
            return
        path = filedialog.asksaveasfilename(defaultextension=".json", filetypes=[("JSON", "*.json")])
        if path:
            data = results_json(state["path"], state["queries"], state["results"])
            Path(path).write_text(json.dumps(data, indent=1))
            status.set(f"saved {path}")

    ttk.Button(bar, text="Open image...", command=open_image).pack(side=tk.LEFT)
    ttk.OptionMenu(bar, mode, MODES[0], *MODES).pack(side=tk.LEFT, padx=4)
    ttk.Button(bar, text="Locate", command=locate).pack(side=tk.LEFT)
    ttk.Button(bar, text="Save JSON...", command=save).pack(side=tk.LEFT, padx=4)
    root.mainloop()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=os.environ.get("MLX_LOCATE_MODEL", "demo"))
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--headless", nargs="+", metavar=("IMAGE", "QUERY"), help="no window: an image and its queries")
    p.add_argument("--mode", choices=MODES, default=MODES[0], help="with --headless")
    p.add_argument("--json", help="with --headless: where to save the results")
    p.add_argument("--png", help="with --headless: where to save the drawing")
    args = p.parse_args(argv)
    if args.headless is None:
        run_window(args.model, args.max_tokens)
        return
    if len(args.headless) < 2 or not args.json:
        p.error("--headless needs IMAGE and at least one QUERY, and --json OUT")
    image, *queries = args.headless
    data = headless(args.model, image, queries, args.json, args.png, mode=args.mode, max_tokens=args.max_tokens)
    for entry in data["queries"]:
        print(f"{entry['query']}: {len(entry['objects'])} found")


if __name__ == "__main__":
    main()
