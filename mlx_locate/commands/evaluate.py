"""`mlx-locate-eval`: the LocateAnything paper's metrics on the paper's benchmark formats.

    mlx-locate-eval --synthetic 200 --modes slow fast hybrid --out runs/demo   # held-out synthetic scenes
    mlx-locate-eval --export bench --n 100                    # the same benchmark as files, in each input format
    mlx-locate-eval --data bench/synthetic.jsonl --modes slow fast hybrid --out runs/demo
    mlx-locate-eval --predictions runs/demo/synthetic_fast.jsonl   # score an answer file; no model is loaded
    mlx-locate-eval --compare runs/bf16/report.json runs/q4/report.json

`python -m mlx_locate.commands.evaluate` runs the same `main`. Data: benchmark files (`--data`, repeatable; formats in
`evaluation.formats`, images under `--images`, by default the data file's folder) and the synthetic scenes
(`--synthetic N`, `evaluation.synthetic`). The model answers each sample (`evaluation.predict`) in every `--modes`
mode, into `OUT/<data>_<mode>.jsonl`, each line with the settings it was made with; a rerun continues those
files, refused if made with other settings (`--overwrite` answers again). The report (`evaluation.score`,
`evaluation.report`; printed, and with `--out` also `report.json`, `report.md` and `f1_vs_iou.png`) has one row
per dataset and mode.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..evaluation.formats import FORMATS, load_benchmark, read_json
from ..evaluation.predict import DEFAULT_MAX_TOKENS, SAMPLINGS, RunOptions, check_answer_files, evaluate
from ..evaluation.report import MODES, build_report, check_report_free, compare_reports, report_text, write_report
from ..evaluation.score import score_answers
from ..evaluation.synthetic import export_benchmark, synthetic_benchmarks
from . import flags


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mlx-locate-eval",
        description="The LocateAnything paper's metrics (F1 over IoU thresholds, pointing, GUI accuracy, the COCO "
        "path and mAP) on its benchmark formats: run a model, score answer files, compare runs.",
    )
    what = p.add_argument_group("what to do (one of --data/--synthetic, --predictions, --compare, --export)")
    what.add_argument("--data", action="extend", nargs="+", metavar="PATH", help="benchmarks to run the model on")
    what.add_argument(
        "--synthetic", type=flags.positive_int, metavar="N", help="run the model on N held-out synthetic scenes"
    )
    what.add_argument("--predictions", action="extend", nargs="+", metavar="FILE", help="answer JSONL files to score")
    what.add_argument("--compare", nargs=2, metavar=("A", "B"), help="two report.json files: print the differences")
    what.add_argument(
        "--export", metavar="DIR", type=flags.output_path, help="write the synthetic benchmark in every input format"
    )
    flags.add_images_root(p, "the benchmarks'")
    p.add_argument("--format", choices=FORMATS, default="auto", help="input format of --data (default: by content)")
    flags.add_model(p)
    p.add_argument("--modes", nargs="+", choices=MODES, default=["hybrid"], help="decoding modes (default: hybrid)")
    flags.add_max_tokens(p, DEFAULT_MAX_TOKENS)
    p.add_argument("--sampling", choices=list(SAMPLINGS), default="greedy", help="(default: %(default)s)")
    flags.add_rendering(p)
    flags.add_image_options(p)
    flags.add_rows(p)
    p.add_argument(
        "--split-categories",
        action="store_true",
        help="decode a detection sample's categories one per row (default: one joint prompt, the paper's protocol)",
    )
    p.add_argument("--gui-task", choices=("point", "gui"), default="point", help="GUI prompt: a point or a box")
    p.add_argument("--limit", type=flags.positive_int, help="only the first N samples of each benchmark")
    p.add_argument(
        "--out", type=flags.output_path, help="folder for answer files and report.json, report.md, f1_vs_iou.png"
    )
    flags.add_overwrite(p, "existing answer and report files, answering again (or exported files)")
    p.add_argument("--n", type=flags.positive_int, default=100, help="--export: scenes (default: %(default)s)")
    p.add_argument(
        "--seed", type=flags.seed_int, default=0, help="--synthetic, --export: seed of the held-out stream (default: 0)"
    )
    flags.add_progress(p)
    return p


def run(args: argparse.Namespace) -> int:
    given = {"data": args.data or args.synthetic, "predictions": args.predictions}
    given.update(compare=args.compare, export=args.export)
    actions = [a for a, value in given.items() if value]
    if not actions or (len(actions) > 1 and set(actions) != {"data", "predictions"}):
        raise ValueError(
            "give one of --data (or --synthetic), --predictions, --compare or --export (--data or --synthetic "
            "with --predictions names the COCO file of the answers)"
        )
    for flag in ("export", "out"):
        if getattr(args, flag):
            flags.check_folder(f"--{flag}", Path(getattr(args, flag)))
    if args.export:
        paths = export_benchmark(args.export, args.n, args.seed, args.overwrite)
        print("\n".join(str(p) for p in paths.values()))
        return 0
    if args.compare:
        a, b = (read_json(Path(p)) for p in args.compare)
        print(compare_reports(a, b, tuple(args.compare)))
        return 0
    out = Path(args.out) if args.out else None
    if out is not None:
        check_report_free(out, args.overwrite)
    if out is None and not args.predictions:
        raise ValueError("--data needs --out (the folder for the answer files and the report; so does --synthetic)")
    benches = [load_benchmark(d, args.images, args.format) for d in args.data or []]
    if args.synthetic:
        benches += synthetic_benchmarks(args.synthetic, args.seed)
    about = {"model": None if args.predictions else args.model}
    if args.synthetic:
        about["synthetic"] = {"n": args.synthetic, "seed": args.seed}
    if args.predictions:
        coco = next((b.coco for b in benches if b.coco is not None), None)
        if benches and coco is None:
            raise ValueError("with --predictions, --data names the COCO instances JSON of the answers")
        rows, sources = score_answers([Path(p) for p in args.predictions], coco)
    else:
        options = RunOptions(
            max_tokens=args.max_tokens,
            sampling=SAMPLINGS[args.sampling],
            rendering=args.rendering,
            max_rows=args.max_rows,
            orientation=args.orientation,
            max_image_tokens=args.max_image_tokens,
            gui_task=args.gui_task,
            limit=args.limit,
            split_categories=args.split_categories,
            model=flags.model_settings(args),
        )
        if not args.overwrite:  # an answer file of another benchmark or other settings fails before loading
            for note in check_answer_files(out, benches, args.modes, options):
                print(note, file=sys.stderr)
        model = flags.load_model(args)
        rows, sources = evaluate(model, benches, out, args.modes, options, not args.no_progress, args.overwrite)
    report = build_report(rows, sources, **about)
    print(report_text(report["rows"]))
    if out is not None:
        write_report(out, report)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
