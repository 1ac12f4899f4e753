"""Several detection categories in one request: checked, merged when repeated, and by default decoded one per
row (split) and joined back into one `Result`.

A joint prompt (`"car</c>person</c>..."`) loses objects and corrupts labels as the list grows. Split, each
category is its own row of the engine's batch (`SplitRequest`, a request of several views as a tiled one is): the
rows share the image's vision and prompt prefix and prefill only their own words, and an absent category ends in a
step or two. `Request.joint` (or `strict`) keeps the reference's single prompt.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import replace

from .prompts import CATEGORY_SEPARATOR
from .request import EngineEvent, EventKind, Handle, PreparedImage, Request, RequestError, Result
from .tiles import SUMMED_STATS, TiledRequest, answer_text

# What a category name may not hold: the model's control and grammar tokens, coordinates, image placeholders.
_CONTROL = re.compile(r"<\|[^<>|]*\|>|</?(?:ref|box|img|c)>|<IMG_CONTEXT>|<image-?\s*\d+>|<\d{1,4}>|<null>")


def category_names(query: str | list[str] | None, merge: bool = True) -> list[str]:
    """The categories of a detect query (a list, or one string joined by `</c>`), stripped; `RequestError` for no
    name, an empty name or one holding a control token or `</c>`. With `merge`, a repeated name is kept once (first
    place) with a warning."""
    parts = query.split(CATEGORY_SEPARATOR) if isinstance(query, str) else list(query or [])
    if not parts:
        raise RequestError(f"categories must be a non-empty list of names, got {query!r}")
    names = []
    for i, part in enumerate(parts):
        if not isinstance(part, str):
            raise RequestError(f"category {i + 1} must be text, got {part!r}")
        name = part.strip()
        if not name:
            raise RequestError(f"category {i + 1} of {len(parts)} is empty; give every category a name")
        if CATEGORY_SEPARATOR in name or (token := _CONTROL.search(name)):
            found = CATEGORY_SEPARATOR if CATEGORY_SEPARATOR in name else token.group()
            raise RequestError(f"category {name!r} holds {found!r}, a token of the model's grammar; use plain words")
        names.append(name)
    if merge and len(set(names)) < len(names):
        repeated = sorted({n for n in names if names.count(n) > 1})
        warnings.warn(f"repeated categories merged: {', '.join(repeated)}", UserWarning, stacklevel=2)
        names = list(dict.fromkeys(names))
    return names


def is_multi(request: Request) -> bool:
    """Whether `request` is a detect query of categories: a list (of any length, so each name is checked) or a
    string joined by `</c>`."""
    if request.prompt is not None or request.task != "detect":
        return False
    q = request.query
    return isinstance(q, list) or (isinstance(q, str) and CATEGORY_SEPARATOR in q)


def split_categories(request: Request) -> tuple[list[str], list[Request]]:
    """The categories of a multi-category detect request and its child requests, one per category (`tag` = the
    category); no children when it decodes jointly (`joint`, `strict`, or one category left after merging
    repeats)."""
    names = category_names(request.query, merge=not request.strict)
    if request.joint or request.strict or len(names) < 2:
        return names, []
    return names, [replace(request, query=name, joint=True, tag=name) for name in names]


def category_pieces(name: str, result: Result) -> list[str]:
    """One category's row as answer text, in the model's grammar, one piece per item (its objects, or
    `<box>None</box>` when it has none), every object under the category's name."""
    if not result.objects:
        return [answer_text([], [name])]
    first, *rest = result.objects
    return [answer_text([replace(first, label=name)], [])] + [answer_text([replace(o, label=None)], []) for o in rest]


def merge_categories(names: list[str], results: list[Result]) -> Result:
    """One `Result` from the rows of a split request: each row's objects labelled with its category, in category
    order; a category with no object among `empty_labels`. Counts are summed over the rows (`row_steps`: their
    steps), times and `steps` are the longest row's (the rows step together); per category under
    `stats["categories"]`."""
    objects = [replace(o, label=name) for name, r in zip(names, results, strict=True) for o in r.objects]
    empty = [name for name, r in zip(names, results, strict=True) if not r.objects]
    # Counts are summed; the rows run side by side, so times and `steps` are the longest row's.
    stats: dict = {k: sum(r.stats.get(k) or 0 for r in results) for k in SUMMED_STATS if not k.endswith("_s")}
    stats["row_steps"] = stats["steps"]
    for key in (
        "steps",
        "max_tokens",
        "compilations",
        "peak_memory_gb",
        *(k for k in SUMMED_STATS if k.endswith("_s")),
    ):
        stats[key] = max(r.stats.get(key) or 0 for r in results)
    for key in ("first_step_s", "first_box_s"):
        values = [r.stats[key] for r in results if r.stats.get(key) is not None]
        stats[key] = min(values) if values else None
    stats["vision_cached"] = all(r.stats.get("vision_cached") for r in results)
    stats["max_tokens_clipped"] = any(r.stats.get("max_tokens_clipped") for r in results)
    reasons = [r.stats.get("stop_reason") for r in results]
    stats["stop_reason"] = "length_cap" if "length_cap" in reasons else max(set(reasons), key=reasons.count)
    sources: dict[str, int] = {}
    for r in results:
        for name, n in (r.stats.get("sources") or {}).items():
            sources[name] = sources.get(name, 0) + n
    stats["sources"] = sources
    stats["categories"] = [
        {
            "category": n,
            "objects": len(r.objects),
            "steps": r.stats.get("steps"),
            "stop_reason": r.stats.get("stop_reason"),
        }
        for n, r in zip(names, results, strict=True)
    ]
    return Result(
        objects=objects,
        empty_labels=empty,
        text="".join(p for name, r in zip(names, results, strict=True) for p in category_pieces(name, r)),
        prompt_ids=[],
        token_ids=[t for r in results for t in r.token_ids],
        token_probs=[p for r in results for p in r.token_probs],
        grid=results[0].grid,
        image_size=results[0].image_size,
        mode=results[0].mode,
        truncated=any(r.truncated for r in results),
        stats=stats,
        orientation=results[0].orientation,  # the rows share one prepared image
        warnings=results[0].warnings,
    )


class SplitRequest(TiledRequest):
    """A split request: one view per category (`names`), each the category's own row, joined by `merge_categories`."""

    def __init__(self, handle: Handle, image: PreparedImage, requests: list[Request], names: list[str]):
        super().__init__(handle, image, requests)
        self.names = names

    def joined(self, child: Handle) -> list[EngineEvent]:
        """A category's row finished: its text (with `text`) once the categories before it have finished, in
        category order; when every row has, the parent's objects and its merged result."""
        parent, children = self.handle, self.children
        done = [c.result is not None for c in children]
        at = children.index(child)
        events = []
        if parent.text and all(done[:at]):
            for k in range(at, done.index(False) if False in done else len(done)):
                for piece in category_pieces(self.names[k], children[k].result):
                    events.append(EngineEvent(parent, EventKind.TEXT, text=piece))
        if not all(done):
            return events
        self.over = True
        return events + self.finished(merge_categories(self.names, [c.result for c in children]))
