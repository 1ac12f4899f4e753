"""JSON Lines files: each line's value with errors that name the line, the cut of a last line that an
interrupted write left without its newline (so a resumed run appends after whole lines; a file a command resumes
is checked before anything is cut: `complete_text`, then `cut_unfinished`), a header line rewritten in place, and
the settings a file records compared with a run's (`check_settings`)."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator
from pathlib import Path

RESUME_HINT = "; fix or remove that line, or use another --out"  # for a file a run resumes


def values(text: str, path: Path | str, hint: str = "") -> Iterator[tuple[int, object]]:
    """(line number, value) of each non-blank line of `text`; a line that is not JSON raises `ValueError`
    naming `path:number`, followed by `hint`."""
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{number} is not JSON ({e}){hint}") from None
        yield number, value


def split_tail(path: Path) -> tuple[bytes, bytes]:
    """The file's bytes up to its last newline, and what follows it (an unfinished line, or b"")."""
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    return data[:end], data[end:]


def cut_to(path: Path, size: int) -> None:
    """Cut the file to `size` bytes, on disk before returning."""
    with path.open("r+b") as f:
        f.truncate(size)
        f.flush()
        os.fsync(f.fileno())


def complete_text(path: Path, what: str) -> tuple[str, bytes]:
    """The text of the file's complete lines and what follows its last newline (an unfinished line, or b""); the
    file is not changed. Bytes that are not UTF-8 raise `ValueError` naming the file as no JSONL of `what`."""
    complete, tail = split_tail(path)
    try:
        return complete.decode("utf-8"), tail
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not a JSONL of {what} ({e}); use another --out") from None


def cut_unfinished(path: Path, tail: bytes, starts: tuple[bytes, ...], what: str, cut: bool = True) -> None:
    """Once the complete lines are checked: the unfinished last line `tail` (`complete_text`) is an interrupted
    write of `what` when it starts as its lines do (`starts`), and is cut off the file (unless not `cut`); any
    other raises `ValueError` and the file stays as it is."""
    if not tail:
        return
    if not tail.startswith(starts):
        raise ValueError(f"{path} does not end with a line of {what}; use another --out")
    if cut:
        cut_to(path, path.stat().st_size - len(tail))


def set_first_line(path: Path, value: object) -> None:
    """Make `value` the file's first line, on disk before returning: written over the old one in place, padded
    with spaces (valid JSON) when shorter; the whole file is rewritten (under a temporary name, then renamed)
    only when it is longer."""
    line = json.dumps(value).encode()
    with path.open("r+b") as f:
        old = len(f.readline().rstrip(b"\n"))
        if len(line) <= old:
            f.seek(0)
            f.write(line + b" " * (old - len(line)))
            f.flush()
            os.fsync(f.fileno())
            return
        f.seek(0)
        rest = f.read()[old:]
    staged = path.with_name(path.name + ".partial")
    with staged.open("wb") as f:
        f.write(line + rest)
        f.flush()
        os.fsync(f.fileno())
    os.replace(staged, path)


def plain(value: object) -> object:
    """`value` as JSON gives it back (dataclasses as objects, tuples as lists), so that settings made now compare
    equal to the same settings read from a file."""
    return json.loads(json.dumps(value, default=dataclasses.asdict))


def check_settings(path: Path | str, recorded: dict, wanted: dict, hint: str, against: str = "now") -> list[str]:
    """Raise `ValueError` naming every setting that `recorded` (read from `path`) gives another value than
    `wanted` (`plain` values; objects compared key by key, named `sampling.top_p`), followed by `hint`. Returns
    the names of the settings the file does not record (written before they were), which are not compared."""
    changed, unrecorded = [], []

    def compare(old: dict, new: dict, prefix: str) -> None:
        for key in sorted(old.keys() | new.keys()):
            name, value = prefix + key, new.get(key)
            if key not in old:
                unrecorded.append(name)
            elif isinstance(old[key], dict) and isinstance(value, dict):
                compare(old[key], value, name + ".")
            elif old[key] != value:
                changed.append(f"{name}: {json.dumps(old[key])} in the file, {json.dumps(value)} {against}")

    compare(recorded, wanted, "")
    if changed:
        raise ValueError(f"{path} was written with other settings ({'; '.join(changed)}){hint}")
    return unrecorded


def unrecorded_note(lines: int, where: Path | str, then: str = "resumed as made with this run's settings") -> str:
    """The note for `lines` lines of `where` that lack settings `check_settings` compares (an earlier version's)."""
    some = f"{lines} line{'s' * (lines != 1)} of {where} lack{'s' * (lines == 1)}"
    return f"note: {some} settings that this version records (written by an earlier one); {then}"
