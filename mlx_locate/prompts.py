"""Prompt construction (docs/model.md §8): task text, chat rendering A or B, image placeholder expansion, ids.

The reference tokenizes the fully expanded string, `<IMG_CONTEXT>` repeated N times. Added tokens are matched
whole before BPE, so a run of them cannot merge with its neighbours: tokenizing one `<IMG_CONTEXT>` per image
and repeating its id gives the same ids.

Special tokens in user text, one rule for every entry point (the CLI, the API, the server, batch, video all
build their prompts here):
- A query (every task but `raw`) is the user's words: it is read as plain text. `<|im_end|>` or `<img>` in
  a query is the BPE of its characters, never the token, so a query can never end the user's turn or forge an
  image, and "the <img> tag" is looked for as written. Two things in a query keep their meaning: detect's
  documented category separator (`"car</c>person"` is the categories car and person, as the list is), and the
  processor's `<image-K>` placeholders (they place the image there, as the reference does; not tokens).
- A raw prompt (`task="raw"`, `prompt=`) is the model's grammar on purpose: the grammar's tokens (`<ref>`,
  `</ref>`, `<box>`, `</box>`, `</c>`, `<0>`..`<1000>`) and `<image-K>` placeholders are read as such; any
  other added token (`<|im_start|>`, `<|im_end|>`, `<|endoftext|>`, `<IMG_CONTEXT>`, `<img>`, `<text_mask>`,
  ...) is refused with a `ValueError` naming it: it would break the chat format the model was trained on.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import NamedTuple

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
GRAMMAR_TOKENS = ("<ref>", "</ref>", "<box>", "</box>", CATEGORY_SEPARATOR)  # and the coordinates <0>..<1000>
_COORDINATE = re.compile(r"<(\d{1,4})>")
_TAIL = "<|im_end|>\n<|im_start|>assistant\n"

_SYSTEM = {
    "A": "<|im_start|>system\nYou are a helpful assistant.\n<|im_end|>\n",  # py_apply_chat_template
    "B": "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n",  # chat_template.json
}
_PLACEHOLDER = re.compile(r"<image-(\d+)>")
_PLACEHOLDER_SPLIT = re.compile(r"(<image-\d+>)")


class UserText(NamedTuple):
    """A user turn's text and the spans (start, end) of the user's own words in it, read as plain text."""

    text: str
    plain: tuple[tuple[int, int], ...] = ()

    def pieces(self) -> list[tuple[str, bool]]:
        """The text in order as (piece, plain) pairs."""
        out, at = [], 0
        for start, end in self.plain:
            out += [(self.text[at:start], False), (self.text[start:end], True)]
            at = end
        return [(t, plain) for t, plain in [*out, (self.text[at:], False)] if t]

    def grammar(self) -> str:
        """The text outside the user's words (the template, or all of a raw prompt)."""
        return "".join(t for t, plain in self.pieces() if not plain)


def user_text(task: str, query: str | list[str] | None = None) -> UserText:
    """The user text of `task` (docs/model.md §8.3), the query's words marked as plain text; `raw` is `query`
    verbatim, all of it the model's grammar (module docstring).

    `detect` takes one category or a list, joined by `</c>` without spaces; `ocr` takes no query.
    Raises `ValueError` for an unknown task or a missing, empty or unexpected query.
    """
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; valid tasks: {', '.join(TASKS)}")
    if task == "raw":
        if not isinstance(query, str) or not query:
            raise ValueError("task 'raw' needs the user text as its query")
        return UserText(query)
    template = TASK_TEMPLATES[task]
    if "{}" not in template:
        if query:
            raise ValueError(f"task {task!r} takes no query; got {query!r}")
        return UserText(template)
    if isinstance(query, list) and task != "detect":
        raise ValueError(f"task {task!r} takes one phrase; only 'detect' takes a list of categories")
    parts = [query] if isinstance(query, str) else list(query or [])
    if task == "detect" and isinstance(query, str):
        parts = query.split(CATEGORY_SEPARATOR)
    if not all(isinstance(p, str) for p in parts):
        raise ValueError(f"task {task!r} needs text as its query; got {query!r}")
    parts = [p.strip() for p in parts]
    if not parts or not all(parts):
        raise ValueError(f"task {task!r} needs a non-empty query; got {query!r}")
    head, _, tail = template.partition("{}")
    spans, at = [], len(head)
    for part in parts:
        spans.append((at, at + len(part)))
        at += len(part) + len(CATEGORY_SEPARATOR)
    return UserText(head + CATEGORY_SEPARATOR.join(parts) + tail, tuple(spans))


def task_text(task: str, query: str | list[str] | None = None) -> str:
    """The user text of `task` as a string (see `user_text`)."""
    return user_text(task, query).text


def parse_task_text(text: str) -> tuple[str, list[str]] | None:
    """The task and query of a user text that `task_text` builds (`detect`: its categories), or None for any
    other text."""
    for task, template in TASK_TEMPLATES.items():
        head, mark, tail = template.partition("{}")
        if mark and text.startswith(head) and text.endswith(tail) and len(text) > len(head) + len(tail):
            query = text[len(head) : len(text) - len(tail)]
            return task, query.split(CATEGORY_SEPARATOR) if task == "detect" else [query]
    return None


def _chat_head(grammar: str, num_images: int, rendering: str) -> str:
    """What comes before the user text: the system turn and the images not placed in `grammar` already."""
    if rendering not in _SYSTEM:
        raise ValueError(f"unknown rendering {rendering!r}; valid renderings: {', '.join(RENDERINGS)}")
    images = [f"<image-{k}>" for k in range(1, num_images + 1)]
    if rendering == "A":
        images = [p for p in images if p not in grammar]
    return f"{_SYSTEM[rendering]}<|im_start|>user\n{''.join(images)}"


def chat_text(user_text: str, num_images: int = 1, rendering: str = "A") -> str:
    """One user turn holding `num_images` images then `user_text`, with the generation prompt (docs/model.md §8.1).

    Images appear as `<image-K>` placeholders. Rendering A (the default, as trained) skips a placeholder the
    user text already contains; rendering B (`chat_template.json`) always inserts it.
    """
    return _chat_head(user_text, num_images, rendering) + user_text + _TAIL


def image_token_counts(grids: list[tuple[int, int]]) -> list[int]:
    """`<IMG_CONTEXT>` tokens per image: h * w / 4 for a patch grid (h, w) merged 2 x 2."""
    for h, w in grids:
        if h <= 0 or w <= 0 or h % 2 or w % 2:
            raise ValueError(f"image patch grid {h}x{w} must have positive even sides (2 x 2 merge)")
    return [h * w // 4 for h, w in grids]


def _check_placeholders(found: list[int], images: int) -> None:
    if sorted(found) != list(range(1, images + 1)):
        raise ValueError(
            f"prompt must hold each of <image-1>..<image-{images}> once (one per image grid); "
            f"found {', '.join(f'<image-{k}>' for k in found) or 'none'}"
        )


def _expand(text: str, counts: list[int]) -> str:
    """Replace each `<image-K>` (checked: `_check_placeholders`) by `<image K><img>` + `<IMG_CONTEXT>` x
    counts[K-1] + `</img>`."""

    def expand(m: re.Match) -> str:
        k = int(m.group(1))
        return f"<image {k}><img>{IMAGE_TOKEN * counts[k - 1]}</img>"

    return _PLACEHOLDER.sub(expand, text)


def prompt_string(chat: str, grids: list[tuple[int, int]]) -> str:
    """The tokenizer input of the reference: `chat` with every image placeholder expanded (docs/model.md §8.2)."""
    counts = image_token_counts(grids)
    _check_placeholders([int(m.group(1)) for m in _PLACEHOLDER.finditer(chat)], len(counts))
    return _expand(chat, counts)


def check_grammar(tokenizer: Tokenizer, grammar: str) -> None:
    """`ValueError` naming the first added token in `grammar` (a raw prompt, a template) that is not one of the
    model's grammar tokens."""
    for token in tokenizer.added_tokens_in(grammar):
        coordinate = _COORDINATE.fullmatch(token)
        if token not in GRAMMAR_TOKENS and not (coordinate and int(coordinate.group(1)) <= 1000):
            raise ValueError(
                f"a raw prompt must not contain {token!r}, a control token of the model's chat format; a raw "
                "prompt may hold the grammar tokens <ref> </ref> <box> </box> </c> <0>..<1000> and <image-K> "
                "placeholders (a query of any other task is read as plain text)"
            )


def encode_pieces(tokenizer: Tokenizer, pieces: Sequence[tuple[str, bool]]) -> list[int]:
    """Ids of the concatenated pieces, the `plain` ones read as plain text (no added token matched in them).

    Added tokens are matched whole before BPE and split the text around them, so encoding the text between the
    grammar pieces' added tokens as plain text gives `tokenizer.encode` of the whole when no plain piece holds
    an added token."""
    ids: list[int] = []
    run: list[str] = []
    for text, plain in pieces:
        if plain:
            run.append(text)
            continue
        at = 0
        for match in tokenizer.added_pattern.finditer(text):
            run.append(text[at : match.start()])
            ids += tokenizer.encode("".join(run), plain=True) if any(run) else []
            ids.append(tokenizer.added_tokens[match.group()])
            run, at = [], match.end()
        run.append(text[at:])
    if any(run):
        ids += tokenizer.encode("".join(run), plain=True)
    return ids


def prompt_ids(
    tokenizer: Tokenizer, user: str | UserText, grids: list[tuple[int, int]], rendering: str = "A"
) -> list[int]:
    """Token ids of the full prompt for the user text (a string is a raw prompt) and one image per patch grid
    (h, w); no BOS. Special tokens follow the module docstring's rule (`ValueError` for a refused one).

    For text without added tokens in its plain spans, equal to `tokenizer.encode(prompt_string(chat_text(...),
    grids))`, without running BPE over the image tokens.
    """
    user = user if isinstance(user, UserText) else UserText(user)
    # Image placeholders are the processor's, not tokens: they keep their meaning inside the user's words too.
    pieces = [
        (part, plain and not _PLACEHOLDER.fullmatch(part))
        for text, plain in user.pieces()
        for part in (_PLACEHOLDER_SPLIT.split(text) if plain else [text])
        if part
    ]
    grammar = "".join(t for t, plain in pieces if not plain)
    check_grammar(tokenizer, grammar)
    counts = image_token_counts(grids)
    pieces = [(_chat_head(grammar, len(grids), rendering), False), *pieces, (_TAIL, False)]
    found = [int(m.group(1)) for text, plain in pieces if not plain for m in _PLACEHOLDER.finditer(text)]
    _check_placeholders(found, len(counts))
    pieces = [(text if plain else _expand(text, [1] * len(counts)), plain) for text, plain in pieces]
    image_id = tokenizer.added_tokens[IMAGE_TOKEN]
    runs = iter(counts[k - 1] for k in found)
    ids = []
    for token in encode_pieces(tokenizer, pieces):
        ids.extend([token] * next(runs) if token == image_id else [token])
    return ids
