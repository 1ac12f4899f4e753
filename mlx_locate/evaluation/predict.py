"""Running a model on a benchmark: the paper's prompts per sample, requests through one engine, and the answer
file (`OUT/<benchmark>_<mode>.jsonl`) written and fsynced line by line, continued when it exists.

Prompts are the paper's: detection asks all of a sample's categories in one `</c>` prompt, referring one phrase
(the single-instance template for RefCOCO*), pointing `Point to: {category}.` once per category, OCR the OCR
prompt, GUI a point per instruction (`gui_task="gui"` asks for a box). A sample whose request fails (an
unreadable image) gets an `error` line, which the scorer counts and leaves out, as the paper's scripts skip such
images; delete the line to retry it.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from tqdm import tqdm

from .. import jsonl
from ..engine import EventKind
from ..prompts import CATEGORY_SEPARATOR, task_text
from ..request import Request, RequestError
from ..sampling import Sampling
from .formats import POINT_TASKS, Benchmark, BenchSample, is_ocr, read_answers, resume_lines
from .score import REFERRING, Row, score_lines

DEFAULT_MAX_TOKENS = 4096  # the paper's evaluation budget; clipped to what the model's context holds
# "greedy" is the product default (with its guards); "official" samples as the model card and evaluation do.
SAMPLINGS = {"greedy": Sampling(), "nucleus": Sampling(top_p=0.9), "official": Sampling.OFFICIAL}
SINGLE_INSTANCE_PREFIX = "refcoco"  # datasets asked with the single-instance template
UNRECORDED = ("max_rows", "limit")  # `RunOptions` fields that change no answer


@dataclass(frozen=True)
class Query:
    task: str  # prompts.TASKS
    query: str | None
    key: str | None  # the category its objects are filed under; None: their own <ref> label


def queries(sample: BenchSample, gui_task: str = "point") -> list[Query]:
    """The requests the paper's evaluation asks for one sample."""
    t, cats = sample.task_name, sample.categories
    if t in POINT_TASKS:
        return [Query("point", c, c) for c in cats]
    if t == "gui":
        return [Query(gui_task, cats[0], cats[0])]
    if t == REFERRING:
        task = "single" if sample.dataset_name.lower().startswith(SINGLE_INSTANCE_PREFIX) else "refer"
        return [Query(task, c, c) for c in cats]
    if is_ocr(t):
        return [Query("ocr", None, None)]
    # Detection, hallucination, ...: every category in one prompt (`RunOptions.split_categories`: one row each).
    return [Query("detect", CATEGORY_SEPARATOR.join(cats), None)]


@dataclass(frozen=True)
class RunOptions:
    mode: str = "hybrid"
    max_tokens: int = DEFAULT_MAX_TOKENS
    sampling: Sampling = Sampling()
    rendering: str = "A"
    max_rows: int | None = None
    orientation: str = "exif"  # the benchmark's labels' frame: "stored" where they were made on stored pixels
    max_image_tokens: int | None = None
    gui_task: str = "point"
    limit: int | None = None
    split_categories: bool = False  # a detect sample's categories one per row (default: one joint prompt, the paper's)
    model: dict = field(default_factory=dict)  # the model's identity (`flags.model_settings`)

    def settings(self) -> dict:
        """What an answer line records of how it was made, compared on resume: the model and every option but
        those that change no answer (`UNRECORDED`)."""
        fields = {k: getattr(self, k) for k in self.__dataclass_fields__ if k not in UNRECORDED}
        return jsonl.plain({**fields.pop("model"), **fields})


def answer_line(sample: BenchSample, asked: list[Query], outcomes: list, options: RunOptions, wall_s: float) -> dict:
    """The answer-file line of one sample from its requests' results (or `RequestError`s), with the settings
    they were made with (`RunOptions.settings`)."""
    preds: dict[str, list] = {}
    scores: dict[str, list] = {}
    texts, errors, passes, objects, capped = [], [], 0, 0, 0
    for q, r in zip(asked, outcomes, strict=True):
        if isinstance(r, RequestError):
            errors.append(str(r))
            continue
        texts.append(r.text)
        passes += r.stats["steps"]
        objects += len(r.objects)
        capped += r.stats["stop_reason"] == "length_cap"
        for o in r.objects:
            key = q.key if q.key is not None else (o.label or "")
            preds.setdefault(key, []).append(list(o.box if o.box is not None else o.point))
            scores.setdefault(key, []).append(o.confidence)
    line = {
        "sample_index": sample.index,
        "image_path": sample.image_path,
        "question": "\n".join(task_text(q.task, q.query) for q in asked),
        "raw_response": "\n".join(texts),
        "extracted_predictions": preds,
        "gt": sample.answer_gt(),
        "task_name": sample.task_name,
        "dataset_name": sample.dataset_name,
        "categories": sample.categories,
        **sample.fields,
        "scores": scores,
        "stats": {
            "mode": options.mode,
            "forward_passes": passes,
            "objects": objects,
            "capped": capped,
            "wall_s": wall_s,
        },
        "settings": options.settings(),
    }
    if errors:
        line["error"] = "; ".join(errors)
    return line


def predict(model, bench: Benchmark, path: Path, options: RunOptions, progress: bool = False) -> int:
    """Answer every sample of `bench` not yet in `path` (appended, one fsynced line per sample).

    Returns the number of samples answered now. Requests go through one engine, all submitted at once."""
    samples = bench.samples[: options.limit]
    done, _ = resume_lines(path, bench, options.settings())
    todo = [s for s in samples if s.index not in done]
    engine = model.engine(options.max_rows)
    asked = {s.index: queries(s, options.gui_task) for s in todo}
    outcomes: dict[int, list] = {i: [None] * len(q) for i, q in asked.items()}
    for s in todo:
        for k, q in enumerate(asked[s.index]):
            request = Request(
                bench.image(s),
                q.query,
                task=q.task,
                mode=options.mode,
                max_tokens=options.max_tokens,
                sampling=options.sampling,
                rendering=options.rendering,
                orientation=options.orientation,
                max_image_tokens=options.max_image_tokens,
                joint=not options.split_categories,
                tag=(s.index, k),
            )
            engine.submit(request)
    total = len(samples)
    with (
        path.open("a", encoding="utf-8") as f,
        tqdm(total=total, initial=total - len(todo), disable=not progress, unit="sample") as bar,
    ):
        bar.set_description(f"{bench.name} {options.mode}")
        last = time.perf_counter()
        while not engine.idle:
            for event in engine.step():
                if event.kind not in (EventKind.DONE, EventKind.ERROR):
                    continue
                i, k = event.handle.request.tag
                outcomes[i][k] = event.result if event.kind == EventKind.DONE else event.error
                if any(o is None for o in outcomes[i]):
                    continue
                now = time.perf_counter()
                line = answer_line(bench.samples[i], asked[i], outcomes.pop(i), options, now - last)
                last = now
                f.write(json.dumps(line) + "\n")
                f.flush()
                os.fsync(f.fileno())
                bar.update()
    return len(todo)


def answer_path(out: Path, bench: Benchmark, mode: str) -> Path:
    return out / f"{bench.name}_{mode}.jsonl"


def check_answer_files(out: Path, benches: list[Benchmark], modes: list[str], options: RunOptions) -> list[str]:
    """Refuse an answer file under `out` of another benchmark or made with other settings (before a model is
    loaded); the notes for files whose lines do not record every setting (an earlier version's)."""
    notes = []
    for bench in benches:
        for mode in modes:
            path = answer_path(out, bench, mode)
            _, unrecorded = resume_lines(path, bench, replace(options, mode=mode).settings())
            if unrecorded:
                notes.append(jsonl.unrecorded_note(unrecorded, path))
    return notes


def evaluate(
    model,
    benches: list[Benchmark],
    out: Path,
    modes: list[str],
    options: RunOptions,
    progress: bool = False,
    overwrite: bool = False,
) -> tuple[list[Row], list[dict]]:
    """Answer every benchmark in every mode (continuing the answer files under `out`, or with `overwrite`
    answering again from the start) and score the answers."""
    out.mkdir(parents=True, exist_ok=True)
    rows, sources = [], []
    for bench in benches:
        for mode in modes:
            path = answer_path(out, bench, mode)
            if overwrite:
                path.unlink(missing_ok=True)
            predict(model, bench, path, replace(options, mode=mode), progress)
            lines = read_answers(path)
            rows += score_lines(lines, mode, bench.coco)
            sources.append({"file": str(path), "mode": mode, "lines": len(lines), "data": bench.name})
    return rows, sources
