"""The Python API in a few lines: `python examples/locate.py IMAGE "car" "person" [--model M] [--draw out.png]`.

The model is a checkpoint folder or hub id (default: $MLX_LOCATE_MODEL, else the bundled "demo").
"""

import argparse
import os

from PIL import Image

import mlx_locate
from mlx_locate.draw import draw_objects


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("image")
    p.add_argument("queries", nargs="+")
    p.add_argument("--model", default=os.environ.get("MLX_LOCATE_MODEL", "demo"))
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--draw", help="save the image with every query's boxes drawn")
    args = p.parse_args(argv)

    model = mlx_locate.load(args.model)
    # One image, many queries: vision and the prompt prefix run once, then each query decodes on its own.
    results = model.locate(args.image, args.queries, mode="hybrid", max_tokens=args.max_tokens)
    for query, result in zip(args.queries, results, strict=True):
        print(f"{query}: {len(result.objects)} found in {result.stats['decode_s']:.2f}s")
        for obj in result.objects:
            kind, where = ("box", obj.box) if obj.box else ("point", obj.point)
            print(f"  {obj.label}  {kind} {[round(v, 1) for v in where]}  confidence {obj.confidence:.3f}")
    if args.draw:
        objects = [obj for result in results for obj in result.objects]
        draw_objects(Image.open(args.image), objects, args.draw, overwrite=True)


if __name__ == "__main__":
    main()
