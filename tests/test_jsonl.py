"""JSON Lines: numbered values, errors naming the line, the cut of an unfinished last line, the first line rewritten,
recorded settings compared."""

from __future__ import annotations

import pytest

from mlx_locate import jsonl
from mlx_locate.sampling import Sampling


def test_values_skip_blank_lines_and_keep_numbers():
    assert list(jsonl.values('{"a": 1}\n\n  \n"b"\n[2]', "f.jsonl")) == [(1, {"a": 1}), (4, "b"), (5, [2])]


def test_a_line_that_is_not_json_is_named_with_the_hint():
    with pytest.raises(ValueError, match=r"^f\.jsonl:2 is not JSON \(.*\); start over$"):
        list(jsonl.values('1\n{"a": \n3\n', "f.jsonl", "; start over"))


def test_split_tail_parts_complete_lines_from_an_unfinished_last_line(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_bytes(b'{"a": 1}\n{"b": 2}\n{"c": ')
    assert jsonl.split_tail(path) == (b'{"a": 1}\n{"b": 2}\n', b'{"c": ')
    path.write_bytes(b"no newline at all")
    assert jsonl.split_tail(path) == (b"", b"no newline at all")
    path.write_bytes(b'{"a": 1}\n')
    assert jsonl.split_tail(path) == (b'{"a": 1}\n', b"")


def test_a_resumed_file_is_checked_before_its_last_line_is_cut(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_bytes(b'{"a": 1}\n{"b": ')
    assert jsonl.complete_text(path, "tool") == ('{"a": 1}\n', b'{"b": ')
    assert path.read_bytes() == b'{"a": 1}\n{"b": '  # reading changes nothing
    jsonl.cut_unfinished(path, b'{"b": ', (b'{"b": ',), "tool", cut=False)
    assert path.read_bytes() == b'{"a": 1}\n{"b": '
    with pytest.raises(ValueError, match=r"out\.jsonl does not end with a line of tool; use another --out$"):
        jsonl.cut_unfinished(path, b'{"b": ', (b'{"a": ',), "tool")
    assert path.read_bytes() == b'{"a": 1}\n{"b": '
    jsonl.cut_unfinished(path, b'{"b": ', (b'{"a": ', b'{"b": '), "tool")
    assert path.read_bytes() == b'{"a": 1}\n'
    path.write_bytes(b"\x89PNG\r\n\x1a\n")
    with pytest.raises(ValueError, match=r"out\.jsonl is not a JSONL of tool \('utf-8' codec can't decode"):
        jsonl.complete_text(path, "tool")


def test_set_first_line_in_place_or_by_rewriting(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_text('{"complete": false}\n{"frame": 0}\n')
    inode = path.stat().st_ino
    jsonl.set_first_line(path, {"complete": True})  # shorter: padded in place
    assert path.read_text() == '{"complete": true} \n{"frame": 0}\n' and path.stat().st_ino == inode
    assert [v for _, v in jsonl.values(path.read_text(), path)] == [{"complete": True}, {"frame": 0}]
    jsonl.set_first_line(path, {"complete": False})  # the same length again
    assert path.read_text() == '{"complete": false}\n{"frame": 0}\n' and path.stat().st_ino == inode
    jsonl.set_first_line(path, {"complete": False, "video": "v.mp4"})  # longer: the file is rewritten
    assert path.read_text() == '{"complete": false, "video": "v.mp4"}\n{"frame": 0}\n'
    assert not (tmp_path / "out.jsonl.partial").exists()


def test_settings_are_compared_key_by_key_and_those_not_recorded_are_named():
    wanted = jsonl.plain({"mode": "slow", "sampling": Sampling(), "tiles": (2, 2), "dtype": None})
    assert wanted["sampling"]["top_p"] == 1.0 and wanted["tiles"] == [2, 2]
    assert jsonl.check_settings("f.jsonl", wanted, wanted, "; hint") == []
    assert jsonl.check_settings("f.jsonl", {"mode": "slow"}, wanted, "; hint") == ["dtype", "sampling", "tiles"]
    recorded = {**wanted, "mode": "fast", "sampling": {**wanted["sampling"], "top_p": 0.9}, "old": 1}
    message = 'f.jsonl was written with other settings (mode: "fast" in the file, "slow" in p.jsonl; old: 1 in '
    message += "the file, null in p.jsonl; sampling.top_p: 0.9 in the file, 1.0 in p.jsonl); hint"
    with pytest.raises(ValueError) as e:
        jsonl.check_settings("f.jsonl", recorded, wanted, "; hint", against="in p.jsonl")
    assert str(e.value) == message
