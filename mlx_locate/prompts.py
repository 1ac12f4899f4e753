"""Prompt construction (MODEL.md §8): task text, chat rendering A or B, image placeholder expansion, ids.

The reference tokenizes the fully expanded string, `<IMG_CONTEXT>` repeated N times. Added tokens are matched
whole before BPE, so a run of them cannot merge with its neighbours: tokenizing one `<IMG_CONTEXT>` per image
and repeating its id gives the same ids.
"""

from __future__ import annotations

import re

from mlx_locate.tokenizer import Tokenizer

# `{}` is the query; "matches" (detect, gui) versus "match" (refer) is as the model was trained.
TASK_TEMPLATES = {
    "detect": "Locate all the instances that matches the following description: {}.",
    "single": "Locate a single instance that matches the following description: {}.",
    "refer": "Locate all the instances that match the following description: {}.",
    "textground": "Please locate the text referred as {}.",
    "ocr": "Detect all the text in box format.",
    "gui": "Locate the region that matches the following description: {}.",
    "point": "Point to: {}.",
}
TASKS = (*TASK_TEMPLATES, "raw")  # raw: the query is the user text, verbatim
RENDERINGS = ("A", "B")
CATEGORY_SEPARATOR = "</c>"
IMAGE_TOKEN = "<IMG_CONTEXT>"

_SYSTEM = {
    "A": "<|im_start|>system\nYou are a helpful assistant.\n<|im_end|>\n",  # py_apply_chat_template
    "B": "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n",  # chat_template.json
}
_PLACEHOLDER = re.compile(r"<image-(\d+)>")


def task_text(task: str, query: str | list[str] | None = None) -> str:
    """The user text of `task` (MODEL.md §8.3); `raw` returns `query` verbatim.

    `detect` takes one category or a list, joined by `</c>` without spaces; `ocr` takes no query.
    Raises `ValueError` for an unknown task or a missing, empty or unexpected query.
    """
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; valid tasks: {', '.join(TASKS)}")
    if task == "raw":
        if not isinstance(query, str) or not query:
            raise ValueError("task 'raw' needs the user text as its query")
        return query
    template = TASK_TEMPLATES[task]
    if "{}" not in template:
        if query:
            raise ValueError(f"task {task!r} takes no query; got {query!r}")
        return template
    if isinstance(query, list) and task != "detect":
        raise ValueError(f"task {task!r} takes one phrase; only 'detect' takes a list of categories")
    parts = [query] if isinstance(query, str) else list(query or [])
    parts = [p.strip() for p in parts]
    if not parts or not all(parts):
        raise ValueError(f"task {task!r} needs a non-empty query; got {query!r}")
    return template.format(CATEGORY_SEPARATOR.join(parts))


def parse_task_text(text: str) -> tuple[str, list[str]] | None:
    """The task and query of a user text that `task_text` builds (`detect`: its categories), or None for any
    other text."""
    for task, template in TASK_TEMPLATES.items():
        head, mark, tail = template.partition("{}")
        if mark and text.startswith(head) and text.endswith(tail) and len(text) > len(head) + len(tail):
            query = text[len(head) : len(text) - len(tail)]
            return task, query.split(CATEGORY_SEPARATOR) if task == "detect" else [query]
    return None


def chat_text(user_text: str, num_images: int = 1, rendering: str = "A") -> str:
    """One user turn holding `num_images` images then `user_text`, with the generation prompt (MODEL.md §8.1).

    Images appear as `<image-K>` placeholders. Rendering A (the default, as trained) skips a placeholder the
    user text already contains; rendering B (`chat_template.json`) always inserts it.
    """
    if rendering not in _SYSTEM:
        raise ValueError(f"unknown rendering {rendering!r}; valid renderings: {', '.join(RENDERINGS)}")
    images = [f"<image-{k}>" for k in range(1, num_images + 1)]
    if rendering == "A":
        images = [p for p in images if p not in user_text]
    return f"{_SYSTEM[rendering]}<|im_start|>user\n{''.join(images)}{user_text}<|im_end|>\n<|im_start|>assistant\n"


def image_token_counts(grids: list[tuple[int, int]]) -> list[int]:
    """`<IMG_CONTEXT>` tokens per image: h * w / 4 for a patch grid (h, w) merged 2 x 2."""
    for h, w in grids:
        if h <= 0 or w <= 0 or h % 2 or w % 2:
            raise ValueError(f"image patch grid {h}x{w} must have positive even sides (2 x 2 merge)")
    return [h * w // 4 for h, w in grids]


def _expand(text: str, counts: list[int]) -> tuple[str, list[int]]:
    """Replace each `<image-K>` by `<image K><img>` + `<IMG_CONTEXT>` x counts[K-1] + `</img>`.

    Returns the expanded text and the image numbers K in the order they appear.
    """
    found = [int(m.group(1)) for m in _PLACEHOLDER.finditer(text)]
    if sorted(found) != list(range(1, len(counts) + 1)):
        raise ValueError(
            f"prompt must hold each of <image-1>..<image-{len(counts)}> once (one per image grid); "
            f"found {', '.join(f'<image-{k}>' for k in found) or 'none'}"
        )

    def expand(m: re.Match) -> str:
        k = int(m.group(1))
        return f"<image {k}><img>{IMAGE_TOKEN * counts[k - 1]}</img>"

    return _PLACEHOLDER.sub(expand, text), found


def prompt_string(chat: str, grids: list[tuple[int, int]]) -> str:
    """The tokenizer input of the reference: `chat` with every image placeholder expanded (MODEL.md §8.2)."""
    return _expand(chat, image_token_counts(grids))[0]


def prompt_ids(tokenizer: Tokenizer, user_text: str, grids: list[tuple[int, int]], rendering: str = "A") -> list[int]:
    """Token ids of the full prompt for `user_text` and one image per patch grid (h, w); no BOS.

    Equal to `tokenizer.encode(prompt_string(chat_text(...), grids))`, without running BPE over the image tokens.
    """
    if IMAGE_TOKEN in user_text:
        raise ValueError(f"user text must not contain {IMAGE_TOKEN}; images are given by their grids")
    counts = image_token_counts(grids)
    text, order = _expand(chat_text(user_text, len(grids), rendering), [1] * len(counts))
    image_id = tokenizer.added_tokens[IMAGE_TOKEN]
    runs = iter(counts[k - 1] for k in order)
    ids = []
    for token in tokenizer.encode(text):
        ids.extend([token] * next(runs) if token == image_id else [token])
    return ids
