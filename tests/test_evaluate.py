"""`mlx-locate-eval` end to end: the synthetic benchmark exported in each input format, the demo model run
through the CLI in all three modes, answer files, resuming, scoring without a model, the COCO library's own
numbers as the cross-check, the report and comparing runs."""

import io
import json
import shutil
from contextlib import redirect_stdout

import faster_coco_eval
import numpy as np
import pytest

from mlx_locate import RequestError, load, metrics
from mlx_locate.commands import evaluate as predict_cli
from mlx_locate.commands.evaluate import main
from mlx_locate.evaluation import formats, predict, score, synthetic
from mlx_locate.evaluation.report import REPORT_FILES
from mlx_locate.parse import LocatedObject
from mlx_locate.synthetic.scenes import make_sample

N_SCENES = 6
MODES = ("slow", "fast", "hybrid")
DATA = ("synthetic.jsonl", "synthetic_coco.json", "synthetic_screenspot.json")
DATASETS = {
    "common_object_detection_Synthetic",
    "referring_object_detection_Synthetic",
    "pointing_Synthetic",
    "common_object_detection_synthetic_coco",
    "gui_synthetic_screenspot",
}


def run_main(argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with redirect_stdout(out):
        code = main(argv)
    return code, out.getvalue()


def data_args(bench, names=DATA) -> list[str]:
    return [arg for name in names for arg in ("--data", str(bench / name))]


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bench")
    synthetic.export_benchmark(folder, N_SCENES)
    return folder


@pytest.fixture(scope="module")
def run(bench, tmp_path_factory):
    """The demo model on every exported format in all three modes: (out folder, printed table)."""
    out = tmp_path_factory.mktemp("run")
    code, printed = run_main([*data_args(bench), "--modes", *MODES, "--out", str(out)])
    assert code == 0
    return out, printed


def test_export_writes_the_benchmark_in_each_format(bench):
    jsonl = formats.load_benchmark(bench / "synthetic.jsonl")
    coco = formats.load_benchmark(bench / "synthetic_coco.json")
    gui = formats.load_benchmark(bench / "synthetic_screenspot.json")
    assert (jsonl.kind, coco.kind, gui.kind) == ("jsonl", "coco", "screenspot")
    assert {s.task_name for s in jsonl.samples} == {"common_object_detection", "pointing", "referring_object_detection"}
    for s in jsonl.samples:
        sample = make_sample(0, s.index, "eval")
        assert s.image_path == f"images/{s.index:05d}.png" and (bench / s.image_path).is_file()
        if s.task_name == "pointing":  # masks: the shape's pixels, inside its box
            regions = formats.decode_regions(s.gt)[s.categories[0]]
            assert len(regions) == len(sample.task.targets)
            for mask, t in zip(regions, sample.task.targets, strict=True):
                x1, y1, x2, y2 = t.box
                assert mask[y1:y2, x1:x2].sum() == mask.sum() > 0.4 * (x2 - x1) * (y2 - y1)
        else:
            assert sorted(b for v in s.gt.values() for b in v) == sorted(list(t.box) for t in sample.task.targets)
    assert len(coco.coco["images"]) == N_SCENES and coco.samples[0].task_name == "common_object_detection"
    assert all(set(s.fields) == set(formats.GUI_FIELDS) and len(s.gt) == 4 for s in gui.samples)
    with pytest.raises(ValueError, match="--overwrite"):
        synthetic.export_benchmark(bench, 1)


@pytest.mark.slow  # every dataset in every mode
def test_cli_reports_every_dataset_in_every_mode(run):
    out, printed = run
    report = json.loads((out / "report.json").read_text())
    rows = {(r["dataset"], r["mode"]): r for r in report["rows"]}
    assert set(rows) == {(d, m) for d in DATASETS for m in MODES}
    assert (out / "report.md").read_text().strip() == printed.strip()
    assert printed.startswith("| dataset | mode | n | F1@0.5 | F1@0.95 | F1@mean |")
    assert (
        "F1@0.5 by object size and by GT count" in printed
        and "gui_synthetic_screenspot (hybrid), accuracy by type" in printed
    )
    assert (out / "f1_vs_iou.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for (dataset, mode), r in rows.items():
        assert r["s_per_image"] > 0 and r["boxes_per_s"] >= 0, (dataset, mode)
    for mode in MODES:
        coco = rows[("common_object_detection_synthetic_coco", mode)]
        assert coco["metric"] == "coco" and coco["f1_50"] >= 0.8 and 0 < coco["map"] <= 1
        assert coco["f1_mean"] <= coco["f1_50"] and coco["sample_f1"]["f1@0.5"] >= 0.8
        det = rows[("common_object_detection_Synthetic", mode)]
        assert det["f1_mean"] == pytest.approx(np.mean(list(det["f1"].values())))
        assert set(det["breakdown"]) == {"by_size", "by_gt_count"}
        assert 0 <= rows[("pointing_Synthetic", mode)]["pointing"]["f1"] <= 1
        gui = rows[("gui_synthetic_screenspot", mode)]
        assert gui["accuracy"] == pytest.approx(np.mean([v["accuracy"] for v in gui["breakdown"]["by_group"].values()]))
    # Block modes take fewer forward passes per box than token-by-token decoding.
    slow = rows[("common_object_detection_synthetic_coco", "slow")]["passes_per_box"]
    assert rows[("common_object_detection_synthetic_coco", "fast")]["passes_per_box"] < slow / 2


TIMINGS = ("boxes_per_s", "s_per_image")  # wall-clock figures: the only ones two runs may differ in


@pytest.mark.slow  # every dataset in every mode
def test_the_synthetic_source_scores_as_its_exported_files(run, tmp_path):
    """`--synthetic N` (scenes in memory) gives the rows and answers of `--export` + `--data` on the same scenes,
    and names the COCO instances of its answers for `--predictions`."""
    out, _ = run
    code, _ = run_main(["--synthetic", str(N_SCENES), "--out", str(tmp_path / "mem")])
    assert code == 0
    report = json.loads((tmp_path / "mem" / "report.json").read_text())
    assert report["synthetic"] == {"n": N_SCENES, "seed": 0}
    files = {(r["dataset"], r["mode"]): r for r in json.loads((out / "report.json").read_text())["rows"]}
    assert {(r["dataset"], r["mode"]) for r in report["rows"]} == {(d, "hybrid") for d in DATASETS}
    for r in report["rows"]:
        expected = files[(r["dataset"], r["mode"])]
        assert {k: v for k, v in r.items() if k not in TIMINGS} == {
            k: v for k, v in expected.items() if k not in TIMINGS
        }, r["dataset"]
    for name in DATA:
        stem = name.split(".")[0]
        mine, theirs = (formats.read_answers(folder / f"{stem}_hybrid.jsonl") for folder in (tmp_path / "mem", out))
        for a, b in zip(mine, theirs, strict=True):
            del a["stats"]["wall_s"], b["stats"]["wall_s"]
        assert mine == theirs
    answers = str(tmp_path / "mem" / "synthetic_coco_hybrid.jsonl")
    code, printed = run_main(["--predictions", answers, "--synthetic", str(N_SCENES)])
    assert code == 0 and "common_object_detection_synthetic_coco (COCO path) | hybrid" in printed


def test_requests_at_the_token_cap_are_counted(tmp_path):
    code, printed = run_main(["--synthetic", "2", "--max-tokens", "4", "--out", str(tmp_path), "--no-progress"])
    assert code == 0
    rows = {r["dataset"]: r for r in json.loads((tmp_path / "report.json").read_text())["rows"]}
    coco = rows["common_object_detection_synthetic_coco"]  # every scene has shapes: no answer fits in 4 tokens
    assert coco["capped"] == coco["samples"] == 2 and rows["pointing_Synthetic"]["capped"] == 0  # it said None
    assert "requests stopped at the --max-tokens cap" in printed


def located(label: str | None, box: list[int]) -> LocatedObject:
    return LocatedObject(label, None, tuple(box), None, None, None)


def test_located_objects_are_scored_by_the_paper_rules():
    """Per sample, averaged (not pooled): a detection box may match another asked label's GT, a label nobody
    asked for is a false positive, referring pools the labels; a sample with no box on either side is left out."""
    a, b = [0, 0, 100, 100], [500, 500, 600, 600]
    pairs = [
        ([located("cat", a), located("dog", b)], [located("dog", a), located("cow", b)]),
        ([located("cat", a)], [located("cat", [0, 0, 100, 30])]),  # IoU 0.3
        ([], []),
        ([located("cat", a)], [located("cat", [100, 100, 0, 0])]),  # corners in any order
        ([], [located("cat", b)]),  # a box where the truth has none: P = R = 0
    ]
    # Detection: sample 1 matches 1 of 2 (the cow box is unasked), P = R = 1/2; sample 2: 0; 4: 1; 5: 0.
    # Referring: sample 1 matches both.
    scores = score.located_f1(pairs)
    assert (scores.f1, scores.box_f1, scores.pred, scores.gt) == (pytest.approx(1.5 / 4), pytest.approx(2 / 4), 5, 4)
    lines = [
        {"gt": {"cat": [a], "dog": [b]}, "extracted_predictions": {"dog": [a], "cow": [b]}},
        {"gt": {"cat": [a]}, "extracted_predictions": {"cat": [[0, 0, 100, 30]]}},
        {"gt": {"cat": [a]}, "extracted_predictions": {"cat": [a]}},
        {"gt": {}, "extracted_predictions": {"cat": [b]}},
    ]
    (row,) = score.score_lines([{**ln, "task_name": score.DETECTION, "dataset_name": "x"} for ln in lines], "m")
    assert scores.f1 == row.f1_50
    assert score.located_f1([([], [])]) == score.LocatedF1(None, None, 0, 0)


@pytest.fixture(scope="module")
def model():
    return load("demo")


@pytest.mark.slow  # reads the every-dataset run
def test_answer_lines_are_the_single_request_answers(run, bench, model):
    out, _ = run
    answers = formats.read_answers(out / "synthetic_hybrid.jsonl") + formats.read_answers(
        out / "synthetic_screenspot_hybrid.jsonl"
    )
    assert all(set(formats.GUI_FIELDS) <= set(a) for a in answers[N_SCENES:])
    for a in answers[:3] + answers[N_SCENES:][:1]:
        for key in (
            "image_path",
            "question",
            "raw_response",
            "extracted_predictions",
            "gt",
            "task_name",
            "dataset_name",
        ):
            assert key in a
        if a["task_name"] == "pointing":
            assert all("counts" in rle for v in a["gt"].values() for rle in v)  # masks, no gt_mask wrapper
        task = {"common_object_detection": "detect", "referring_object_detection": "refer"}.get(a["task_name"], "point")
        query = "</c>".join(a["categories"])
        result = model.locate(
            bench / a["image_path"], query, task=task, mode="hybrid", max_tokens=predict.DEFAULT_MAX_TOKENS
        )
        expected: dict[str, list] = {}
        for o in result.objects:
            key = o.label if task == "detect" else query
            expected.setdefault(key, []).append(list(o.box if o.box is not None else o.point))
        assert a["extracted_predictions"] == expected and a["raw_response"] == result.text
        assert a["stats"]["forward_passes"] == result.stats["steps"]


def library_pr(coco: dict, results: list[dict]) -> dict[int, dict[float, metrics.CocoPR]]:
    """faster-coco-eval's own recall and precision at that recall, per category and threshold, from its
    accumulated arrays (area 'all', 100 detections), with the constant score."""
    gt = faster_coco_eval.COCO(coco, use_deepcopy=True)
    results = [{**r, "score": score.CONSTANT_SCORE} for r in results]
    e = faster_coco_eval.COCOeval_faster(gt, gt.loadRes(results), iouType="bbox", print_function=lambda *a: None)
    e.run()
    precision, recall = e.eval["precision"], e.eval["recall"]  # (T, R, K, A, M), (T, K, A, M)
    out = {}
    for k, cat in enumerate(e.params.catIds):
        if recall[0, k, 0, -1] < 0:
            continue  # no GT
        out[int(cat)] = {}
        for ti, t in enumerate(e.params.iouThrs):
            positive = [p for p in precision[ti, :, k, 0, -1] if p > 0]
            out[int(cat)][round(float(t), 2)] = metrics.CocoPR(positive[-1] if positive else 0.0, recall[ti, k, 0, -1])
    return out


def perturbed(lines: list[dict]) -> list[dict]:
    """The answers with boxes in threes: the first shifted by 35 % of its width, the second twice, the third
    followed by such a shifted copy; plus a box of a category the image lacks (dropped, as the paper does)."""
    out = []
    for line in lines:
        preds = {}
        for category, boxes in line["extracted_predictions"].items():
            kept = []
            for k, (x1, y1, x2, y2) in enumerate(boxes):
                shifted = [x1 + 0.35 * (x2 - x1), y1, x2 + 0.35 * (x2 - x1), y2]
                kept += [[shifted], [[x1, y1, x2, y2]] * 2, [[x1, y1, x2, y2], shifted]][k % 3]
            preds[category] = kept
        preds["star"] = preds.get("star", []) + [[0, 0, 20, 20]]
        out.append({**line, "extracted_predictions": preds, "scores": {}})
    return out


def harder(coco: dict) -> list[dict]:
    """The ground truth as exported, with a crowd region over the whole image for each image's first category,
    and with a near copy of every box (shifted by a fifth of its width) listed before it."""
    images = {img["id"]: img for img in coco["images"]}
    first = {}
    for a in coco["annotations"]:
        first.setdefault(a["image_id"], a["category_id"])
    crowds = []
    for i, c in first.items():
        w, h = images[i]["width"], images[i]["height"]
        crowds.append(
            {"id": 10_000 + i, "image_id": i, "category_id": c, "iscrowd": 1, "area": w * h, "bbox": [0, 0, w, h]}
        )
    copies = [
        {**a, "id": 20_000 + a["id"], "bbox": [a["bbox"][0] + a["bbox"][2] / 5, *a["bbox"][1:]]}
        for a in coco["annotations"]
    ]
    return [
        coco,
        {**coco, "annotations": coco["annotations"] + crowds},
        {**coco, "annotations": copies + coco["annotations"]},
    ]


def test_coco_path_matches_the_coco_library(run, bench):
    out, _ = run
    lines = formats.read_answers(out / "synthetic_coco_hybrid.jsonl")
    checked = 0
    for gt, answers in (
        (gt, answers)
        for gt in harder(json.loads((bench / DATA[1]).read_text()))
        for answers in (lines, perturbed(lines))
    ):
        per_category, results, _ = score.coco_inputs(gt, answers)
        ours, theirs = score.coco_pr(per_category), library_pr(gt, results)
        assert set(ours) == set(theirs)
        for cat in ours:
            for t in metrics.IOU_THRESHOLDS:
                assert ours[cat][t].recall == pytest.approx(theirs[cat][t].recall, abs=1e-12), (cat, t)
                assert ours[cat][t].precision == pytest.approx(theirs[cat][t].precision, abs=1e-12), (cat, t)
                checked += ours[cat][t].precision not in (0.0, 1.0)
    assert checked > 10  # the perturbed answers give precisions strictly between 0 and 1


def test_resume_skips_answered_samples_and_redoes_a_cut_line(run, bench, tmp_path, capsys):
    out, _ = run
    original = (out / "synthetic_hybrid.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "synthetic_hybrid.jsonl").write_text("".join(original[:-1]) + original[-1][:40])  # cut mid-line
    code, _ = run_main([*data_args(bench, DATA[:1]), "--out", str(tmp_path)])
    assert code == 0
    resumed = (tmp_path / "synthetic_hybrid.jsonl").read_text().splitlines(keepends=True)
    assert resumed[:-1] == original[:-1]  # untouched, byte for byte (their wall seconds would differ if redone)
    last, again = json.loads(original[-1]), json.loads(resumed[-1])
    assert again["extracted_predictions"] == last["extracted_predictions"] and len(resumed) == N_SCENES
    # An answer file of another benchmark is refused before the model loads (the report is not written yet).
    for name in REPORT_FILES:
        (tmp_path / name).unlink()
    other = (out / "synthetic_screenspot_hybrid.jsonl").read_bytes() + b'{"sample_index": 9, "ima'
    (tmp_path / "synthetic_hybrid.jsonl").write_bytes(other)
    code, _ = run_main([*data_args(bench, DATA[:1]), "--out", str(tmp_path)])
    assert code == 2
    assert (tmp_path / "synthetic_hybrid.jsonl").read_bytes() == other  # checked before anything is cut
    # A last line that is no answer's start is not taken for an interrupted write.
    (tmp_path / "synthetic_hybrid.jsonl").write_bytes("".join(original[:-1]).encode() + b"garbage")
    capsys.readouterr()
    code, _ = run_main([*data_args(bench, DATA[:1]), "--out", str(tmp_path)])
    assert code == 2 and "does not end with a line of mlx-locate-eval answers" in capsys.readouterr().err


def test_answer_files_record_their_settings_and_resume_only_with_them(run, bench, tmp_path, monkeypatch, capsys):
    out, _ = run
    original = (out / "synthetic_hybrid.jsonl").read_bytes()
    (tmp_path / "synthetic_hybrid.jsonl").write_bytes(original)
    settings = json.loads(original.splitlines()[0])["settings"]
    assert settings["model"] == "demo" and settings["mode"] == "hybrid" and settings["max_tokens"] == 4096
    assert settings["sampling"]["temperature"] == 0 and "max_rows" not in settings and "limit" not in settings
    argv = [*data_args(bench, DATA[:1]), "--out", str(tmp_path)]
    with monkeypatch.context() as mp:  # other settings are refused, naming them, before the model loads
        mp.setattr(predict_cli.flags, "load", lambda *a, **k: pytest.fail("a model was loaded"))
        for flags, named in (
            (["--max-tokens", "2"], "max_tokens: 4096 in the file, 2 now"),
            (["--sampling", "official"], "sampling.temperature: 0.0 in the file, 0.7 now"),
            (["--model", str(bench)], 'model: "demo" in the file, "local:'),
            (["--image-tokens", "64"], "max_image_tokens: null in the file, 64 now"),
        ):
            code, _ = run_main([*argv, *flags])
            err = capsys.readouterr().err
            assert code == 2 and "written with other settings (" in err and named in err, err
            assert "--overwrite" in err
        first = json.loads(original.splitlines()[0])  # an answer to other data (another --seed's scene)
        (tmp_path / "synthetic_hybrid.jsonl").write_text(json.dumps({**first, "gt": {"ring": []}}) + "\n")
        code, _ = run_main(argv)
        assert (
            code == 2 and f"is not an answer to synthetic (sample {first['sample_index']})" in capsys.readouterr().err
        )
        (tmp_path / "synthetic_hybrid.jsonl").write_bytes(original)
    code, _ = run_main([*argv, "--max-rows", "3", "--limit", "2"])  # these change no answer: resumed
    assert (tmp_path / "synthetic_hybrid.jsonl").read_bytes() == original

    # --overwrite answers again: as a run in a new folder does.
    code, _ = run_main([*argv, "--max-tokens", "2", "--overwrite", "--no-progress"])
    assert code == 0
    fresh = tmp_path / "fresh"
    assert run_main([*data_args(bench, DATA[:1]), "--out", str(fresh), "--max-tokens", "2"])[0] == 0
    redone, expected = (formats.read_answers(f / "synthetic_hybrid.jsonl") for f in (tmp_path, fresh))
    for line in (*redone, *expected):
        del line["stats"]["wall_s"]
    assert redone == expected and all(line["settings"]["max_tokens"] == 2 for line in redone)
    rows = [json.loads((f / "report.json").read_text())["rows"] for f in (tmp_path, fresh)]
    assert [[{k: v for k, v in r.items() if k not in TIMINGS} for r in report] for report in rows] == [
        [{k: v for k, v in r.items() if k not in TIMINGS} for r in rows[1]]
    ] * 2


def test_answer_lines_without_settings_are_resumed_with_a_note(run, bench, tmp_path, capsys):
    out, _ = run
    lines = [json.loads(line) for line in (out / "synthetic_hybrid.jsonl").read_text().splitlines()]
    for line in lines:
        del line["settings"]  # as an earlier version wrote them
    old = "".join(json.dumps(line) + "\n" for line in lines)
    (tmp_path / "synthetic_hybrid.jsonl").write_text(old)
    code, _ = run_main([*data_args(bench, DATA[:1]), "--out", str(tmp_path), "--max-tokens", "2"])
    assert code == 0 and (tmp_path / "synthetic_hybrid.jsonl").read_text() == old
    assert (
        f"note: {N_SCENES} lines of {tmp_path / 'synthetic_hybrid.jsonl'} lack settings that this version records"
        in (capsys.readouterr().err)
    )


def test_no_progress_hides_the_bar(run, bench, tmp_path, capsys):
    out, _ = run
    for flags, shown in (([], True), (["--no-progress"], False)):
        folder = tmp_path / str(shown)
        folder.mkdir()
        shutil.copy(out / "synthetic_hybrid.jsonl", folder)  # answered: resumed, nothing decoded
        code, _ = run_main([*data_args(bench, DATA[:1]), "--out", str(folder), *flags])
        assert code == 0 and ("sample" in capsys.readouterr().err) is shown


def test_predictions_are_scored_without_a_model(run, bench, tmp_path, monkeypatch):
    out, _ = run
    import mlx_locate.locate

    monkeypatch.setattr(mlx_locate.commands.flags, "load", lambda *a, **k: pytest.fail("a model was loaded"))
    # The COCO answers get the COCO path; the JSONL's detection answers on the same images do not.
    files = [str(out / f"synthetic_coco_{m}.jsonl") for m in MODES] + [str(out / "synthetic_hybrid.jsonl")]
    code, printed = run_main(["--predictions", *files, "--data", str(bench / DATA[1]), "--out", str(tmp_path)])
    assert code == 0
    rescored = json.loads((tmp_path / "report.json").read_text())["rows"]
    original = {(r["dataset"], r["mode"]): r for r in json.loads((out / "report.json").read_text())["rows"]}
    assert [r["mode"] for r in rescored[:3]] == list(MODES)  # from the lines' stats
    assert len(rescored) == 6 and rescored[3]["metric"] == "box"
    for r in rescored:
        assert r == original[(r["dataset"], r["mode"])]


def test_an_answer_file_of_another_tool(tmp_path):
    """Only the paper's fields, hand-computed scores; the no-GT sample scores 0 and the report says so."""
    box = [10.0, 10.0, 50.0, 50.0]
    common = {"image_path": "x.png", "question": "q", "raw_response": "r", "dataset_name": "Toy"}
    lines = [
        {
            **common,
            "task_name": "common_object_detection",
            "gt": {"cat": [box]},
            "extracted_predictions": {"cat": [box]},
        },
        {**common, "task_name": "common_object_detection", "gt": {"dog": []}, "extracted_predictions": {}},
        {**common, "task_name": "gui", "gt": [0, 0, 20, 20], "extracted_predictions": {"ok": [[5, 5], [None]]}},
        {**common, "task_name": "keypoint", "gt": {}, "extracted_predictions": {}},
    ]
    path = tmp_path / "answer.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    code, printed = run_main(["--predictions", str(path)])
    assert code == 0
    rows = {r.dataset: r for r in score.score_lines(formats.read_answers(path), "answer")}
    det = rows["common_object_detection_Toy"]
    assert det.f1_50 == det.f1_mean == 0.5 and det.empty_scored_zero == 1  # P = R = (1 + 0) / 2
    assert det.without_empty == {"f1@0.5": 1.0, "f1@mean": 1.0, "samples": 1}
    assert rows["gui_Toy"].accuracy == 1.0 and rows["gui_Toy"].malformed == 1
    assert rows["keypoint_Toy"].metric == "unscored"
    assert "1 samples asked for categories with no GT box and got no box: scored 0" in printed
    assert "| common_object_detection_Toy | answer | 2 | 0.500 |" in printed


def test_compare_prints_the_differences(tmp_path, capsys):
    row = {"dataset": "d", "mode": "hybrid", "metric": "box", "f1_50": 0.5, "f1_95": 0.2, "f1_mean": 0.4, "map": None}
    a = {"rows": [row, {**row, "mode": "slow"}]}
    b = {"rows": [{**row, "f1_50": 0.6, "boxes_per_s": 12.0}]}
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    assert main(["--compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 0
    printed = capsys.readouterr().out
    assert "| d | hybrid | F1@0.5 | 0.500 | 0.600 | +0.100 |" in printed
    assert "| d | hybrid | F1@0.95 | 0.200 | 0.200 | +0.000 |" in printed
    assert "| d | hybrid | boxes/s | - | 12.0 | - |" in printed
    assert "only in " + str(tmp_path / "a.json") + ": d (slow)" in printed


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--data", "missing.jsonl", "--out", "o"], "no benchmark file"),
        (["--data", "bad.jsonl", "--out", "o"], "bad.jsonl:2 is not JSON"),
        (["--data", "short.jsonl", "--out", "o"], "short.jsonl:1 lacks categories"),
        (["--data", "ok.jsonl"], "--data needs --out"),
        (["--predictions", "ok.jsonl", "--compare", "a", "b"], "give one of"),
        (["--predictions", "ok.jsonl", "--data", "ok.jsonl"], "COCO instances JSON"),
        (["--predictions", "ok.jsonl", "--out", "done"], "--overwrite"),
        (["--synthetic", "1", "--out", "ok.jsonl"], "--out ok.jsonl is a file; it needs a folder"),
        (["--export", "ok.jsonl/bench"], "--export ok.jsonl/bench lies under ok.jsonl, which is a file"),
        ([], "give one of"),
    ],
)
def test_bad_input_is_one_error_line(tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.chdir(tmp_path)
    sample = {"image_path": "x.png", "categories": ["a"], "gt": {"a": []}, "task_name": "t", "dataset_name": "d"}
    answer = {**sample, "extracted_predictions": {}}
    (tmp_path / "ok.jsonl").write_text(json.dumps(answer) + "\n")
    (tmp_path / "bad.jsonl").write_text(json.dumps(sample) + "\n{oops\n")
    (tmp_path / "short.jsonl").write_text(json.dumps({"image_path": "x.png"}) + "\n")
    (tmp_path / "done").mkdir()
    (tmp_path / "done" / "report.json").write_text("{}")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_a_failed_request_is_an_error_line_left_out_of_the_scores():
    sample = formats.BenchSample(0, "gone.png", ["cat"], {"cat": [[0, 0, 10, 10]]}, "common_object_detection", "Toy")
    asked = predict.queries(sample)
    assert asked == [predict.Query("detect", "cat", None)]
    line = predict.answer_line(sample, asked, [RequestError("cannot read gone.png")], predict.RunOptions(), 0.01)
    assert line["error"] == "cannot read gone.png" and line["extracted_predictions"] == {}
    good = {**line, "extracted_predictions": {"cat": [[0, 0, 10, 10]]}}
    del good["error"]
    (row,) = score.score_lines([line, good], "hybrid")
    assert (row.samples, row.errors, row.f1_50) == (1, 1, 1.0)
