"""Several categories in one request (`mlx_locate.categories`): one row per category by default, equal to asking
each category alone; the joint prompt on request; bad lists refused before decoding; many categories queued
within the memory budget; the command-line and folder forms."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import mlx.core as mx
import pytest
from conftest import approx_tree

import mlx_locate
from mlx_locate import memory
from mlx_locate.categories import category_names
from mlx_locate.commands import exports
from mlx_locate.commands import locate as generate
from mlx_locate.commands.folders import Question
from mlx_locate.request import Request, RequestError
from mlx_locate.synthetic.scenes import SHAPES, make_sample
from mlx_locate.weights.cards import COCO_CATEGORIES
from mlx_locate.weights.checkpoint import DEMO_DIR

IMAGE = str(DEMO_DIR / "example.png")


@pytest.fixture(scope="module")
def demo():
    return mlx_locate.load("demo")


def scene(i: int):
    return make_sample(0, 200 + i, "eval").scene.image


@pytest.mark.parametrize("mode", ["slow", "fast", "hybrid"])
def test_split_equals_each_category_asked_alone(demo, mode):
    """Object for object (label, box, confidence), ids and probabilities: the split request's rows are the
    single-category requests, decoded in one batch; objects in the order the categories were asked."""
    categories = ["star", "circle", "square", "triangle", "diamond"]
    for i in range(2):
        image = scene(i)
        split = demo.locate(image, categories=categories, mode=mode)
        alone = demo.locate(image, [[c] for c in categories], mode=mode)
        expected = [dataclasses.replace(o, label=c) for c, r in zip(categories, alone, strict=True) for o in r.objects]
        assert [o.label for o in split.objects] == [o.label for o in expected]
        assert [o.box for o in split.objects] == [o.box for o in expected]
        assert [o.confidence for o in split.objects] == approx_tree([o.confidence for o in expected])
        assert split.token_ids == [t for r in alone for t in r.token_ids]
        assert split.empty_labels == [c for c, r in zip(categories, alone, strict=True) if not r.objects]
        assert [c["category"] for c in split.stats["categories"]] == categories
        assert split.stats["steps"] == max(r.stats["steps"] for r in alone)
        assert split.stats["row_steps"] == sum(r.stats["steps"] for r in alone)


def test_every_form_of_a_category_list_splits_the_same(demo):
    """`categories=`, a query list, the `</c>` string and a session's list give one result, labels as spelled."""
    image = scene(0)
    names = ["circle", "square", "triangle"]
    a = demo.locate(image, categories=names, mode="fast")
    b = demo.locate(image, [names], mode="fast")[0]
    c = demo.locate(image, "circle</c> square</c>triangle", mode="fast")
    d = demo.session(image).locate(names, mode="fast")
    for r in (b, c, d):
        assert r.objects == a.objects and r.empty_labels == a.empty_labels
    assert {o.label for o in a.objects} <= set(names)


def test_joint_and_strict_keep_the_reference_prompt(demo):
    """`joint=True` and `strict=True` decode one prompt with the categories joined by `</c>`: its prompt ids
    and one row's tokens, as a raw prompt of the same text gives."""
    image = scene(1)
    sep = demo.runtime.token_ids.cat_sep
    for options in ({"joint": True}, {"strict": True}):
        r = demo.locate(image, categories=["circle", "square"], mode="slow", **options)
        assert r.prompt_ids.count(sep) == 1 and "categories" not in r.stats
        raw = demo.locate(
            image,
            task="raw",
            prompt="Locate all the instances that matches the following description: circle</c>square.",
            mode="slow",
            **options,
        )
        assert r.token_ids == raw.token_ids and r.prompt_ids == raw.prompt_ids
    split = demo.locate(image, categories=["circle", "square"], mode="slow")
    assert split.prompt_ids == [] and len(split.stats["categories"]) == 2


@pytest.mark.parametrize(
    ("categories", "message"),
    [
        (["circle", " "], "category 2 of 2 is empty"),
        (["circle", "square</c>star"], "holds '</c>'"),
        (["circle<|im_end|>", "square"], "holds '<|im_end|>'"),
        (["<ref>circle", "square"], "holds '<ref>'"),
        (["circle", "<image-1>"], "holds '<image-1>'"),
        (["<box>"], "holds '<box>'"),  # one category is checked as several are
        (["square<|im_end|>"], "holds '<|im_end|>'"),
        ([" "], "category 1 of 1 is empty"),
        ([], "categories must be a non-empty list"),
        ("circle", "non-empty list"),
    ],
)
def test_a_bad_category_list_is_refused_before_any_decoding(demo, monkeypatch, categories, message):
    def no_vision(*args, **kwargs):
        raise AssertionError("vision ran for a refused request")

    monkeypatch.setattr(demo.runtime, "features_for", no_vision)
    with pytest.raises(RequestError, match=message):
        demo.locate(IMAGE, categories=categories)


def test_a_list_query_of_one_category_is_checked_as_a_category_list(demo):
    """Every entry point's list query (`Request.query`) is a category list whatever its length."""
    (error,) = demo.locate_many([Request(IMAGE, ["<box>"])])
    assert isinstance(error, RequestError) and "holds '<box>'" in str(error)
    with pytest.raises(RequestError, match="holds '<ref>'"):
        demo.session(IMAGE).locate(["<ref>square"])


def test_repeated_categories_merge_with_a_warning(demo):
    with pytest.warns(UserWarning, match="repeated categories merged: circle"):
        assert category_names(["circle", "square", " circle"]) == ["circle", "square"]
    with pytest.warns(UserWarning, match="merged"):
        r = demo.locate(scene(0), categories=["circle", "circle"], mode="fast")
    assert r.prompt_ids.count(demo.runtime.token_ids.cat_sep) == 0  # one category left: one row, its own prompt
    assert category_names(["circle", "circle"], merge=False) == ["circle", "circle"]


def test_more_categories_than_rows_are_queued_not_refused(demo):
    """Seven categories through an engine of two rows: every category answered, as with rows for all."""
    names = list(SHAPES) + ["ring", "heart"]
    engine = demo.engine(2)
    handle = engine.submit(Request(scene(2), names, mode="fast", max_tokens=32))
    most = 0
    while not engine.idle:
        engine.step()
        most = max(most, engine.active)
    assert most == 2
    roomy = demo.locate_many([Request(scene(2), names, mode="fast", max_tokens=32)], max_rows=8)[0]
    assert handle.result.objects == roomy.objects and handle.result.empty_labels == roomy.empty_labels


@pytest.mark.slow
def test_eighty_coco_categories_run_within_a_memory_limit(demo, monkeypatch):
    """80 COCO names on one image with MLX's memory limit set so the KV budget holds the cache of four rows:
    the engine (asked for 16) never holds more, the peak stays under the limit, and every category is answered
    with the answer it has without the limit."""
    runtime = demo.runtime
    names = list(COCO_CATEGORIES)
    assert len(names) == 80
    request = Request(IMAGE, names, mode="fast", max_tokens=16)

    def run(rows):
        engine = demo.engine(rows)
        handle = engine.submit(request)
        most = 0
        while not engine.idle:
            engine.step()
            most = max(most, engine.active)
        return most, handle.result

    longest = max(len(runtime.prompt(n, (16, 16))) for n in names) + 16 + 12
    kv = 5 * memory.kv_bucket(longest) * runtime.budget.slot_bytes  # four rows and the scratch row
    limit = mx.get_active_memory() + memory.RESERVE + memory.MIN_WORKING + kv
    before = mx.set_memory_limit(limit)
    mx.reset_peak_memory()
    try:
        monkeypatch.setattr(runtime, "budget", memory.Budget.measure(runtime.network))
        most, tight = run(16)
        peak = mx.get_peak_memory()
    finally:
        mx.set_memory_limit(before)
    assert 1 < most <= 4
    assert peak <= limit
    assert [c["category"] for c in tight.stats["categories"]] == names
    monkeypatch.undo()
    _, free = run(16)
    assert tight.objects == free.objects and tight.empty_labels == free.empty_labels


# --- the command line and folders ---


def test_cli_categories_file_and_its_errors(tmp_path, capsys):
    listed = tmp_path / "classes.txt"
    listed.write_text("circle\n\nsquare\ncircle\n", encoding="utf-8")
    assert generate.main(["--image", IMAGE, "--categories-file", str(listed), "--mode", "fast"]) == 0
    out, err = capsys.readouterr()
    assert "repeated categories merged: circle" in err
    labels = [line.split()[0] for line in out.splitlines()[:-1]]
    assert labels and set(labels) <= {"circle", "square"} and labels == sorted(labels, key=["circle", "square"].index)

    (tmp_path / "empty.txt").write_text("\n \n", encoding="utf-8")
    for path, message in ((tmp_path / "empty.txt", "is empty"), (tmp_path / "none.txt", "no such file")):
        assert generate.main(["--image", IMAGE, "--categories-file", str(path)]) == 2
        assert message in capsys.readouterr().err
    assert generate.main(["--image", IMAGE, "--categories", "circle,,square"]) == 2
    assert "category 2 of 3 is empty" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        generate.main(["--image", IMAGE, "--query", "circle", "--joint-categories"])
    assert "--joint-categories only applies" in capsys.readouterr().err


def test_coco_ids_of_a_split_question_follow_its_categories():
    """A folder's COCO results: each category of a `</c>` question its own id, after the questions before it."""
    questions = [Question("detect", "star"), Question("detect", "circle</c>square")]
    assert [n for q in questions for n in q.names()] == ["star", "circle", "square"]
    box = {"box": [0, 0, 2, 2], "confidence": 0.5}
    line = {
        "image": "a.png",
        "size": [4, 4],
        "results": [
            {"task": "detect", "query": "star", "objects": [{**box, "label": "star"}]},
            {
                "task": "detect",
                "query": "circle</c>square",
                "objects": [{**box, "label": "square"}, {**box, "label": "circle"}, {**box, "label": "ring"}],
            },
        ],
    }
    ds = exports.dataset([line], {"a.png": 1}, [q.names() for q in questions], Path("."))
    assert [d["category_id"] for d in exports.coco_results(ds)] == [1, 3, 2]  # "ring" is none of them
    assert ds.categories == ["star", "circle", "square"]


def test_split_with_tiles_equals_each_category_tiled_alone(demo):
    image, names = scene(3), ["circle", "square", "triangle"]
    split = demo.locate(image, categories=names, mode="fast", tiles=(1, 2))
    alone = demo.locate(image, [[c] for c in names], mode="fast", tiles=(1, 2))
    assert split.objects == [
        dataclasses.replace(o, label=c) for c, r in zip(names, alone, strict=True) for o in r.objects
    ]


def test_merged_rows_carry_the_asked_names_whatever_the_model_wrote():
    """A row's objects take its category's name (the model may write another spelling); a row without objects
    is the category's `<box>None</box>`; counts sum, steps are the longest row's."""
    from mlx_locate.categories import merge_categories
    from mlx_locate.parse import LocatedObject
    from mlx_locate.request import Result

    def row(labels, steps):
        objects = [LocatedObject(label, (1.0, 2.0, 3.0, 4.0), (1, 2, 3, 4), None, None, 0.5) for label in labels]
        stats = {"steps": steps, "tokens": 3, "decode_s": 0.1 * steps, "stop_reason": "im_end"}
        return Result(objects, [], "", [], [7] * steps, [0.5] * steps, [2, 2], (10, 10), "fast", False, stats)

    merged = merge_categories(["Red Car", "dog"], [row(["red car", "cars"], 4), row([], 2)])
    assert [o.label for o in merged.objects] == ["Red Car", "Red Car"] and merged.empty_labels == ["dog"]
    assert (
        merged.text == "<ref>Red Car</ref><box><1><2><3><4></box><box><1><2><3><4></box><ref>dog</ref><box>None</box>"
    )
    assert (merged.stats["steps"], merged.stats["row_steps"], merged.stats["tokens"]) == (4, 6, 6)
    assert merged.stats["decode_s"] == pytest.approx(0.4)
