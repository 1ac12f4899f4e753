"""The report of scored rows: the markdown table and its breakdowns, `report.json`, the F1-vs-IoU plot, and the
comparison of two reports.

boxes/s = boxes and points found over the wall time of their samples, passes/box = decoding forward passes per
box or point, s/image = wall seconds per sample (all of its requests).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from .. import metrics
from ..decide import MODE_NAMES
from .formats import extra
from .score import Row

MODES = MODE_NAMES
REPORT_FILES = ("report.json", "report.md", "f1_vs_iou.png")
COLUMNS = (  # header, Row attribute, format
    ("F1@0.5", "f1_50", ".3f"),
    ("F1@0.95", "f1_95", ".3f"),
    ("F1@mean", "f1_mean", ".3f"),
    ("point F1", "point_f1", ".3f"),
    ("GUI acc", "gui_acc", ".3f"),
    ("mAP", "map", ".3f"),
    ("boxes/s", "boxes_per_s", ".1f"),
    ("passes/box", "passes_per_box", ".2f"),
    ("s/image", "s_per_image", ".3f"),
)


def build_report(rows: list[Row], sources: list[dict], **about) -> dict:
    """The report.json content: `about` (the model, the data), the sources, and the rows by dataset, then mode."""
    datasets = list(dict.fromkeys(r.dataset for r in rows))
    rows = sorted(
        rows, key=lambda r: (datasets.index(r.dataset), MODES.index(r.mode) if r.mode in MODES else len(MODES))
    )
    return {**about, "sources": sources, "rows": [asdict(r) for r in rows]}


def _cell(row: dict, key: str) -> float | None:
    if key == "point_f1":
        return (row.get("pointing") or {}).get("f1")
    if key == "gui_acc":
        return row.get("accuracy") if row.get("metric") in ("gui", "hallucination") else None
    return row.get(key)


def markdown_table(rows: list[dict]) -> str:
    head = ["dataset", "mode", "n", *(c[0] for c in COLUMNS)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    notes = []
    for r in rows:
        cells = [r["dataset"] + (" (COCO path)" if r["metric"] == "coco" else ""), r["mode"], str(r["samples"])]
        for _, key, fmt in COLUMNS:
            v = _cell(r, key)
            cells.append("-" if v is None else format(v, fmt))
        lines.append("| " + " | ".join(cells) + " |")
        where = f"{r['dataset']} ({r['mode']})"
        if r["empty_scored_zero"]:
            w = r["without_empty"]
            notes.append(
                f"{where}: {r['empty_scored_zero']} samples asked for categories with no GT box and got no box: "
                f"scored 0 as the paper does (without them F1@0.5 {w['f1@0.5']:.3f}, F1@mean {w['f1@mean']:.3f})"
            )
        if r["errors"]:
            notes.append(f"{where}: {r['errors']} samples failed (unreadable image or prompt) and are left out")
        if r["malformed"]:
            notes.append(f"{where}: {r['malformed']} malformed prediction entries dropped")
        if r.get("capped"):
            notes.append(f"{where}: {r['capped']} requests stopped at the --max-tokens cap")
        if r.get("note"):
            notes.append(f"{where}: {r['note']}")
    return "\n".join(lines + ([""] + [f"- {n}" for n in notes] if notes else []))


def breakdown_table(rows: list[dict]) -> str:
    """F1@0.5 by object size and by GT count (box rows), GUI accuracy by data type and source."""
    sizes = [name for name, _ in metrics.SIZE_LIMITS]
    counts = [name for _, name in metrics.GT_COUNT_RANGES]
    head = ["dataset", "mode", *sizes, *(f"{c} GT" for c in counts)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    gui = []
    for r in rows:
        b = r["breakdown"]
        if "by_size" in b:
            cells = [b[key].get(name) for key, names in (("by_size", sizes), ("by_gt_count", counts)) for name in names]
            text = ["-" if c is None else f"{c['f1']:.3f} ({c['samples']})" for c in cells]
            lines.append("| " + " | ".join([r["dataset"], r["mode"], *text]) + " |")
        for key in ("by_type", "by_source"):
            if key in b:
                parts = ", ".join(f"{k} {v['accuracy']:.3f} ({v['samples']})" for k, v in b[key].items())
                gui.append(f"- {r['dataset']} ({r['mode']}), accuracy {key.replace('_', ' ')}: {parts}")
    out = (
        "F1@0.5 by object size and by GT count (samples in brackets):\n\n" + "\n".join(lines) if len(lines) > 2 else ""
    )
    return "\n\n".join(part for part in (out, "\n".join(gui)) if part)


def report_text(rows: list[dict]) -> str:
    """The printed report and report.md: the main table, then the breakdowns."""
    return "\n\n".join(part for part in (markdown_table(rows), breakdown_table(rows)) if part)


def plot_f1(rows: list[dict], path: Path) -> None:
    """F1 against the IoU threshold, one panel per dataset and one line per mode."""
    matplotlib = extra("matplotlib", "the F1 plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = list(dict.fromkeys(r["dataset"] for r in rows if r["f1"]))
    if not datasets:
        return
    cols = min(3, len(datasets))
    n_rows = (len(datasets) + cols - 1) // cols
    fig, axes = plt.subplots(n_rows, cols, figsize=(4.5 * cols, 3.4 * n_rows), squeeze=False)
    for ax, name in zip(axes.flat, datasets, strict=False):
        for r in rows:
            if r["dataset"] == name and r["f1"]:
                ax.plot([float(t) for t in r["f1"]], list(r["f1"].values()), marker="o", label=r["mode"])
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("IoU threshold")
        ax.set_ylabel("F1")
        ax.set_ylim(max(0.0, min(min(r["f1"].values()) for r in rows if r["dataset"] == name and r["f1"]) - 0.1), 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(datasets) :]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def compare_reports(a: dict, b: dict, names: tuple[str, str] = ("A", "B")) -> str:
    """Every row present in both reports, each column as A, B and B - A."""
    index_b = {(r["dataset"], r["mode"]): r for r in b["rows"]}
    lines = [f"| dataset | mode | metric | {names[0]} | {names[1]} | difference |", "|---|---|---|---|---|---|"]
    only_a = []
    for ra in a["rows"]:
        rb = index_b.pop((ra["dataset"], ra["mode"]), None)
        if rb is None:
            only_a.append(f"{ra['dataset']} ({ra['mode']})")
            continue
        for header, key, fmt in COLUMNS:
            va, vb = _cell(ra, key), _cell(rb, key)
            if va is None and vb is None:
                continue
            diff = "-" if va is None or vb is None else format(vb - va, "+" + fmt)
            cells = ["-" if v is None else format(v, fmt) for v in (va, vb)]
            lines.append(f"| {ra['dataset']} | {ra['mode']} | {header} | {cells[0]} | {cells[1]} | {diff} |")
    for label, missing in ((names[0], only_a), (names[1], [f"{d} ({m})" for d, m in index_b])):
        if missing:
            lines.append(f"\nonly in {label}: {', '.join(missing)}")
    return "\n".join(lines)


def check_report_free(folder: Path, overwrite: bool) -> None:
    existing = [name for name in REPORT_FILES if (folder / name).exists()]
    if existing and not overwrite:
        raise ValueError(f"{folder} already has {', '.join(existing)}; pass --overwrite to replace them")


def write_report(folder: Path, report: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "report.json").write_text(json.dumps(report, indent=1))
    (folder / "report.md").write_text(report_text(report["rows"]) + "\n")
    plot_f1(report["rows"], folder / "f1_vs_iou.png")
