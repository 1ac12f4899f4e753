"""Large and dense images by tiling: overlapping crops decoded as one batch, their objects merged in image pixels.

The model sees at most `in_token_limit` patches (25,600 for the 3B release): a larger image is scaled down
first and its small objects shrink with it. `split_request` cuts the image into overlapping tiles (plus, with
`tile_whole`, the whole image); the engine decodes them together as one `TiledRequest` and `merge_results` maps
every object back to the image and merges the duplicates that tiles share:

- `tiles="auto"`: the fewest tiles (at most `MAX_TILES`, none more elongated than `MAX_TILE_ASPECT` or the
  image) that each fit the patch budget unscaled, so every object reaches the model at its own pixel size,
  never smaller than in the image; ties go to the squarest tiles. An image that already fits (or a 1 x 1
  grid) needs no tiles: the request is decoded as it is, the untiled result exactly. `(rows, cols)` gives
  the grid.
- Merging decides by geometry (confidence only where geometry cannot, last point), across views and within one
  (SAHI's greedy merge): per label, an object joins another when their boxes' intersection is at least
  `MERGE_IOS` of the smaller box, or their points lie within `POINT_RADIUS` of a tile's shorter side. A box
  touching an inner seam of its tile is a piece: it joins any overlapping box of another tile that lies inside
  that tile and reaches past its own (the model often draws a piece wider than what it sees). So does a box
  that an uncut box of another tile reaching its tile's seam overlaps by `PIECE_IOS` of the smaller box (the
  piece drawn shifted away from the seam). A group keeps the box of a view that saw the whole object (not cut
  by a seam, no uncut box of another tile reaching past its tile), a tile before the whole image, then one past
  whose tile no other tile saw an edge of the object, the box the others agree with most, the most confident;
  and the group's best confidence. A tile box covering the whole tile is a piece of something larger than the
  tile and is dropped (the whole image sees such objects).
- Then the tiles vote (`outvoted`): a tile holds a box lying at least `HOLD_MARGIN` of its side inside its inner
  edges (it saw the object whole, at full scale, away from the crop's edge). An object is dropped when at least
  as many tiles held it and found nothing of its label overlapping it as views found it: what one tile drew and
  the tile beside it, seeing the same pixels, did not. An object only the whole image found, no larger than a
  tile, is dropped too when a tile found another object of its label there (the whole image's box is coarse).
- An object that one view alone found and no tile outvoted, which geometry can neither confirm nor drop
  (`unconfirmed`), is kept only when its confidence is at least `LONE_CONFIDENCE` of the median confidence of
  the request's objects of its label, over every view: relative to how sure the model is on this image, not an
  absolute number. An object without a confidence (no token probabilities) is kept; single-instance tasks keep
  their most confident object.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import NamedTuple

from PIL import Image

from .metrics import iou
from .parse import LocatedObject
from .preprocess import MERGE, target_size
from .request import EngineEvent, EventKind, Handle, PreparedImage, Request, Result, as_request_error

MAX_TILES = 64  # tiles per image (auto or given); bounds what one request may cost
MAX_TILE_ASPECT = 1.5  # auto tiles are at most this elongated (or as elongated as the image)
MAX_OVERLAP = 0.5  # fraction of a tile shared with its neighbour
MERGE_IOS = 0.5  # boxes of one label whose intersection is this much of the smaller box are one object
PIECE_IOS = 0.15  # ... or this much, when one is a piece of the other (`piece_of`)
SEAM_MARGIN = 0.02  # a box edge within this fraction of a tile side from an inner seam is cut by it
SPAN_FRACTION = 0.9  # a tile box this wide and this high (fractions of the tile) is a seam artefact
HOLD_MARGIN = 0.03  # a tile holds a box lying this fraction of a tile side or more inside its inner edges
LONE_CONFIDENCE = 0.75  # an object one view alone found needs this fraction of the median confidence of its label
POINT_RADIUS = 0.05  # points of one label closer than this fraction of a tile's shorter side are one
SINGLE_TASKS = ("single", "gui")  # one instance asked: the merged answer keeps the most confident object
SUMMED_STATS = (
    "preprocess_s",
    "vision_s",
    "prefix_prefill_s",
    "prefill_s",
    "decode_s",
    "tokens",
    "steps",
    "block_steps",
    "ar_steps",
    "fallbacks",
    "label_redecodes",
    "host_reads",
)


class Tile(NamedTuple):
    """The crop a child request decodes; set as the child's `tag`."""

    box: tuple[int, int, int, int]  # x0, y0, x1, y1 in the image's pixels (x1, y1 exclusive)
    whole: bool  # the whole image rather than a crop


def parse_tiles(text: str) -> str | tuple[int, int]:
    """A `--tiles` value: "auto" or "ROWSxCOLS" (e.g. "2x3": 2 rows, 3 columns). Raises `ValueError`."""
    if text == "auto":
        return "auto"
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"expected 'auto' or ROWSxCOLS such as 2x3, got {text!r}")
    return int(parts[0]), int(parts[1])


def check_tiling(tiles: object, overlap: float) -> None:
    """Raise `ValueError` unless `tiles` is "auto" or (rows, cols) with 1 <= rows * cols <= MAX_TILES and
    0 <= overlap <= MAX_OVERLAP."""
    if not (isinstance(overlap, int | float) and 0 <= overlap <= MAX_OVERLAP):
        raise ValueError(f"tile_overlap must be a fraction from 0 to {MAX_OVERLAP}; got {overlap!r}")
    if tiles == "auto":
        return
    valid = (
        isinstance(tiles, tuple | list)
        and len(tiles) == 2
        and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in tiles)
    )
    if not valid:
        raise ValueError(f"tiles must be 'auto' or (rows, cols) with positive integers; got {tiles!r}")
    if tiles[0] * tiles[1] > MAX_TILES:
        raise ValueError(f"tiles {tiles[0]}x{tiles[1]} make {tiles[0] * tiles[1]} tiles; at most {MAX_TILES}")


def spans(length: int, n: int, overlap: float) -> list[tuple[int, int]]:
    """`n` intervals of equal length covering [0, length), neighbours sharing about `overlap` of a tile."""
    if n == 1:
        return [(0, length)]
    side = min(length, math.ceil(length / (n - (n - 1) * overlap)))
    return [(s, s + side) for s in (round(i * (length - side) / (n - 1)) for i in range(n))]


def tile_boxes(size: tuple[int, int], rows: int, cols: int, overlap: float) -> list[tuple[int, int, int, int]]:
    """The tiles of a `rows x cols` grid over an image of `size` = (W, H), in raster order."""
    return [(x0, y0, x1, y1) for y0, y1 in spans(size[1], rows, overlap) for x0, x1 in spans(size[0], cols, overlap)]


def auto_grid(size: tuple[int, int], in_token_limit: int, patch: int, overlap: float) -> tuple[int, int]:
    """The fewest (rows, cols) whose tiles the model sees unscaled, in at most `in_token_limit` patches after
    the stretch to whole merge units, and no more elongated than `MAX_TILE_ASPECT` (or the image); the
    squarest tiles on a tie. When no grid of at most `MAX_TILES` fits, the one with the smallest tiles."""
    width, height = size
    bound = max(MAX_TILE_ASPECT, width / height, height / width)

    def shape(grid: tuple[int, int]) -> tuple[bool, int, float]:
        (x0, x1), (y0, y1) = spans(width, grid[1], overlap)[0], spans(height, grid[0], overlap)[0]
        w, h = x1 - x0, y1 - y0
        try:
            sizes = target_size(w, h, in_token_limit, patch)
        except ValueError:  # a side the model cannot take at all
            return False, w * h, math.inf
        fits = sizes.scaled == (w, h) and (sizes.final[0] // patch) * (sizes.final[1] // patch) <= in_token_limit
        return fits, w * h, max(w / h, h / w)

    grids = [(r, c) for r in range(1, MAX_TILES + 1) for c in range(1, MAX_TILES // r + 1)]
    shaped = [(g, *shape(g)) for g in grids]
    shaped = [s for s in shaped if s[3] <= bound]
    fitting = [(g[0] * g[1], aspect, g) for g, fits, _, aspect in shaped if fits]
    if fitting:
        return min(fitting)[2]
    return min((area, aspect, g) for g, _, area, aspect in shaped)[2]


def split_request(request: Request, image: Image.Image, in_token_limit: int, patch: int) -> list[Request]:
    """The child requests of a tiled request: one per tile (cropped image, `tag` = its `Tile`), and the whole
    image first when `request.tile_whole`. No children for a single tile: the image needs no tiles and the request
    is decoded as it is. Raises `ValueError` for a bad grid or overlap, or tiles smaller than the model's
    smallest input."""
    rows, cols = grid_of(request, image.size, in_token_limit, patch)
    if (rows, cols) == (1, 1):
        return []
    width, height = image.size
    boxes = tile_boxes(image.size, rows, cols, request.tile_overlap)
    smallest = MERGE * patch
    if min(min(x1 - x0, y1 - y0) for x0, y0, x1, y1 in boxes) < smallest:
        raise ValueError(
            f"a {width}x{height} image in {rows}x{cols} tiles gives tiles under {smallest} pixels a side; "
            "use fewer tiles"
        )
    tiles = [Tile(box, whole=False) for box in boxes]
    if request.tile_whole:
        tiles.insert(0, Tile((0, 0, width, height), whole=True))
    return [replace(request, image=image if t.whole else image.crop(t.box), tiles=None, tag=t) for t in tiles]


def view_count(request: Request, size: tuple[int, int], in_token_limit: int, patch: int) -> int:
    """How many views `split_request` makes of an image of `size` (1 for an untiled request), from the size
    alone: what the request costs. Raises `ValueError` for a bad grid or overlap."""
    if request.tiles is None:
        return 1
    rows, cols = grid_of(request, size, in_token_limit, patch)
    return 1 if (rows, cols) == (1, 1) else rows * cols + request.tile_whole


def grid_of(request: Request, size: tuple[int, int], in_token_limit: int, patch: int) -> tuple[int, int]:
    """The (rows, cols) of a tiled request's tiles on an image of `size`. Raises `ValueError` for a bad grid
    or overlap."""
    check_tiling(request.tiles, request.tile_overlap)
    if request.tiles == "auto":
        return auto_grid(size, in_token_limit, patch, request.tile_overlap)
    return tuple(request.tiles)


class TiledRequest:
    """A request of several views, each a child request decoded as its own row: a tiled request's tiles (and the
    whole image). `fan_out` makes the views' handles; `view_done` gives the parent's events as they finish: each
    view's result in the whole image's pixels (VIEW), and once every view has, the merged objects and result. A
    view that fails fails the request. `over` once the request has its result or error."""

    def __init__(self, handle: Handle, image: PreparedImage, requests: list[Request]):
        self.handle, self.image, self.requests = handle, image, requests
        self.children: list[Handle] = []
        self.over = False

    def fan_out(self, new_id: Callable[[], int]) -> list[Handle]:
        """The views' handles, in the parent's group (they take its turn)."""
        parent = self.handle
        self.children = [Handle(new_id(), r, parent=parent, group=parent.group) for r in self.requests]
        return self.children

    def view_done(self, child: Handle) -> list[EngineEvent]:
        """The parent's events now that its view `child` has its result or error."""
        if child.error is not None:
            self.over = True
            return [EngineEvent(self.handle, EventKind.ERROR, error=child.error)]
        return self.joined(child)

    def joined(self, child: Handle) -> list[EngineEvent]:
        """A view's result as a VIEW event; with the last one, the merged result (`merge_results`)."""
        parent, image = self.handle, self.image
        view, tile, size = self.children.index(child), child.request.tag, image.rgb.size
        objects = [to_image(o, tile, size) for o in child.result.objects]
        seen = replace(child.result, objects=objects, image_size=size)
        events = [EngineEvent(parent, EventKind.VIEW, result=seen, view=view, tile=tile)]
        if any(c.result is None for c in self.children):
            return events
        self.over = True
        try:
            result = merge_results(parent.request, image.rgb, self.requests, [c.result for c in self.children])
            result = replace(result, orientation=image.notes.orientation, warnings=list(image.notes.warnings))
        except (OSError, ValueError) as e:
            return events + [EngineEvent(parent, EventKind.ERROR, error=as_request_error(e))]
        return events + self.finished(result)

    def finished(self, result: Result) -> list[EngineEvent]:
        """The parent's merged objects, empty labels and result, as events."""
        parent = self.handle
        return (
            [EngineEvent(parent, EventKind.OBJECT, object=obj) for obj in result.objects]
            + [EngineEvent(parent, EventKind.EMPTY, label=label) for label in result.empty_labels]
            + [EngineEvent(parent, EventKind.DONE, result=result)]
        )


@dataclass
class Candidate:
    """One object of one view, mapped to the image's pixels."""

    object: LocatedObject
    view: int  # index of the child it came from
    tile: Tile
    seams: tuple[bool, bool, bool, bool]  # which of its box's edges (left, top, right, bottom) lie on a seam
    inner: tuple[bool, bool, bool, bool]  # which edges of its tile lie inside the image (seams)

    @property
    def cut(self) -> bool:
        """Its box touches a seam of its tile: the tile may have seen only part of the object."""
        return any(self.seams)


@dataclass
class Group:
    """Objects of one label, from any views, that are one object; `best` gives its box."""

    members: list[Candidate]
    best: Candidate


def to_image(obj: LocatedObject, tile: Tile, size: tuple[int, int]) -> LocatedObject:
    """`obj` from a tile's decoding, in pixels and 0..1000 values of the whole image of `size`."""
    if tile.whole:
        return obj
    x0, y0 = tile.box[:2]
    width, height = size

    def norm(values: tuple[float, ...]) -> tuple[int, ...]:
        return tuple(round(v / (width if i % 2 == 0 else height) * 1000) for i, v in enumerate(values))

    if obj.box is not None:
        box = (obj.box[0] + x0, obj.box[1] + y0, obj.box[2] + x0, obj.box[3] + y0)
        return replace(obj, box=box, box_norm=norm(box))
    if obj.point is not None:
        point = (obj.point[0] + x0, obj.point[1] + y0)
        return replace(obj, point=point, point_norm=norm(point))
    return obj


def seams(box: tuple[float, ...], tile: Tile, size: tuple[int, int]) -> tuple[tuple[bool, ...], bool]:
    """For a box in image pixels: which of its edges (left, top, right, bottom) lie on a seam of `tile` (within
    `SEAM_MARGIN` of a tile edge inside the image), and does it cover the whole tile (at least
    `SPAN_FRACTION` of both sides)."""
    if tile.whole:
        return (False,) * 4, False
    x0, y0, x1, y1 = tile.box
    mx, my = SEAM_MARGIN * (x1 - x0), SEAM_MARGIN * (y1 - y0)
    on = (
        x0 > 0 and box[0] - x0 <= mx,
        y0 > 0 and box[1] - y0 <= my,
        x1 < size[0] and x1 - box[2] <= mx,
        y1 < size[1] and y1 - box[3] <= my,
    )
    covers = box[2] - box[0] >= SPAN_FRACTION * (x1 - x0) and box[3] - box[1] >= SPAN_FRACTION * (y1 - y0)
    return on, covers


def area(box: tuple[float, ...]) -> float:
    return max(box[2] - box[0], 0.0) * max(box[3] - box[1], 0.0)


def intersection(a: tuple[float, ...], b: tuple[float, ...]) -> float:
    return area((max(a[0], b[0]), max(a[1], b[1]), min(a[2], b[2]), min(a[3], b[3])))


def over_smaller(a: tuple[float, ...], b: tuple[float, ...]) -> float:
    """Intersection over the smaller box's area (SAHI's IOS): 1 when one box lies inside the other."""
    smaller = min(area(a), area(b))
    return intersection(a, b) / smaller if smaller > 0 else 0.0


def beyond(box: tuple[float, ...], tile: Tile) -> tuple[bool, bool, bool, bool]:
    """Which edges of `box` (left, top, right, bottom) lie past `tile` by more than the seam margin."""
    x0, y0, x1, y1 = tile.box
    mx, my = SEAM_MARGIN * (x1 - x0), SEAM_MARGIN * (y1 - y0)
    return box[0] < x0 - mx, box[1] < y0 - my, box[2] > x1 + mx, box[3] > y1 + my


def outside(box: tuple[float, ...], tile: Tile) -> bool:
    """Whether `box` reaches past `tile`: the tile cannot have seen all of it."""
    return any(beyond(box, tile))


def reaches(box: tuple[float, ...], c: Candidate) -> bool:
    """Whether `box` reaches a seam of `c`'s tile or passes it: that tile saw at most the part of its object up
    to the seam."""
    x0, y0, x1, y1 = c.tile.box
    near = (box[0] <= x0, box[1] <= y0, box[2] >= x1, box[3] >= y1)
    return any(n and inner for n, inner in zip(near, c.inner, strict=True))


def piece_of(p: Candidate, k: Candidate) -> bool:
    """Whether `p` may be its tile's view of part of the object that `k`, another tile's uncut box, holds: `k`
    reaches a seam of `p`'s tile (`reaches`). The model draws such a piece anywhere from a sliver at the seam to
    a box wider than the object or shifted away from the seam."""
    return p.view != k.view and not p.tile.whole and not k.tile.whole and not k.cut and reaches(k.object.box, p)


def seen_past(m: Candidate, tile: Tile) -> bool:
    """Whether an edge of `m`'s box that its tile saw (on no seam of it) lies past `tile`."""
    return any(far and not seam for far, seam in zip(beyond(m.object.box, tile), m.seams, strict=True))


def agreement(kept: Candidate, c: Candidate) -> float | None:
    """How well `c` agrees with a group's kept object of its label, higher is closer; None when they are
    different objects. Boxes: their intersection is at least `MERGE_IOS` of the smaller box; or they overlap
    and one is a piece of the other (`piece_of`), however the model drew the piece. Points: within
    `POINT_RADIUS` of the shorter tile side."""
    a, b = kept.object, c.object
    if a.label != b.label:
        return None
    if a.box is not None and b.box is not None:
        ios = over_smaller(a.box, b.box)
        piece = c.cut and not kept.cut and not kept.tile.whole and outside(a.box, c.tile)
        shifted = ios >= PIECE_IOS and (piece_of(c, kept) or piece_of(kept, c))
        return ios if ios >= MERGE_IOS or (piece and ios > 0) or shifted else None
    if a.point is not None and b.point is not None:
        radius = POINT_RADIUS * min(min(t.box[2] - t.box[0], t.box[3] - t.box[1]) for t in (kept.tile, c.tile))
        distance = math.dist(a.point, b.point)
        return -distance if distance <= radius else None
    return None


def rank(c: Candidate) -> tuple:
    """The order `merge_objects` takes candidates in: uncut before cut, a tile before the whole image, the
    most confident first."""
    return (c.cut, c.tile.whole, -(c.object.confidence or 0.0))


def best_view(members: list[Candidate]) -> Candidate:
    """The member whose box a group keeps: from a view that saw the whole object (not cut by a seam, and no
    uncut box of another tile reaches past its tile), a tile before the whole image, then one past whose tile
    no other tile saw an edge, then the box the others agree with most (summed IoU), then the most
    confident. The whole image's boxes, drawn at a fraction of the resolution, say nothing about a tile's."""
    tiles = [m for m in members if m.object.box is not None and not m.tile.whole]

    def partial(c: Candidate) -> bool:
        return c.cut or any(not m.cut and outside(m.object.box, c.tile) for m in tiles if m is not c)

    def contradicted(c: Candidate) -> bool:
        return any(seen_past(m, c.tile) for m in tiles if m is not c)

    def consensus(c: Candidate) -> float:
        others = [m.object.box for m in members if m is not c and m.object.box is not None]
        return sum(iou(c.object.box, b) for b in others) if c.object.box is not None else 0.0

    def key(c: Candidate) -> tuple:
        return (partial(c), c.tile.whole, contradicted(c), -consensus(c), -(c.object.confidence or 0.0))

    return min(members, key=key)


def merge_objects(candidates: list[Candidate]) -> list[Group]:
    """Greedy merging (SAHI's greedy NMM, across views and within one): candidates in `rank` order each join
    the group whose kept object agrees most (`agreement`), or start one."""
    groups: list[Group] = []
    for c in sorted(candidates, key=rank):
        scored = [(s, i) for i, g in enumerate(groups) if (s := agreement(g.best, c)) is not None]
        if not scored:
            groups.append(Group([c], c))
            continue
        group = groups[max(scored)[1]]
        group.members.append(c)
        group.best = best_view(group.members)
    return groups


def holds(tile: Tile, box: tuple[float, ...], size: tuple[int, int]) -> bool:
    """Whether `tile` saw all of `box` clear of its inner edges (`HOLD_MARGIN` of its side or more inside
    them; an edge on the image's border needs no margin): where it sees an object whole."""
    x0, y0, x1, y1 = tile.box
    mx, my = HOLD_MARGIN * (x1 - x0), HOLD_MARGIN * (y1 - y0)
    return (
        (x0 == 0 or box[0] >= x0 + mx)
        and (y0 == 0 or box[1] >= y0 + my)
        and (x1 == size[0] or box[2] <= x1 - mx)
        and (y1 == size[1] or box[3] <= y1 - my)
    )


def extent(o: LocatedObject, tile: Tile) -> tuple[float, ...]:
    """Where an object lies: its box, or the square of `POINT_RADIUS` of `tile`'s shorter side around its point."""
    if o.box is not None:
        return o.box
    r = POINT_RADIUS * min(tile.box[2] - tile.box[0], tile.box[3] - tile.box[1])
    return o.point[0] - r, o.point[1] - r, o.point[0] + r, o.point[1] + r


def outvoted(group: Group, seen: list[Candidate], views: list[Tile], size: tuple[int, int]) -> bool:
    """Tiles, which see the image at full scale, outvote the group: at least as many tiles held its object
    (`holds`) and found nothing of its label there (nothing in `seen`, every object of every view, overlaps it)
    as views found it. An object only the whole image found and no larger than a tile is outvoted by one such
    tile, or by a tile that found something else of its label there (the tile's box stands)."""
    o = group.best.object
    where = extent(o, group.best.tile)
    found = {m.view for m in group.members}
    near = {c.view for c in seen if c.object.label == o.label and intersection(extent(c.object, c.tile), where) > 0}
    tile = next(t for t in views if not t.whole)  # the tiles share one size
    fits = where[2] - where[0] <= tile.box[2] - tile.box[0] and where[3] - where[1] <= tile.box[3] - tile.box[1]
    if fits and all(views[v].whole for v in found) and near - found:
        return True
    missed = [v for v, t in enumerate(views) if not t.whole and v not in found | near and holds(t, where, size)]
    return len(missed) >= len(found)


def confidence(group: Group) -> float | None:
    values = [m.object.confidence for m in group.members if m.object.confidence is not None]
    return max(values) if values else None


def answer_text(objects: list[LocatedObject], empty_labels: list[str | None]) -> str:
    """The merged answer in the model's grammar: `<ref>label</ref>` then its boxes or points, 0..1000."""
    parts: list[str] = []
    last: object = object()
    for obj in objects:
        if obj.label is not None and obj.label != last:
            parts.append(f"<ref>{obj.label}</ref>")
        last = obj.label
        values = obj.box_norm if obj.box_norm is not None else obj.point_norm
        parts.append("<box>" + "".join(f"<{v}>" for v in values) + "</box>")
    for label in empty_labels:
        parts.append(("" if label is None else f"<ref>{label}</ref>") + "<box>None</box>")
    return "".join(parts)


def merge_stats(children: list[Request], results: list[Result], kept: list[int], dropped: list[int]) -> dict:
    """Timings and counts summed over the views, and one entry per view under "tiles"."""
    stats: dict = {k: sum(r.stats.get(k) or 0 for r in results) for k in SUMMED_STATS}
    reasons = [r.stats.get("stop_reason") for r in results]
    stats["stop_reason"] = "length_cap" if "length_cap" in reasons else max(set(reasons), key=reasons.count)
    for key in ("first_step_s", "first_box_s"):
        values = [r.stats[key] for r in results if r.stats.get(key) is not None]
        stats[key] = min(values) if values else None
    stats["vision_cached"] = all(r.stats.get("vision_cached") for r in results)
    sources: dict[str, int] = {}
    for r in results:
        for name, n in (r.stats.get("sources") or {}).items():
            sources[name] = sources.get(name, 0) + n
    stats["sources"] = sources
    stats["compilations"] = max(r.stats.get("compilations") or 0 for r in results)
    for key in ("load_s", "compile_s"):  # the views decode together: the same load, compilations shared
        stats[key] = max(r.stats.get(key) or 0.0 for r in results)
    stats["max_tokens"] = results[0].stats.get("max_tokens")
    stats["max_tokens_clipped"] = any(r.stats.get("max_tokens_clipped") for r in results)
    stats["peak_memory_gb"] = max(r.stats.get("peak_memory_gb") or 0.0 for r in results)
    tiles = [c.tag for c in children if not c.tag.whole]
    stats["tile_grid"] = [max(1, len({t.box[1] for t in tiles})), max(1, len({t.box[0] for t in tiles}))]
    stats["tiles"] = [
        {
            "box": list(c.tag.box),
            "whole": c.tag.whole,
            "grid": r.grid,
            "objects": len(r.objects),
            "kept": k,
            "dropped": d,
            "steps": r.stats.get("steps"),
            "stop_reason": r.stats.get("stop_reason"),
        }
        for c, r, k, d in zip(children, results, kept, dropped, strict=True)
    ]
    return stats


def merged_groups(
    children: list[Request], results: list[Result], size: tuple[int, int]
) -> tuple[list[Group], list[Candidate], list[int]]:
    """The views' objects in the pixels of an image of `size`, merged (`merge_objects`) and voted on
    (`outvoted`): the groups kept, every object of every view (boxes covering their tile too) and how many
    boxes covering their tile each view dropped."""
    candidates: list[Candidate] = []
    seen: list[Candidate] = []
    dropped = [0] * len(children)
    for view, (child, result) in enumerate(zip(children, results, strict=True)):
        tile: Tile = child.tag
        for obj in result.objects:
            mapped = to_image(obj, tile, size)
            on, covers = seams(mapped.box, tile, size) if mapped.box is not None else ((False,) * 4, False)
            inner = (tile.box[0] > 0, tile.box[1] > 0, tile.box[2] < size[0], tile.box[3] < size[1])
            seen.append(Candidate(mapped, view, tile, on, inner))
            if covers:
                dropped[view] += 1
                continue
            candidates.append(seen[-1])
    views = [c.tag for c in children]
    return [g for g in merge_objects(candidates) if not outvoted(g, seen, views, size)], seen, dropped


def label_medians(seen: list[Candidate]) -> dict[str, float]:
    """The median confidence of the request's objects of each label (every object of every view, `seen`), for
    the labels that have confidences."""
    by_label: dict[str, list[float]] = {}
    for c in seen:
        if c.object.confidence is not None:
            by_label.setdefault(c.object.label, []).append(c.object.confidence)
    return {label: statistics.median(values) for label, values in by_label.items()}


def unconfirmed(group: Group, medians: dict[str, float]) -> bool:
    """Only one view found the group's object (no other view confirms it, and none outvoted it) and its
    confidence is under `LONE_CONFIDENCE` of its label's median (`label_medians`). An object or request without
    confidences is never unconfirmed."""
    conf = confidence(group)
    if conf is None or len({m.view for m in group.members}) > 1:
        return False
    return conf < LONE_CONFIDENCE * medians[group.best.object.label]


def merge_results(request: Request, image: Image.Image, children: list[Request], results: list[Result]) -> Result:
    """One `Result` for a tiled request, in the pixels of `image`: the views' objects mapped back and merged
    (module docstring), labels answered None by some view and found by none, the answer text rebuilt from
    the merged objects, and stats summed over the views (per view under `stats["tiles"]`)."""
    for r in results:
        if isinstance(r, Exception):
            raise r
    size = image.size
    groups, seen, dropped = merged_groups(children, results, size)
    if request.task in SINGLE_TASKS and groups:
        groups = [max(groups, key=lambda g: confidence(g) or 0.0)]
    else:
        medians = label_medians(seen)
        groups = [g for g in groups if not unconfirmed(g, medians)]
    kept = [0] * len(children)
    for g in groups:
        kept[g.best.view] += 1

    labels = list(
        dict.fromkeys([o.label for r in results for o in r.objects] + [e for r in results for e in r.empty_labels])
    )
    order = {label: i for i, label in enumerate(labels)}

    def position(g: Group) -> tuple:
        o = g.best.object
        where = o.box if o.box is not None else o.point
        return (order[o.label], *where[:2])

    objects = [replace(g.best.object, confidence=confidence(g)) for g in sorted(groups, key=position)]
    found = {o.label for o in objects}
    empty = [label for label in labels if label not in found and any(label in r.empty_labels for r in results)]
    return Result(
        objects=objects,
        empty_labels=empty,
        text=answer_text(objects, empty),
        prompt_ids=[],
        token_ids=[],
        token_probs=[],
        grid=results[0].grid,  # the whole image's when it was decoded (it comes first)
        image_size=size,
        mode=results[0].mode,
        truncated=any(r.truncated for r in results),
        stats=merge_stats(children, results, kept, dropped),
    )
