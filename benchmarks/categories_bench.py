"""Several categories on one image: one joint prompt (the reference's), the joint prompt with its labels held to the
asked names, and one row per category (our default).

    python benchmarks/categories_bench.py                                   # demo: F1@0.5 and cost, CPU
    python benchmarks/categories_bench.py --preset 3b --coco 80 --images 4  # 3B shapes, random weights: cost

Demo model (default): held-out synthetic scenes (`make_sample(0, 200 + i, "eval")`), each asked for K shape
categories (all five for K=5; for K=2 two drawn per scene, seeded), in each mode: jointly (`joint`, labels free:
`Guards(label_constraint=False)`), jointly with the labels held to the names (`joint+constraint`, the joint
default), and split. Scored with the project's scorer (`evaluation.score.located_f1`: a box counts with the right
label and IoU >= 0.5); labels outside the asked list are counted. Cost: seconds and engine forward steps per image,
one image at a time in an engine with a row per category.

`--preset 3b`: random weights (boxes meaningless), `--coco N` COCO names on one image: cost only. Split and joint
get the same token budget per category (`--tokens-per-category`): split rows `T` each, the joint prompt `N * T`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import mlx_locate  # noqa: E402
from mlx_locate.decide import Guards  # noqa: E402
from mlx_locate.evaluation.score import located_f1  # noqa: E402
from mlx_locate.parse import LocatedObject  # noqa: E402
from mlx_locate.request import Request  # noqa: E402
from mlx_locate.synthetic.scenes import SHAPES, kept_tasks, make_sample  # noqa: E402
from mlx_locate.weights.cards import COCO_CATEGORIES  # noqa: E402

VARIANTS = {
    "joint": {"joint": True, "guards": Guards(label_constraint=False)},
    "joint+constraint": {"joint": True},
    "split": {},
}


def truth(scene, categories: list[str]) -> list[LocatedObject]:
    return [
        LocatedObject(t.label, t.box, t.box_norm, None, None, None)
        for task in kept_tasks(scene, tuple(categories))
        for t in task.targets
    ]


def categories_of(scene_index: int, k: int) -> list[str]:
    if k >= len(SHAPES):
        return list(SHAPES)
    rng = np.random.default_rng(scene_index)
    return [SHAPES[i] for i in sorted(rng.permutation(len(SHAPES))[:k])]


def one_image(model, request: Request, rows: int) -> tuple[object, float, int]:
    """The result, seconds and engine forward steps of one request alone in an engine of `rows` rows, its
    image's vision and prefix not cached."""
    model.runtime.features.clear()
    model.runtime.prefixes.clear()
    engine = model.engine(rows)
    t0 = time.perf_counter()
    handle = engine.submit(request)
    engine.run()
    if handle.error is not None:
        raise handle.error
    return handle.result, time.perf_counter() - t0, engine.steps


def demo_run(model, scenes: int, counts: list[int], modes: list[str], max_tokens: int, variants: list[str]) -> dict:
    rows = []
    for k in counts:
        for mode in modes:
            for variant in variants:
                options = VARIANTS[variant]
                pairs, outside, seconds, steps = [], 0, [], []
                warm = Request(make_sample(0, 199, "eval").scene.image, categories_of(199, k), mode=mode, **options)
                one_image(model, replace(warm, max_tokens=max_tokens), rows=max(k, 1))  # compiles, not timed
                for i in range(scenes):
                    sample = make_sample(0, 200 + i, "eval")
                    cats = categories_of(i, k)
                    request = Request(sample.scene.image, cats, mode=mode, max_tokens=max_tokens, **options)
                    result, s, n = one_image(model, request, rows=max(k, 1))
                    pairs.append((truth(sample.scene, cats), result.objects))
                    outside += sum(o.label not in cats for o in result.objects)
                    seconds.append(s)
                    steps.append(n)
                score = located_f1(pairs)
                rows.append(
                    {
                        "categories": k,
                        "mode": mode,
                        "variant": variant,
                        "f1": score.f1,
                        "found": score.pred,
                        "gt": score.gt,
                        "labels_outside": outside,
                        "seconds_per_image": float(np.mean(seconds)),
                        "steps_per_image": float(np.mean(steps)),
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
    return {"rows": rows}


def random_run(model, n_categories: int, images: int, tokens: int, modes: list[str], variants: list[str]) -> dict:
    """Cost only (random weights): N COCO names on `images` images, split (T tokens a row) and joint (N*T)."""
    names = list(COCO_CATEGORIES)[:n_categories]
    rng = np.random.default_rng(0)
    pictures = [Image.fromarray(rng.integers(0, 255, (448, 448, 3), dtype=np.uint8)) for _ in range(images)]
    rows = []
    for mode in modes:
        for variant in variants:
            options = VARIANTS[variant]
            budget = tokens if variant == "split" else tokens * len(names)
            seconds, steps, peaks, tokens_out = [], [], [], []
            for k, picture in enumerate(pictures):
                mx.reset_peak_memory()
                request = Request(picture, names, mode=mode, max_tokens=budget, **options)
                result, s, n = one_image(model, request, rows=len(names) if variant == "split" else 1)
                if k:  # the first image warms the compiled functions
                    seconds.append(s)
                    steps.append(n)
                    peaks.append(mx.get_peak_memory() / 1e9)
                    tokens_out.append(result.stats["tokens"])
            rows.append(
                {
                    "categories": len(names),
                    "mode": mode,
                    "variant": variant,
                    "max_tokens_per_request": budget,
                    "seconds_per_image": float(np.mean(seconds)),
                    "steps_per_image": float(np.mean(steps)),
                    "tokens_per_image": float(np.mean(tokens_out)),
                    "peak_memory_gb": float(max(peaks)),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    return {"rows": rows}


def table(report: dict) -> str:
    rows = report["rows"]
    if "f1" in rows[0]:
        head = "| categories | mode | variant | F1@0.5 | found / GT | labels outside | s / image | steps / image |"
        lines = [head, "|---|---|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(
                f"| {r['categories']} | {r['mode']} | {r['variant']} | {r['f1']:.3f} | {r['found']} / {r['gt']} | "
                f"{r['labels_outside']} | {r['seconds_per_image']:.3f} | {r['steps_per_image']:.1f} |"
            )
        return "\n".join(lines)
    head = "| categories | mode | variant | max tokens | s / image | steps / image | tokens / image | peak GB |"
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['categories']} | {r['mode']} | {r['variant']} | {r['max_tokens_per_request']} | "
            f"{r['seconds_per_image']:.3f} | {r['steps_per_image']:.1f} | {r['tokens_per_image']:.0f} | "
            f"{r['peak_memory_gb']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", help="random weights of this preset (e.g. 3b), drawn in memory: cost only")
    p.add_argument("--dtype", default="bfloat16", help="--preset: weights dtype (default: %(default)s)")
    p.add_argument("--scenes", type=int, default=30, help="demo: held-out scenes (default: %(default)s)")
    p.add_argument("--counts", type=int, nargs="+", default=[2, 5], help="demo: categories per image")
    p.add_argument("--modes", nargs="+", default=["slow", "fast", "hybrid"])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--max-tokens", type=int, default=512, help="demo: max tokens per request (default: %(default)s)")
    p.add_argument("--coco", type=int, default=80, help="--preset: COCO names asked (default: %(default)s)")
    p.add_argument("--images", type=int, default=4, help="--preset: images (the first warms up; default: 4)")
    p.add_argument("--tokens-per-category", type=int, default=16, help="--preset: token budget per category")
    p.add_argument("--json", help="write the results here (default: benchmarks/results/categories_<model>.json)")
    args = p.parse_args(argv)

    if args.preset:
        from bench import in_memory_model

        model, name = in_memory_model(args.preset, args.dtype), f"random-{args.preset}"
        report = random_run(model, args.coco, args.images, args.tokens_per_category, args.modes, args.variants)
    else:
        model, name = mlx_locate.load("demo"), "demo"
        report = demo_run(model, args.scenes, args.counts, args.modes, args.max_tokens, args.variants)
    report.update(
        model=name,
        date=datetime.date.today().isoformat(),
        device=str(mx.default_device()),
        machine=platform.machine(),
        command="python benchmarks/categories_bench.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    )
    out = Path(args.json or ROOT / "benchmarks" / "results" / f"categories_{name}.json")
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(table(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
