"""Fine-tuning data: LocateAnything SFT JSONL, NVIDIA's recipe JSON and COCO instances, as records and rows.

- **SFT JSONL** (NVlabs/Eagle `Embodied/document/DATA_PREPARATION.md`): one sample per line,
  `{"image": "a.jpg", "conversations": [{"from": "human", "value": "..."}, {"from": "gpt", "value": "..."}]}`,
  answers such as `<ref>car</ref><box><120><200><450><500></box>` (0..1000) and `<box>None</box>` for an absent
  object; image paths relative to `--images`.
- **Recipe JSON** (`--meta_path` there): `{"name": {"annotation": "a.jsonl" | [...], "root": "images/",
  "repeat_time": 1.0}}`; relative paths from the recipe's folder.
- **COCO instances**: each image becomes detection prompts (`prompts.task_text("detect", categories)`) of at most
  `categories_per_prompt` categories: the present ones with their boxes (ascending x1, then y1) and absent ones
  answered `<ref>name</ref><box>None</box>` in their place in the prompt; crowd and empty boxes are left out.

A record becomes rows with the real chat rendering (`prompts.prompt_ids`, rendering A, the image as `<image-1>`
of the first user turn) and `trainer.encode_rows`: every answer is supervised in the NTP and the block stream.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import jsonl
from ..parse import LocatedObject, parse_tokens
from ..prompts import CATEGORY_SEPARATOR, parse_task_text, prompt_ids, task_text
from ..synthetic.scenes import norm_coords
from ..tokenizer import Tokenizer
from ..tokens import TokenIds
from .trainer import Encoded, encode_rows

USER_ROLES = ("human", "user")
ASSISTANT_ROLES = ("gpt", "assistant")
BOX_RE = re.compile(r"<box>(.*?)</box>", re.DOTALL)
COORD_RE = re.compile(r"<(\d+)>")


@dataclass(frozen=True)
class Turn:
    user: str
    answer: str


@dataclass(frozen=True)
class Record:
    """One training sample: an image and its conversation; `where` names its origin in messages."""

    image: Path
    turns: tuple[Turn, ...]
    where: str


def check_answer(answer: str, where: str) -> None:
    """Every `<box>` must hold 4 (a box) or 2 (a point) coordinates in 0..1000, or `None`/`none`."""
    if answer.count("<box>") != answer.count("</box>") or answer.count("<ref>") != answer.count("</ref>"):
        raise ValueError(f"{where}: unbalanced <box> or <ref> tags in the answer {answer[:80]!r}")
    for body in BOX_RE.findall(answer):
        if body.strip() in ("None", "none"):
            continue
        values = COORD_RE.findall(body)
        if COORD_RE.sub("", body).strip() or len(values) not in (2, 4) or any(int(v) > 1000 for v in values):
            raise ValueError(
                f"{where}: <box>{body}</box> must hold 4 (box) or 2 (point) coordinates <0>..<1000>, or None"
            )


def conversation(item: dict, where: str) -> tuple[Turn, ...]:
    turns = item.get("conversations")
    if not isinstance(turns, list) or not turns:
        raise ValueError(f"{where}: expected a non-empty 'conversations' list")
    roles = []
    for t in turns:
        if not isinstance(t, dict) or not isinstance(t.get("value"), str):
            raise ValueError(f"{where}: every turn needs 'from' and a string 'value'")
        role = t.get("from")
        if role not in USER_ROLES + ASSISTANT_ROLES:
            raise ValueError(f"{where}: turn role {role!r} is not one of {', '.join(USER_ROLES + ASSISTANT_ROLES)}")
        roles.append("user" if role in USER_ROLES else "assistant")
    if len(roles) % 2 or roles != ["user", "assistant"] * (len(roles) // 2):
        raise ValueError(f"{where}: turns must alternate human, gpt, ... and end with gpt; found {roles}")
    pairs = tuple(Turn(turns[i]["value"], turns[i + 1]["value"]) for i in range(0, len(turns), 2))
    for turn in pairs:
        check_answer(turn.answer, where)
    return pairs


def image_of(item: dict, root: Path, where: str) -> Path:
    if "video" in item or "video_list" in item:
        raise ValueError(f"{where}: video samples are not supported")
    images = item.get("image", item.get("image_list"))
    if isinstance(images, list):
        if len(images) != 1:
            raise ValueError(f"{where}: {len(images)} images; only samples with one image are supported")
        images = images[0]
    if not isinstance(images, str) or not images:
        raise ValueError(f"{where}: expected an 'image' path (samples without an image are not supported)")
    return root / images


def read_jsonl(path: Path, root: Path) -> list[Record]:
    records = []
    for n, item in jsonl.values(path.read_text(encoding="utf-8"), path):
        where = f"{path}:{n}"
        if not isinstance(item, dict):
            raise ValueError(f"{where}: expected a JSON object")
        records.append(Record(image_of(item, root, where), conversation(item, where), where))
    if not records:
        raise ValueError(f"{path}: no samples")
    return records


def read_recipe(path: Path, recipe: dict, seed: int) -> list[Record]:
    records = []
    for name, meta in recipe.items():
        if not isinstance(meta, dict) or "annotation" not in meta:
            raise ValueError(f"{path}: entry {name!r} needs an 'annotation' file (or list of files)")
        files = meta["annotation"] if isinstance(meta["annotation"], list) else [meta["annotation"]]
        root = path.parent / meta.get("root", "")
        part = [r for f in files for r in read_jsonl(path.parent / f, root)]
        repeat = float(meta.get("repeat_time", 1.0))
        if repeat <= 0:
            raise ValueError(f"{path}: entry {name!r} has repeat_time {repeat}; it must be above 0")
        rng = np.random.default_rng([seed, len(records)])
        extra = rng.permutation(len(part))[: round((repeat - math.floor(repeat)) * len(part))]
        records += part * math.floor(repeat) + [part[i] for i in sorted(extra)]
    return records


def read_coco(path: Path, data: dict, root: Path, categories_per_prompt: int, seed: int) -> list[Record]:
    """Detection records from COCO instances (see the module docstring); deterministic in `seed`."""
    if categories_per_prompt < 1:
        raise ValueError(f"categories per prompt must be at least 1, got {categories_per_prompt}")
    names = {c["id"]: str(c["name"]).strip() for c in data.get("categories", [])}
    if not names:
        raise ValueError(f"{path}: no categories")
    for name in names.values():
        if not name or CATEGORY_SEPARATOR in name:
            raise ValueError(f"{path}: category name {name!r} is empty or holds {CATEGORY_SEPARATOR}")
    boxes: dict[int, dict[int, list[tuple[float, ...]]]] = {}
    for a in data.get("annotations", []):
        x, y, w, h = a["bbox"]
        if a.get("iscrowd") or w <= 0 or h <= 0:
            continue
        if a["category_id"] not in names:
            raise ValueError(f"{path}: annotation {a.get('id')} has unknown category {a['category_id']}")
        boxes.setdefault(a["image_id"], {}).setdefault(a["category_id"], []).append((x, y, x + w, y + h))
    order = sorted(names)
    records = []
    for image in data.get("images", []):
        size = (image["width"], image["height"])
        found = boxes.get(image["id"], {})
        rng = np.random.default_rng([seed, image["id"]])
        present = [c for c in order if c in found]
        absent = [order[i] for i in rng.permutation(len(order)) if order[i] not in found]
        chunks = [present[i : i + categories_per_prompt] for i in range(0, len(present), categories_per_prompt)]
        for k, chunk in enumerate(chunks or [[]]):
            room = categories_per_prompt - len(chunk)  # filled with absent categories, answered None
            start = k * room
            chunk = chunk + [absent[(start + j) % len(absent)] for j in range(min(room, len(absent)))]
            chunk = [chunk[i] for i in rng.permutation(len(chunk))]
            parts = []
            for c in chunk:
                coords = sorted(norm_coords(b, size) for b in found.get(c, []))
                body = "".join(f"<box>{''.join(f'<{v}>' for v in box)}</box>" for box in coords) or "<box>None</box>"
                parts.append(f"<ref>{names[c]}</ref>{body}")
            turn = Turn(task_text("detect", [names[c] for c in chunk]), "".join(parts))
            records.append(Record(root / image["file_name"], (turn,), f"{path}: image {image['id']}"))
    if not records:
        raise ValueError(f"{path}: no images")
    return records


def read_data(
    path: str | Path, images: str | Path | None = None, categories_per_prompt: int = 10, seed: int = 0
) -> list[Record]:
    """Records from an SFT JSONL file, a recipe JSON or COCO instances (told apart by their content).
    `images` is the folder image paths are relative to (default: the data file's folder; recipes name their own)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"data file {path} does not exist")
    root = Path(images).expanduser() if images is not None else path.parent
    if images is not None and not root.is_dir():
        raise FileNotFoundError(f"images folder {root} does not exist")
    if path.suffix == ".jsonl":
        return read_jsonl(path, root)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e}); SFT data goes in a .jsonl file") from None
    if isinstance(data, dict) and "annotations" in data and "images" in data:
        return read_coco(path, data, root, categories_per_prompt, seed)
    if isinstance(data, dict) and data and all(isinstance(v, dict) and "annotation" in v for v in data.values()):
        return read_recipe(path, data, seed)
    raise ValueError(f"{path}: neither COCO instances (images, annotations, categories) nor a recipe JSON")


def split(records: list[Record], fraction: float, seed: int) -> tuple[list[Record], list[Record]]:
    """(train, held-out): a seeded `fraction` of the images, with every record of an image on one side."""
    if not 0 <= fraction < 1:
        raise ValueError(f"held-out fraction must be in [0, 1), got {fraction}")
    images = sorted({r.image for r in records})
    n = min(len(images) - 1, max(1, round(fraction * len(images)))) if fraction > 0 else 0
    held = {images[i] for i in np.random.default_rng(seed).permutation(len(images))[:n]}
    return [r for r in records if r.image not in held], [r for r in records if r.image in held]


@dataclass
class Example:
    """A record encoded for one model: its rows, its image's grid, and the ground truth of its first turn."""

    record: Record
    rows: Encoded
    grid: tuple[int, int]
    truth: list[LocatedObject]


def encode_record(record: Record, grid: tuple[int, int], tokenizer: Tokenizer, ids: TokenIds) -> Encoded:
    """Rendering A over all turns: the image in the first user turn, each answer closed by `<|im_end|>`."""
    x = prompt_ids(tokenizer, record.turns[0].user, [grid])
    anchors = [len(x) - 1]
    x += tokenizer.encode(record.turns[0].answer + "<|im_end|>\n")
    for turn in record.turns[1:]:
        x += tokenizer.encode(f"<|im_start|>user\n{turn.user}<|im_end|>\n<|im_start|>assistant\n")
        anchors.append(len(x) - 1)
        x += tokenizer.encode(turn.answer + "<|im_end|>\n")
    return encode_rows(x, anchors, ids)


def truth_of(answer: str, tokenizer: Tokenizer, ids: TokenIds, size: tuple[int, int]) -> list[LocatedObject]:
    return parse_tokens(tokenizer.encode(answer), ids, tokenizer.decode, size).objects


def norm_label(label: str | None) -> str:
    return (label or "").strip().lower()


REF_RE = re.compile(r"<ref>(.*?)</ref>", re.DOTALL)


def record_labels(record: Record) -> set[str]:
    """What a record asks about (`norm_label`): the queries of its template prompts (each detection category)
    and the `<ref>` labels of its answers."""
    labels = set()
    for turn in record.turns:
        parsed = parse_task_text(turn.user)
        labels |= {norm_label(q) for q in (parsed[1] if parsed else [])}
        labels |= {norm_label(r) for r in REF_RE.findall(turn.answer)}
    return labels - {""}
