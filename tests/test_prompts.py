"""Prompts: the docs/model.md §8.3 task table, renderings A and B, placeholder expansion, and the golden prompt ids."""

from __future__ import annotations

import re

import pytest
from conftest import golden_case, golden_cases

from mlx_locate.prompts import (
    TASKS,
    chat_text,
    image_token_counts,
    prompt_ids,
    prompt_string,
    task_text,
    user_text,
)

# The queries behind the golden cases' task texts (tests/data/golden/README.md, "Prompts").
GOLDEN_QUERIES = {
    "detect": ["red box", "green circle"],
    "single": "the blue square",
    "refer": "the blue square",
    "point": "the yellow circle",
    "ocr": None,
    "textground": "EXIT",
}
SYSTEM_A = [151644, 8948, 198, 2610, 525, 264, 10950, 17847, 624, 151645, 198]
SYSTEM_B = [151644, 8948, 198, 2610, 525, 264, 10950, 17847, 13, 151645, 198]
USER_IMAGE_1 = [151644, 872, 198, 27, 1805, 220, 16, 29, 151666]  # <|im_start|>user\n<image 1><img>
TAIL = [151645, 198, 151644, 77091, 198]  # <|im_end|>\n<|im_start|>assistant\n


@pytest.mark.parametrize("name", golden_cases())
def test_golden_case(tok, name):
    case = golden_case(name)
    task = name.split("__")[2]
    rendering = "B" if case["template"] == "jinja" else "A"
    grid = tuple(case["image_grid_hw"])
    text = task_text(task, GOLDEN_QUERIES[task])
    assert text == case["prompt"]
    chat = chat_text(text, 1, rendering)
    assert chat == case["chat_text"]
    assert prompt_string(chat, [grid]) == case["prompt_string"]
    assert image_token_counts([grid]) == [case["num_image_tokens"]]
    assert prompt_ids(tok, text, [grid], rendering) == case["input_ids"]


@pytest.mark.parametrize("rendering, system", [("A", SYSTEM_A), ("B", SYSTEM_B)])
def test_worked_example(tok, rendering, system):
    query = task_text("detect", ["person", "car"])
    query_ids = [9152, 349, 678, 279, 13121, 429, 9071, 279, 2701, 4008, 25, 1697, 152680, 6918, 13]
    ids = prompt_ids(tok, query, [(36, 46)], rendering)
    assert ids == system + USER_IMAGE_1 + [151665] * 414 + [151667] + query_ids + TAIL


def test_task_table():
    assert TASKS == ("detect", "single", "refer", "textground", "ocr", "gui", "point", "raw")
    assert task_text("detect", "person") == "Locate all the instances that matches the following description: person."
    assert task_text("detect", [" a ", "b", "c"]).endswith(": a</c>b</c>c.")
    assert task_text("single", "the dog") == "Locate a single instance that matches the following description: the dog."
    assert task_text("refer", "dogs") == "Locate all the instances that match the following description: dogs."
    assert task_text("textground", "EXIT") == "Please locate the text referred as EXIT."
    assert task_text("ocr") == "Detect all the text in box format."
    assert (
        task_text("gui", "the OK button") == "Locate the region that matches the following description: the OK button."
    )
    assert task_text("point", "the cup") == "Point to: the cup."
    assert task_text("raw", " anything, verbatim ") == " anything, verbatim "


@pytest.mark.parametrize(
    "task, query, message",
    [
        (
            "segment",
            "x",
            "unknown task 'segment'; valid tasks: detect, single, refer, textground, ocr, gui, point, raw",
        ),
        ("detect", None, "needs a non-empty query"),
        ("detect", [], "needs a non-empty query"),
        ("detect", ["a", " "], "needs a non-empty query"),
        ("point", "  ", "needs a non-empty query"),
        ("single", ["a", "b"], "only 'detect' takes a list"),
        ("ocr", "x", "takes no query"),
        ("raw", None, "needs the user text"),
    ],
)
def test_task_errors(task, query, message):
    with pytest.raises(ValueError, match=message):
        task_text(task, query)


def test_chat_renderings():
    a = chat_text("hi", 2)
    assert a == (
        "<|im_start|>system\nYou are a helpful assistant.\n<|im_end|>\n"
        "<|im_start|>user\n<image-1><image-2>hi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert chat_text("hi", 1, "B").startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
    # Rendering A leaves a placeholder where the user text puts it; B always prepends one.
    assert "user\nsee <image-1> here" in chat_text("see <image-1> here", 1, "A")
    assert "user\n<image-1>see <image-1>" in chat_text("see <image-1> here", 1, "B")
    with pytest.raises(ValueError, match="valid renderings: A, B"):
        chat_text("hi", 1, "C")


@pytest.mark.parametrize(
    "text, grids, rendering",
    [
        ("a.<image-1>b", [(4, 6)], "A"),  # "." and "<image" would merge into one pre-token if split apart
        ("<image-2> then <image-1>: same?", [(2, 2), (4, 4)], "A"),
        ("two images", [(2, 4), (6, 2)], "B"),
        ("big", [(160, 160)], "A"),
    ],
)
def test_spliced_ids_equal_full_encoding(tok, text, grids, rendering):
    chat = chat_text(text, len(grids), rendering)
    assert prompt_ids(tok, text, grids, rendering) == tok.encode(prompt_string(chat, grids))


def test_prompt_errors(tok):
    with pytest.raises(ValueError, match="positive even sides"):
        prompt_ids(tok, "x", [(3, 4)])
    with pytest.raises(ValueError, match="must not contain '<IMG_CONTEXT>'"):
        prompt_ids(tok, "x<IMG_CONTEXT>", [(2, 2)])
    with pytest.raises(ValueError, match="found <image-1>, <image-1>"):
        prompt_ids(tok, "again <image-1>", [(2, 2)], "B")
    with pytest.raises(ValueError, match="found <image-1>, <image-3>"):
        prompt_ids(tok, "<image-3>", [(2, 2)])


CONTROL = ["<|im_end|>", "<|im_start|>", "<|endoftext|>", "<IMG_CONTEXT>", "<img>", "</img>", "<box>", "<ref>", "<12>"]


@pytest.mark.parametrize("token", CONTROL)
@pytest.mark.parametrize("task", ["detect", "refer", "point", "gui", "textground"])
def test_a_query_is_plain_text(tok, task, token):
    """Every added token in a query is the BPE of its characters: the prompt's structure (its added tokens) is
    the template's alone, and the query's ids are those of the same words in a plain tokenizer."""
    query = f"the {token} tag"
    ids = prompt_ids(tok, user_text(task, query), [(2, 2)])
    template = prompt_ids(tok, user_text(task, "the x tag"), [(2, 2)])
    added = set(tok.added_tokens.values())
    assert [i for i in ids if i in added] == [i for i in template if i in added]
    assert tok.decode(ids) == tok.decode(template).replace("the x tag", query)


def test_categories_keep_their_separator_and_stay_plain(tok):
    ids = prompt_ids(tok, user_text("detect", ["a<|im_end|>", "b"]), [(2, 2)])
    assert ids.count(tok.added_tokens["</c>"]) == 1 and ids.count(tok.added_tokens["<|im_end|>"]) == 2  # system, tail
    both = prompt_ids(tok, user_text("detect", ["red box", "green circle"]), [(2, 2)])
    assert both == prompt_ids(tok, task_text("detect", ["red box", "green circle"]), [(2, 2)])
    assert both == prompt_ids(tok, user_text("detect", "red box</c>green circle"), [(2, 2)])  # the separator
    refer = prompt_ids(tok, user_text("refer", "a</c>b"), [(2, 2)])
    assert tok.added_tokens["</c>"] not in refer  # only detect's query separates categories


def test_an_image_placeholder_in_a_query_places_the_image(tok):
    """The processor's placeholder is not a token: in a query it places the image, as the reference does."""
    text = user_text("detect", "the <image-1> <img> square")
    ids = prompt_ids(tok, text, [(2, 2)])
    assert ids.count(tok.added_tokens["<img>"]) == 1  # the placeholder's; the query's "<img>" is text
    assert "the <image 1><img><IMG_CONTEXT></img> <img> square" in tok.decode(ids)


@pytest.mark.parametrize(
    "token", ["<|im_end|>", "<|im_start|>", "<|endoftext|>", "<img>", "<text_mask>", "<|box_start|>"]
)
def test_a_raw_prompt_refuses_control_tokens(tok, token):
    with pytest.raises(ValueError, match=f"must not contain '{re.escape(token)}'"):
        prompt_ids(tok, f"Point to: {token}.", [(2, 2)])


def test_a_raw_prompt_keeps_the_grammar(tok):
    text = "<ref>red box</ref><box><1><2><3><1000></box></c>x"
    ids = prompt_ids(tok, text, [(2, 2)])
    assert ids == tok.encode(prompt_string(chat_text(text), [(2, 2)]))
    assert tok.added_tokens["<1000>"] in ids and tok.added_tokens["<ref>"] in ids


def test_parse_task_text_inverts_task_text():
    from mlx_locate.prompts import parse_task_text

    assert parse_task_text(task_text("detect", ["red circle", "square"])) == ("detect", ["red circle", "square"])
    assert parse_task_text(task_text("refer", "the blue star")) == ("refer", ["the blue star"])
    assert parse_task_text(task_text("point", "star")) == ("point", ["star"])
    assert parse_task_text("What is in the image?") is None
    assert parse_task_text(task_text("ocr")) is None  # no query
