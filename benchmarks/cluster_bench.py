"""Images/s of `mlx-locate-batch --ray` per number of actors, against one process without Ray (issue 17).

    python benchmarks/cluster_bench.py --model demo --actors 1 2                 # a local Ray cluster of CPU actors
    python benchmarks/cluster_bench.py --address HEAD_IP:6379 --actors 1 2 4 --folder /shared/photos --query car

Runs the functions the command runs, over the same folder, timing each line as it comes back: `annotate.annotate`
in this process (the model loaded here first) and `cluster.ray_lines` on the cluster (`--address`, else a
local one with as many CPUs as the most actors asked), each actor loading the model itself. Reports the
time to the first line (process or actor start, model load, first batch), the whole run, images/s over the
whole run and after the first line, and whether every run wrote the same token ids. Prints a table and
writes JSON (default benchmarks/results/cluster_<model>.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import ray

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from batch_bench import synthetic_folder  # noqa: E402

from mlx_locate.commands import batch, cluster  # noqa: E402
from mlx_locate.commands import folders as annotate  # noqa: E402
from mlx_locate.locate import load  # noqa: E402


def timed(lines: Iterator[annotate.Annotated], t0: float, n: int, label: str) -> dict:
    """Drain `lines`, timing each from `t0`: the run's figures and its token ids by image."""
    stamps, token_ids, workers = [], {}, set()
    for line, _, worker in lines:
        stamps.append(time.perf_counter() - t0)
        token_ids[line["image"]] = [r["token_ids"] for r in line.get("results", [])]
        workers.add(worker)
    total, first = stamps[-1], stamps[0]
    return {
        "run": label,
        "first_line_s": first,
        "total_s": total,
        "images_per_s": n / total,
        "images_per_s_after_first": (n - 1) / (total - first) if n > 1 and total > first else None,
        "workers": len(workers - {None}) or 1,
        "token_ids": token_ids,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="demo", help="checkpoint folder, hub id or 'demo' (every node reads it)")
    p.add_argument("--address", help="a running Ray cluster (default: a local one started here)")
    p.add_argument("--actors", type=int, nargs="+", default=[1, 2], help="actor counts (default: 1 2)")
    p.add_argument("--folder", help="images, by paths every node can read (default: --scenes synthetic scenes)")
    p.add_argument("--scenes", type=int, default=32, help="synthetic scenes when no --folder (default: 32)")
    p.add_argument("--query", action="append", help="repeatable (default: square)")
    p.add_argument("--mode", default="hybrid", choices=["slow", "fast", "hybrid"])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--batch-size", type=int, help="engine rows per actor (default: the engine's)")
    p.add_argument("--images-per-task", type=int, default=batch.DEFAULT_IMAGES_PER_TASK)
    p.add_argument("--workdir", default=str(ROOT / ".bench"))
    p.add_argument("--json", help="default: benchmarks/results/cluster_<model>.json")
    args = p.parse_args(argv)

    folder = (
        Path(args.folder) if args.folder else synthetic_folder(Path(args.workdir) / f"scenes{args.scenes}", args.scenes)
    )
    paths = [str(Path(path).resolve()) for path in batch.list_images(str(folder))]
    questions = tuple(annotate.Question("detect", q) for q in args.query or ["square"])
    settings = annotate.AnnotateSettings(
        questions, mode=args.mode, max_tokens=args.max_tokens, max_rows=args.batch_size
    )

    t0 = time.perf_counter()
    runs = [timed(annotate.annotate(load(args.model), paths, settings), t0, len(paths), "one process, no Ray")]
    t0 = time.perf_counter()
    if args.address:
        ray.init(address=args.address)
    else:
        ray.init(address="local", num_cpus=max(args.actors), include_dashboard=False, log_to_driver=False)
    ray_start_s = time.perf_counter() - t0
    model = {"path_or_hub_id": args.model, "dtype": None, "adapter_path": None}
    for n in args.actors:
        t0 = time.perf_counter()
        lines = cluster.ray_lines(None, paths, model, settings, n, args.images_per_task)
        runs.append(timed(lines, t0, len(paths), f"Ray, {n} actor{'s' * (n > 1)}"))
    resources = ray.cluster_resources()
    ray.shutdown()

    same = all(r["token_ids"] == runs[0]["token_ids"] for r in runs)
    for r in runs:
        del r["token_ids"]
    report = {
        "model": args.model,
        "cluster": args.address or f"local, {max(args.actors)} CPUs",
        "resources": {k: v for k, v in resources.items() if not k.startswith("node:")},
        "machine": platform.machine(),
        "ray": ray.__version__,
        "ray_start_s": ray_start_s,
        "images": len(paths),
        "queries": [q.query for q in questions],
        "mode": args.mode,
        "max_tokens": args.max_tokens,
        "images_per_task": args.images_per_task,
        "same_tokens": same,
        "runs": runs,
        "load_average_end": os.getloadavg(),  # other work on the machine while it ran
    }
    out = Path(args.json) if args.json else ROOT / "benchmarks" / "results" / f"cluster_{Path(args.model).name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))

    print(f"\n{args.model}, {len(paths)} images, {args.mode}, {report['queries']}, cluster: {report['cluster']}")
    print("| run | first line s | total s | images/s | images/s after the first line |")
    print("|---|---|---|---|---|")
    for r in runs:
        after = r["images_per_s_after_first"]
        print(
            f"| {r['run']} | {r['first_line_s']:.1f} | {r['total_s']:.1f} | {r['images_per_s']:.2f} "
            f"| {'-' if after is None else f'{after:.2f}'} |"
        )
    print(f"same token ids in every run: {same}; JSON: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
