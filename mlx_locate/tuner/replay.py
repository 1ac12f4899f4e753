"""Replay: fine-tuning keeps what the base knew.

Before training, the base model answers detection prompts of the categories it should keep on the training
images. Its answers become samples in the model's own grammar, records encoded like the data's
(`datasets.encode_record`), and a `replay` share of every batch is drawn from them.

- **Kept categories**: the caller's list, else the checkpoint's (`cards.known_categories`: the demo's shapes,
  COCO's 80 for LocateAnything-3B). A label of the data that is not kept is a new word. It is never asked in a
  replay prompt, because the base's answer about it would be wrong.
- **Asking**: per image, each kept category that none of the image's own records asks about (the data is the
  truth there) is asked once, in prompts of `per_prompt` categories: a few requests per image.
- **Answers**: the base's boxes (corners ordered, ascending x1 then y1) and its `<box>None</box>`s. A box that
  lies for half or more on an object the data's detection records name with a new word is a confusion, not
  knowledge (the demo calls crosses diamonds, and draws star slivers on rings): it is dropped, and a category
  left without boxes leaves the prompt, so every None in a replay answer is one the base wrote. Referring
  phrases do not drop boxes ("black shape" is still a triangle). A category the base did not answer also leaves
  the prompt. An answer cut by the length cap, or a failed request, gives no sample.
- **Samples**: detection prompts composed of the base's answers per category (`replay_records`): as many about
  what it found as about what it said is absent. Each answer is the base's parts in the prompt's order.
- **Cache**: the answers go to `replay.jsonl` in the output folder, and a resumed run reads them back.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import jsonl
from ..locate import LocateModel
from ..prompts import parse_task_text, task_text
from ..request import Request, RequestError, Result
from ..tokenizer import Tokenizer
from ..tokens import TokenIds
from ..weights.cards import RELEASE_PER_PROMPT, KnownCategories
from .datasets import Record, Turn, norm_label, record_labels, truth_of

LABEL_MODE = "slow"  # the base's most careful answers
LABEL_MAX_TOKENS = 512
CACHE_FILE = "replay.jsonl"
ON_NEW_WORD = 0.5  # a base box lying this much on a new word's box is that object (or a sliver of it), misnamed
REPLAY_STREAM = 7  # the seed stream of the prompts, apart from the batches'
ABSENT_JOIN = 0.5  # chance that a prompt of found categories also asks one the base answered None

Box = tuple[int, int, int, int]


@dataclass(frozen=True)
class Keep:
    categories: tuple[str, ...]  # asked in replay prompts (as written; compared by `norm_label`)
    per_prompt: int
    new: tuple[str, ...]  # the data's labels that are not kept (normalised): never asked
    source: str  # where the list comes from, for messages

    def keeps(self, label: str) -> bool:
        return norm_label(label) in {norm_label(c) for c in self.categories}


def resolve_keep(explicit: tuple[str, ...] | None, known: KnownCategories | None, records: list[Record]) -> Keep:
    """The kept categories: `explicit`, else the checkpoint's; the data's other labels are its new words."""
    if explicit is not None:
        names = [n.strip() for n in explicit]
        if not names or not all(names):
            raise ValueError(f"--keep-categories needs non-empty category names; got {list(explicit)}")
        source, per_prompt = "--keep-categories", known.per_prompt if known else RELEASE_PER_PROMPT
    elif known is not None:
        names, source, per_prompt = list(known.names), "the model card", known.per_prompt
    else:
        names, source, per_prompt = [], "none: the checkpoint names none", RELEASE_PER_PROMPT
    unique, kept = [], set()
    for n in names:  # the first spelling of each
        if norm_label(n) not in kept:
            unique.append(n)
            kept.add(norm_label(n))
    labels = set().union(*(record_labels(r) for r in records)) if records else set()
    return Keep(tuple(unique), per_prompt, tuple(sorted(labels - kept)), source)


@dataclass(frozen=True)
class Ask:
    image: Path
    categories: tuple[str, ...]

    def prompt(self) -> str:
        return task_text("detect", list(self.categories))


def plan_asks(records: list[Record], keep: Keep, seed: int, split: int, images: list[Path] | None = None) -> list[Ask]:
    """Every kept category that none of an image's records asks about, once per image (of `images`, default every
    image of `records`, in order), in prompts of `per_prompt` categories over a seeded shuffle (stream `split`)."""
    asked: dict[Path, set[str]] = {}
    for r in records:
        asked.setdefault(r.image, set()).update(record_labels(r))
    asks = []
    for k, image in enumerate(images if images is not None else list(asked)):
        pool = [c for c in keep.categories if norm_label(c) not in asked.get(image, set())]
        order = np.random.default_rng([seed, REPLAY_STREAM, split, k]).permutation(len(pool))
        for start in range(0, len(pool), keep.per_prompt):
            asks.append(Ask(image, tuple(pool[j] for j in order[start : start + keep.per_prompt])))
    return asks


@dataclass(frozen=True)
class Answer:
    """What the base said to one ask: its boxes (0..1000, as written) per asked category, the asked categories it
    answered `<box>None</box>`, and whether it ended by itself."""

    boxes: dict[str, list[Box]]
    none: tuple[str, ...]
    ended: bool

    def to_json(self) -> dict:
        return {"boxes": self.boxes, "none": list(self.none), "ended": self.ended}

    @staticmethod
    def from_json(d: dict) -> Answer:
        return Answer({c: [tuple(b) for b in v] for c, v in d["boxes"].items()}, tuple(d["none"]), d["ended"])


def answer_of(ask: Ask, result: Result | RequestError) -> Answer:
    if isinstance(result, RequestError):
        return Answer({}, (), False)
    names = {norm_label(c): c for c in ask.categories}
    boxes: dict[str, list[Box]] = {}
    for o in result.objects:
        if o.box_norm is not None and norm_label(o.label) in names:
            boxes.setdefault(names[norm_label(o.label)], []).append(tuple(o.box_norm))
    none = tuple(names[norm_label(e)] for e in result.empty_labels if norm_label(e) in names)
    ended = result.stats.get("stop_reason") != "length_cap" and not result.truncated
    return Answer(boxes, none, ended)


def ordered(box: Box) -> Box:
    x1, y1, x2, y2 = box
    return min(x1, x2), min(y1, y2), max(x1, x2), max(y1, y2)


def share_on(box: Box, other: Box) -> float:
    """The share of `box`'s area (a non-empty box) that lies inside `other`."""
    w = min(box[2], other[2]) - max(box[0], other[0])
    h = min(box[3], other[3]) - max(box[1], other[1])
    return max(w, 0) * max(h, 0) / ((box[2] - box[0]) * (box[3] - box[1]))


@dataclass
class Knowledge:
    """What the base said about one image's kept categories, as answer parts in the data's grammar."""

    found: dict[str, str]  # category -> "<ref>c</ref><box>..</box>..." (its boxes, ascending x1 then y1)
    absent: dict[str, str]  # category -> "<ref>c</ref><box>None</box>" (the base's own None)
    cut: int = 0  # answers cut by the length cap, or failed requests
    dropped: int = 0  # boxes on objects the data names with a new word


def knowledge(answers: list[tuple[Ask, Answer]], new_boxes: list[Box]) -> Knowledge:
    """One image's answers as parts (see the module docstring: what is kept, dropped and left out)."""
    know = Knowledge({}, {})
    for ask, answer in answers:
        if not answer.ended:
            know.cut += 1
            continue
        for c in ask.categories:
            boxes = [b for b in sorted({ordered(b) for b in answer.boxes.get(c, [])}) if b[0] < b[2] and b[1] < b[3]]
            mine = [b for b in boxes if not any(share_on(b, n) >= ON_NEW_WORD for n in new_boxes)]
            know.dropped += len(boxes) - len(mine)
            if mine:
                know.found[c] = "".join(f"<ref>{c}</ref><box>{''.join(f'<{v}>' for v in b)}</box>" for b in mine)
            elif c in answer.none and not boxes:
                know.absent[c] = f"<ref>{c}</ref><box>None</box>"
    return know


def groups(items: list[str], per_prompt: int, rng: np.random.Generator) -> list[list[str]]:
    """`items` shuffled and cut into groups of 1..`per_prompt`."""
    order, out, start = rng.permutation(len(items)), [], 0
    while start < len(items):
        n = int(rng.integers(1, per_prompt + 1))
        out.append([items[j] for j in order[start : start + n]])
        start += n
    return out


def replay_records(image: Path, know: Knowledge, per_prompt: int, rng: np.random.Generator) -> list[Record]:
    """Detection samples of what the base said: the categories it found in seeded groups of 1..`per_prompt`, each
    joined by one it answered None with probability `ABSENT_JOIN`, and as many groups (at least one) of those it
    answered None alone, so an image of new words is asked about known ones; each answer is the base's parts in
    the prompt's order."""
    found, absent = list(know.found), list(know.absent)
    prompts = []
    for group in groups(found, per_prompt, rng):
        if absent and rng.random() < ABSENT_JOIN:
            group.insert(int(rng.integers(len(group) + 1)), absent[int(rng.integers(len(absent)))])
        prompts.append(group)
    prompts += groups(absent, per_prompt, rng)[: max(1, len(prompts))]
    parts = {**know.found, **know.absent}
    return [
        Record(
            image, (Turn(task_text("detect", p), "".join(parts[c] for c in p)),), f"replay: {image} ({', '.join(p)})"
        )
        for p in prompts
    ]


def new_word_boxes(records: list[Record], keep: Keep, tokenizer: Tokenizer, ids: TokenIds) -> dict[Path, list[Box]]:
    """Per image, the boxes (0..1000) its detection records give a new word (a category that is not kept)."""
    out: dict[Path, list[Box]] = {}
    for r in records:
        for turn in r.turns:
            if (parse_task_text(turn.user) or ("",))[0] != "detect":
                continue
            for o in truth_of(turn.answer, tokenizer, ids, (1000, 1000)):  # only box_norm is read
                if o.box_norm is not None and not keep.keeps(o.label or ""):
                    out.setdefault(r.image, []).append(ordered(tuple(o.box_norm)))
    return out


def replay_set(
    asks: list[Ask], answers: list[Answer], new_boxes: dict[Path, list[Box]], per_prompt: int, seed: int, split: int
) -> tuple[list[Record], dict[str, int]]:
    """The samples of every image's answers, and counts for messages: found and None categories, answers cut,
    boxes dropped on new words."""
    by_image: dict[Path, list[tuple[Ask, Answer]]] = {}
    for a, x in zip(asks, answers, strict=True):
        by_image.setdefault(a.image, []).append((a, x))
    records, counts = [], {"found": 0, "absent": 0, "cut": 0, "dropped": 0}
    for k, (image, pairs) in enumerate(by_image.items()):
        know = knowledge(pairs, new_boxes.get(image, []))
        records += replay_records(image, know, per_prompt, np.random.default_rng([seed, REPLAY_STREAM, split, k, 1]))
        for key, n in (("found", len(know.found)), ("absent", len(know.absent)), ("cut", know.cut)):
            counts[key] += n
        counts["dropped"] += know.dropped
    return records, counts


def cache_key(model_path: str) -> dict:
    return {"model": model_path, "mode": LABEL_MODE, "max_tokens": LABEL_MAX_TOKENS}


def read_cache(path: Path, key: dict) -> dict[tuple[str, tuple[str, ...]], Answer]:
    """The cached answers, when `path` holds answers of the same base and settings (the file is written whole,
    so an unfinished last line is not ours and is left out)."""
    if not path.is_file():
        return {}
    text, _ = jsonl.complete_text(path, "replay answers")
    lines = [v for _, v in jsonl.values(text, path, jsonl.RESUME_HINT)]
    if not lines or lines[0] != {"replay": key}:
        return {}
    return {(d["image"], tuple(d["categories"])): Answer.from_json(d) for d in lines[1:]}


def label(
    model: LocateModel,
    asks: list[Ask],
    cache: Path,
    key: dict,
    reuse: bool,
    progress: bool,
    say: Callable[[str], None],
) -> list[Answer]:
    """The base's answer to every ask: read from `cache` when `reuse` (a resumed run), the rest decoded in one
    batch (`locate_many`, a progress bar); all of them written back to `cache`."""
    known = read_cache(cache, key) if reuse else {}
    todo = [a for a in asks if (str(a.image), a.categories) not in known]
    if todo:
        say(f"[INFO] replay: the base answers {len(todo)} prompts on {len({a.image for a in todo})} images")
        requests = [Request(a.image, prompt=a.prompt(), mode=LABEL_MODE, max_tokens=LABEL_MAX_TOKENS) for a in todo]
        results = model.locate_many(requests, progress=progress, desc="replay: the base labels")
        for a, r in zip(todo, results, strict=True):
            known[(str(a.image), a.categories)] = answer_of(a, r)
    elif asks:
        say(f"[INFO] replay: {len(asks)} answers of the base read from {cache}")
    answers = [known[(str(a.image), a.categories)] for a in asks]
    lines = [{"replay": key}] + [
        {"image": str(a.image), "categories": list(a.categories), **ans.to_json()}
        for a, ans in zip(asks, answers, strict=True)
    ]
    tmp = cache.with_name(cache.name + ".tmp")
    tmp.write_text("".join(json.dumps(line) + "\n" for line in lines))
    tmp.replace(cache)
    return answers


def replayed(steps: int, batch_size: int, replay: float) -> int:
    """Replay samples in the first `steps` batches: the share `replay` of their samples, rounded down."""
    return math.floor(steps * batch_size * replay)
