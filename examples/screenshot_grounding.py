"""Screenshot grounding for a GUI agent: where to click for an instruction, and the element's box.

    python examples/screenshot_grounding.py [--image screenshot.png] "the Save button" "the Cancel button"
        [--model M] [--draw out.png] [--json]

Each instruction is asked twice on one session of the screenshot (vision and the prompt prefix run once):
`--task point` gives the click point, `--task gui` the element's box. Without `--image` a mock dialog is used.
The model is a checkpoint folder or hub id (default: $MLX_LOCATE_MODEL, else the bundled "demo").
"""

from __future__ import annotations

import argparse
import json
import os

from PIL import Image, ImageDraw

import mlx_locate
from mlx_locate.draw import draw_objects

DEFAULT_INSTRUCTIONS = ["the Save button", "the Cancel button"]


def mock_screenshot(size: tuple[int, int] = (400, 300)) -> Image.Image:
    """A dialog with a title bar, a message and three buttons: something to ground without a real screenshot."""
    image = Image.new("RGB", size, (236, 236, 236))
    draw = ImageDraw.Draw(image)
    w, h = size
    draw.rectangle((0, 0, w, 28), fill=(60, 90, 160))
    draw.text((10, 8), "Untitled - Editor", fill="white")
    draw.text((24, 70), "Save changes to this document before closing?", fill="black")
    for i, label in enumerate(["Save", "Don't Save", "Cancel"]):
        left = w - 3 * 110 + i * 110
        draw.rounded_rectangle((left, h - 60, left + 96, h - 30), radius=6, fill="white", outline=(120, 120, 120))
        draw.text((left + 14, h - 52), label, fill="black")
    return image


def ground(session: mlx_locate.locate.Session, instruction: str, max_tokens: int) -> dict:
    """The click point (`point` task) and the element box (`gui` task) for one instruction, in pixels."""
    point = session.locate(instruction, task="point", max_tokens=max_tokens)
    box = session.locate(instruction, task="gui", max_tokens=max_tokens)
    points = [o.point for o in point.objects if o.point is not None]
    boxes = [o.box for o in box.objects if o.box is not None]
    return {
        "instruction": instruction,
        "click": list(points[0]) if points else None,
        "box": list(boxes[0]) if boxes else None,
        "objects": point.objects + box.objects,
        "seconds": sum(r.stats["prefill_s"] + r.stats["decode_s"] for r in (point, box)),
    }


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("instructions", nargs="*", default=DEFAULT_INSTRUCTIONS)
    p.add_argument("--image", help="the screenshot (default: a mock dialog)")
    p.add_argument("--model", default=os.environ.get("MLX_LOCATE_MODEL", "demo"))
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--draw", help="save the screenshot with click points and boxes drawn")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    args = p.parse_args(argv)

    screenshot = Image.open(args.image) if args.image else mock_screenshot()
    session = mlx_locate.load(args.model).session(screenshot)  # vision and the prompt prefix run once
    found = [ground(session, text, args.max_tokens) for text in args.instructions]
    if args.draw:
        draw_objects(screenshot, [obj for f in found for obj in f["objects"]], args.draw, overwrite=True)
    rows = [{k: v for k, v in f.items() if k != "objects"} for f in found]
    for row in rows:
        if args.json:
            print(json.dumps(row))
        else:
            click = "not found" if row["click"] is None else f"({row['click'][0]:.0f}, {row['click'][1]:.0f})"
            box = "not found" if row["box"] is None else "[" + ", ".join(f"{v:.0f}" for v in row["box"]) + "]"
            print(f"{row['instruction']}: click {click}, box {box}  ({row['seconds']:.2f}s)")
    return rows


if __name__ == "__main__":
    main()
