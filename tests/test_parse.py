"""The docs/model.md §9 output parser: table tests, pixel mapping, confidences, robustness and the golden streams."""

from __future__ import annotations

import functools
import json
import math

import numpy as np
import pytest
from conftest import GOLDEN, TOKENIZER_DIR, golden_case, golden_cases

from mlx_locate.parse import AnswerParser, LocatedObject, parse_tokens, to_pixels
from mlx_locate.tokens import TokenIds, token_ids_from_config


@functools.cache
def byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode table, as byte-level BPE uses it."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


@functools.cache
def tokenizer() -> tuple[TokenIds, dict[int, str], dict[str, int]]:
    config = json.loads((GOLDEN / "checkpoints" / "tiny_random" / "config.json").read_text())
    added = json.loads((TOKENIZER_DIR / "added_tokens.json").read_text())
    vocab = json.loads((TOKENIZER_DIR / "vocab.json").read_text())
    inverse = {i: s for s, i in vocab.items()}
    inverse.update({i: s for s, i in added.items()})
    return token_ids_from_config(config, added, vocab.get), inverse, vocab


def decode(ids: list[int]) -> str:
    _, inverse, _ = tokenizer()
    to_byte = byte_decoder()
    out = bytearray()
    for i in ids:
        piece = inverse[i]  # KeyError here would mean the parser passed an id outside the vocabulary
        out += piece.encode() if piece.startswith("<") and piece.endswith(">") else bytes(to_byte[c] for c in piece)
    return out.decode("utf-8", errors="replace")


@pytest.fixture(scope="module")
def tk() -> TokenIds:
    return tokenizer()[0]


def word(text: str) -> int:
    return tokenizer()[2][text]


def seq(tk: TokenIds, *items) -> list[int]:
    """Build an id list: ints are coordinates, strings are words or the special names below."""
    names = {
        "<box>": tk.box_start,
        "</box>": tk.box_end,
        "<ref>": tk.ref_start,
        "</ref>": tk.ref_end,
        "<null>": tk.null,
        "<switch>": tk.switch,
        "<end>": tk.im_end,
        "None": tk.none,
        "none": tk.none_lower,
    }
    return [tk.coord_token(x) if isinstance(x, int) else names.get(x) or word(x) for x in items]


def parse(tk, ids, size=(1000, 1000), probs=None):
    return parse_tokens(ids, tk, decode, size, probs)


def boxes(result) -> list[tuple[str | None, tuple[int, ...]]]:
    return [(o.label, o.box_norm if o.box_norm is not None else o.point_norm) for o in result.objects]


def test_detection_repeated_labels(tk):
    ids = seq(
        tk,
        *("<ref>", "person", "</ref>", "<box>", 1, 2, 3, 4, "</box>"),
        *("<ref>", "car", "</ref>", "<box>", 5, 6, 7, 8, "</box>"),
        *("<ref>", "person", "</ref>", "<box>", 9, 10, 11, 12, "</box>", "<end>"),
    )
    result = parse(tk, ids)
    assert boxes(result) == [("person", (1, 2, 3, 4)), ("car", (5, 6, 7, 8)), ("person", (9, 10, 11, 12))]
    assert result.ended and not result.truncated and result.malformed == 0 and result.empty_labels == []
    assert all(o.point is None and o.confidence is None for o in result.objects)


def test_grounding_one_label_several_boxes(tk):
    ids = seq(
        tk,
        *("<ref>", "red", "Ġbox", "</ref>", "<box>", 10, 20, 30, 40, "</box>"),
        *("<box>", 50, 60, 70, 80, "</box>", "<box>", 0, 0, 1000, 1000, "</box>", "<end>"),
    )
    result = parse(tk, ids)
    assert boxes(result) == [
        ("red box", (10, 20, 30, 40)),
        ("red box", (50, 60, 70, 80)),
        ("red box", (0, 0, 1000, 1000)),
    ]


def test_points_without_label(tk):
    ids = seq(tk, "<box>", 500, 250, "</box>", "<null>", "<null>", "<box>", 0, 1000, "</box>", "<end>")
    result = parse(tk, ids, size=(640, 480))
    assert [(o.label, o.point_norm, o.point, o.box) for o in result.objects] == [
        (None, (500, 250), (320.0, 120.0), None),
        (None, (0, 1000), (0.0, 480.0), None),
    ]


def test_point_after_label(tk):
    ids = seq(tk, "<ref>", "car", "</ref>", "<box>", 100, 200, "</box>")
    assert boxes(parse(tk, ids)) == [("car", (100, 200))]


def test_negative_answers(tk):
    ids = seq(
        tk,
        *("<ref>", "car", "</ref>", "<box>", "None", "</box>", "<null>", "<null>", "<null>"),
        *("<ref>", "person", "</ref>", "<box>", "none", "</box>", "<box>", 1, 2, 3, 4, "</box>", "<end>"),
    )
    result = parse(tk, ids)
    assert result.empty_labels == ["car", "person"]
    assert boxes(result) == [("person", (1, 2, 3, 4))]
    assert parse(tk, seq(tk, "<box>", "None", "</box>", "<end>")).empty_labels == [None]


def test_an_inverted_box_is_ordered_in_pixels_and_kept_as_written_in_values(tk):
    ids = seq(
        tk, "<ref>", "car", "</ref>", "<box>", 600, 700, 200, 100, "</box>", "<box>", 100, 900, 300, 800, "</box>"
    )
    result = parse(tk, ids, size=(500, 200))
    assert [o.box for o in result.objects] == [(100.0, 20.0, 300.0, 140.0), (50.0, 160.0, 150.0, 180.0)]
    assert [o.box_norm for o in result.objects] == [(600, 700, 200, 100), (100, 900, 300, 800)]
    assert result.objects[0].to_dict()["box"] == (100.0, 20.0, 300.0, 140.0)


def test_malformed_boxes_skipped(tk):
    ids = seq(
        tk,
        *("<ref>", "car", "</ref>"),
        *("<box>", 1, 2, 3, "</box>"),  # 3 coordinates
        *("<box>", "</box>"),  # empty
        *("<box>", 1, 2, 3, 4, 5, "</box>"),  # 5 coordinates
        *("<box>", 1, "car", 2, "</box>"),  # text inside
        *("<box>", "None", 1, "</box>"),  # None plus a coordinate
        *("<box>", "None", "None", "</box>"),
        *("<box>", 1, 2, "<box>", 5, 6, 7, 8, "</box>"),  # unclosed, then a good box
        *("<box>", 9, "<ref>", "person", "</ref>", "<box>", 1, 1, 2, 2, "</box>"),  # unclosed before a <ref>
        *("<box>", 3, 3, 3, "<end>"),  # unclosed before <|im_end|>
    )
    result = parse(tk, ids)
    assert result.malformed == 9
    assert boxes(result) == [("car", (5, 6, 7, 8)), ("person", (1, 1, 2, 2))]
    assert result.ended and not result.truncated


def test_null_and_switch_skipped(tk):
    ids = seq(
        tk,
        *("<null>", "<switch>", "<ref>", "car", "</ref>", "<switch>", "<null>"),
        *("<box>", "<null>", 1, 2, "<switch>", 3, 4, "</box>", "<null>", "<box>", "None", "<null>", "</box>"),
    )
    result = parse(tk, ids)
    assert boxes(result) == [("car", (1, 2, 3, 4))]
    assert result.empty_labels == ["car"] and result.malformed == 0
    assert not result.ended and not result.truncated


def test_stops_at_im_end(tk):
    ids = seq(tk, "<box>", 1, 2, 3, 4, "</box>", "<end>", "<box>", 5, 6, 7, 8, "</box>", "<box>", 1)
    result = parse(tk, ids)
    assert boxes(result) == [(None, (1, 2, 3, 4))]
    assert result.ended and not result.truncated


def test_truncated_mid_item(tk):
    head = seq(tk, "<ref>", "car", "</ref>", "<box>", 1, 2, 3, 4, "</box>")
    tails = [("<box>", 5, 6, 7), ("<box>",), ("<box>", "None"), ("<ref>", "person"), ("<ref>",)]
    for tail in [*tails, ("<ref>", "person", "</ref>")]:  # the last: a label no box has followed yet
        result = parse(tk, head + seq(tk, *tail))
        assert result.truncated and not result.ended, tail
        assert boxes(result) == [("car", (1, 2, 3, 4))] and result.malformed == 0
    complete = parse(tk, head)
    assert not complete.truncated and not complete.ended
    ended = parse(tk, head + seq(tk, "<ref>", "person", "</ref>", "<end>"))  # the model's own end: not cut
    assert not ended.truncated and ended.ended


def test_label_ended_early(tk):
    early_box = parse(tk, seq(tk, "<ref>", "red", "Ġbox", "<box>", 1, 2, 3, 4, "</box>"))
    assert boxes(early_box) == [("red box", (1, 2, 3, 4))]
    early_ref = parse(tk, seq(tk, "<ref>", "car", "<ref>", "person", "</ref>", "<box>", 1, 2, 3, 4, "</box>"))
    assert boxes(early_ref) == [("person", (1, 2, 3, 4))]
    early_null = parse(tk, seq(tk, "<ref>", "car", "<null>", "<box>", 1, 2, 3, 4, "</box>"))
    assert boxes(early_null) == [("car", (1, 2, 3, 4))]
    early_end = parse(tk, seq(tk, "<ref>", "car", "<end>", "<box>", 1, 2, 3, 4, "</box>"))
    assert early_end.objects == [] and early_end.ended and not early_end.truncated


def test_label_persists_and_strips(tk):
    ids = seq(tk, "<ref>", "Ġcar", "</ref>", "<box>", 1, 2, 3, 4, "</box>", "red", "</box>", 7)
    ids += seq(tk, "<box>", 5, 6, 7, 8, "</box>", "<ref>", "</ref>", "<box>", 1, 1, 1, 1, "</box>")
    assert boxes(parse(tk, ids)) == [("car", (1, 2, 3, 4)), ("car", (5, 6, 7, 8)), ("", (1, 1, 1, 1))]


def test_pixels_use_original_size_and_clamp(tk):
    ids = seq(tk, "<box>", 0, 0, 1000, 1000, "</box>", "<box>", 250, 500, 750, 125, "</box>")
    result = parse(tk, ids, size=(640, 480))  # processed size would be 644 x 504
    assert result.objects[0].box == (0.0, 0.0, 640.0, 480.0)
    assert result.objects[1].box == (160.0, 60.0, 480.0, 240.0)  # ordered; box_norm as written
    assert result.objects[1].box_norm == (250, 500, 750, 125)
    assert to_pixels([1200, -5, 500, 1001], (100, 50)) == (100.0, 0.0, 50.0, 50.0)


def test_confidence_is_geometric_mean(tk):
    ids = seq(tk, "<ref>", "car", "</ref>", "<box>", 1, 2, 3, 4, "</box>", "<box>", 7, "<null>", 8, "</box>")
    probs = [0.01, 0.02, 0.03, 0.5, 0.9, 0.8, 0.7, 0.6, 0.95, 0.4, 0.5, 0.001, 0.6, 0.7]
    result = parse(tk, ids, probs=probs)
    box_probs = probs[3:9]
    assert result.objects[0].confidence == pytest.approx(math.prod(box_probs) ** (1 / 6), rel=1e-12)
    point_probs = [0.4, 0.5, 0.6, 0.7]  # <null> inside the box does not count
    assert result.objects[1].confidence == pytest.approx(math.prod(point_probs) ** (1 / 4), rel=1e-12)

    zero = parse(tk, ids, probs=[0.0 if i == 5 else 0.5 for i in range(len(ids))])
    assert zero.objects[0].confidence == 0.0 and zero.objects[1].confidence == pytest.approx(0.5)
    with pytest.raises(ValueError, match="token_probs"):
        parse(tk, ids, probs=probs[:-1])


def test_accepts_numpy_ids(tk):
    ids = np.array(seq(tk, "<box>", 1, 2, 3, 4, "</box>"), dtype=np.int64)
    assert boxes(parse(tk, ids)) == [(None, (1, 2, 3, 4))]


def random_ids(rng: np.random.Generator, tk: TokenIds) -> list[int]:
    """Grammar-shaped items (labels, boxes of 0-5 coordinates, None) with random tokens mixed in."""
    specials = [tk.box_start, tk.box_end, tk.ref_start, tk.ref_end, tk.im_end, tk.null, tk.switch, tk.none]
    specials += [tk.none_lower, tk.image, tk.text_mask, tk.cat_sep, tk.coord_start, tk.coord_end, word("car")]
    ids: list[int] = []
    for _ in range(int(rng.integers(0, 8))):
        item = int(rng.integers(0, 4))
        if item == 0:
            ids += [tk.ref_start, *rng.integers(0, 151643, size=int(rng.integers(0, 4))).tolist(), tk.ref_end]
        elif item == 1:
            coords = rng.integers(tk.coord_start, tk.coord_end + 1, size=int(rng.choice([2, 4, 4, 0, 1, 3, 5])))
            ids += [tk.box_start, *coords.tolist(), tk.box_end]
        elif item == 2:
            ids += [tk.box_start, int(rng.choice([tk.none, tk.none_lower])), tk.box_end]
        for _ in range(int(rng.integers(0, 3))):  # random tokens of every kind, anywhere
            noise = int(rng.integers(0, 5))
            value = [
                int(rng.choice(specials)),
                int(rng.integers(tk.coord_start - 2, tk.coord_end + 3)),
                int(rng.integers(0, tk.vocab_size + 10)),
                int(rng.integers(-(2**62), 2**62)),
                -1,
            ][noise]
            ids.insert(int(rng.integers(0, len(ids) + 1)), value)
    if ids and rng.random() < 0.3:
        ids = ids[: int(rng.integers(0, len(ids)))]  # a length cap
    return ids


def test_random_sequences_never_raise(tk):
    rng = np.random.default_rng(1234)
    counts = {"objects": 0, "boxes": 0, "empty": 0, "malformed": 0, "truncated": 0, "ended": 0}
    for trial in range(3000):
        ids = random_ids(rng, tk)
        probs = rng.random(len(ids)).tolist() if trial % 2 else None
        size = (int(rng.integers(1, 5000)), int(rng.integers(1, 5000)))
        result = parse_tokens(ids, tk, decode, size, probs)
        for obj in result.objects:
            assert isinstance(obj, LocatedObject)
            coords = obj.box if obj.box is not None else obj.point
            assert all(0 <= v <= size[i % 2] for i, v in enumerate(coords))
            assert (obj.confidence is None) == (probs is None)
        assert result.malformed >= 0 and not (result.ended and result.truncated)
        counts["objects"] += len(result.objects)
        counts["boxes"] += sum(o.box is not None for o in result.objects)
        counts["empty"] += len(result.empty_labels)
        counts["malformed"] += result.malformed
        counts["truncated"] += result.truncated
        counts["ended"] += result.ended
    assert min(counts.values()) > 100, counts  # every outcome is exercised


@pytest.mark.parametrize("name", golden_cases())
def test_golden_generations_parse(tk, name):
    case = golden_case(name)
    size = tuple(case["image"]["size"])
    for mode, generation in case["generation"].items():
        ids = generation["generated_ids"]
        result = parse(tk, ids, size=size)
        assert result.ended == (tk.im_end in ids), mode
        for obj in result.objects:
            assert (obj.box is None) != (obj.point is None)


def fed_in_pieces(tk, ids, size, probs, cuts):
    """An `AnswerParser` fed `ids` cut at `cuts` (growing answers through `feed_to` every other piece): its result
    and the objects and empty labels its feeds returned."""
    parser = AnswerParser(tk, decode, size, confidences=probs is not None)
    objects, empty = [], []
    for k, (start, stop) in enumerate(zip([0, *cuts], [*cuts, len(ids)], strict=True)):
        if k % 2:
            got = parser.feed_to(ids[:stop], None if probs is None else probs[:stop])
        else:
            got = parser.feed(ids[start:stop], None if probs is None else probs[start:stop])
        objects += got[0]
        empty += got[1]
    return parser.result(), objects, empty


def check_incremental(tk, ids, size, probs, cuts):
    whole = parse(tk, ids, size=size, probs=probs)
    result, objects, empty = fed_in_pieces(tk, ids, size, probs, cuts)
    assert result == whole
    assert (objects, empty) == (whole.objects, whole.empty_labels)


@pytest.mark.parametrize("name", golden_cases())
def test_parsing_as_the_answer_grows_equals_parsing_it_whole_on_golden_answers(tk, name):
    """Each golden answer fed one id at a time, and cut after every `</box>` as the engine feeds it."""
    case = golden_case(name)
    size = tuple(case["image"]["size"])
    for generation in case["generation"].values():
        ids = generation["generated_ids"]
        probs = np.linspace(0.1, 1.0, len(ids)).tolist()
        check_incremental(tk, ids, size, probs, list(range(1, len(ids))))
        check_incremental(tk, ids, size, None, [i + 1 for i, t in enumerate(ids) if t == tk.box_end])


def test_parsing_as_the_answer_grows_equals_parsing_it_whole_on_random_streams(tk):
    rng = np.random.default_rng(4321)
    for trial in range(400):
        ids = random_ids(rng, tk)
        probs = rng.random(len(ids)).tolist() if trial % 2 else None
        cuts = sorted({int(c) for c in rng.integers(0, len(ids) + 1, int(rng.integers(0, 8)))})
        check_incremental(tk, ids, (640, 480), probs, cuts)


def test_golden_hybrid_point_stream(tk):
    # `<box></box><box><568><461><null>`: an empty box, then a point cut off by the hybrid AR stop.
    case = golden_case("tiny_peaky__shapes_448x448__point")
    result = parse(tk, case["generation"]["hybrid"]["generated_ids"], size=tuple(case["image"]["size"]))
    assert result.objects == [] and result.malformed == 1 and result.truncated and not result.ended


def test_json_pixels_are_rounded_to_3_decimals_and_values_stay_integers():
    # 487/1000 * 224 = 109.088 and 661/1000 * 224 = 148.064 carry float noise ([..., 148.06400000000002, ...]).
    obj = LocatedObject("q", to_pixels((487, 317, 661, 487), (224, 224)), (487, 317, 661, 487), None, None, 0.5)
    assert obj.box != tuple(round(v, 3) for v in obj.box)  # the noise this rounding removes
    out = json.loads(json.dumps(obj.to_dict()))
    assert out["box"] == [109.088, 71.008, 148.064, 109.088] and out["box_norm"] == [487, 317, 661, 487]
    assert all(type(v) is int for v in out["box_norm"])
    point = LocatedObject(None, None, None, to_pixels((333, 667), (7, 3)), (333, 667), None).to_dict()
    assert point["point"] == (2.331, 2.001) and point["point_norm"] == (333, 667)
