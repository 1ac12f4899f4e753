"""JSON Lines reading: numbered values, errors naming the line, and the cut of an unfinished last line."""

from __future__ import annotations

import pytest

from mlx_locate import jsonl


def test_values_skip_blank_lines_and_keep_numbers():
    assert list(jsonl.values('{"a": 1}\n\n  \n"b"\n[2]', "f.jsonl")) == [(1, {"a": 1}), (4, "b"), (5, [2])]


def test_a_line_that_is_not_json_is_named_with_the_hint():
    with pytest.raises(ValueError, match=r"^f\.jsonl:2 is not JSON \(.*\); start over$"):
        list(jsonl.values('1\n{"a": \n3\n', "f.jsonl", "; start over"))


def test_whole_lines_cut_an_unfinished_last_line_off_the_file(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_bytes(b'{"a": 1}\n{"b": 2}\n{"c": ')
    assert jsonl.split_tail(path) == (b'{"a": 1}\n{"b": 2}\n', b'{"c": ')
    assert jsonl.whole_lines(path) == '{"a": 1}\n{"b": 2}\n'
    assert path.read_bytes() == b'{"a": 1}\n{"b": 2}\n'
    assert jsonl.whole_lines(path) == '{"a": 1}\n{"b": 2}\n'  # nothing more to cut
    path.write_bytes(b"no newline at all")
    assert jsonl.whole_lines(path) == "" and path.read_bytes() == b""
