"""Scenes for tiling and video: large images of many small shapes, and clips of shapes moving in straight lines.

    python -c "from mlx_locate.synthetic.large_scenes import dense_scene; dense_scene(1).image.save('dense.png')"
    python -c "from mlx_locate.synthetic.large_scenes import write_clip; write_clip('shapes.mp4')"

Drawn like `scenes.make_scene` (same shapes, colours and background), so the demo model knows the shapes;
only the sizes differ: in a dense scene each shape sits in its own cell and is small next to the image, as
after the model's resize it is too small to find. A scattered scene places its shapes anywhere (tile seams
cross some of them); a seam scene puts one square across a seam of a tile grid, cut at a random fraction.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from .scenes import COLORS, Obj, Scene, draw_object, overlaps


def dense_scene(
    seed: int,
    size: tuple[int, int] = (560, 560),
    cell: int = 112,
    side: tuple[int, int] = (36, 56),
    fill: float = 0.6,
    shapes: tuple[str, ...] = ("square", "circle"),
) -> Scene:
    """A `size` image cut into `cell`-pixel cells; each cell holds one shape (probability `fill`) of a side
    drawn from `side`, placed at random inside it. Deterministic in `seed`."""
    rng = np.random.default_rng([7, seed])
    width, height = size
    background = tuple(int(v) for v in rng.integers(215, 245) + rng.integers(-6, 7, size=3))
    image = Image.new("RGB", size, background)
    draw = ImageDraw.Draw(image)
    objects = []
    for top in range(0, height - cell + 1, cell):
        for left in range(0, width - cell + 1, cell):
            if rng.random() >= fill:
                continue
            s = int(rng.integers(side[0], side[1] + 1))
            x, y = left + int(rng.integers(2, cell - s - 1)), top + int(rng.integers(2, cell - s - 1))
            obj = Obj(str(rng.choice(shapes)), str(rng.choice(list(COLORS))), (x, y, x + s, y + s))
            draw_object(draw, obj, COLORS[obj.color])
            objects.append(obj)
    return Scene(image, tuple(objects))


def scattered_scene(
    seed: int,
    size: tuple[int, int] = (1200, 900),
    count: tuple[int, int] = (20, 30),
    side: tuple[int, int] = (25, 45),
    shapes: tuple[str, ...] = ("square", "circle", "triangle"),
    gap: int = 8,
) -> Scene:
    """A `size` image of `count` shapes (sides from `side`) at random places, at least `gap` pixels apart, on
    no grid: seams of any tiling cross some of them. Deterministic in `seed`."""
    rng = np.random.default_rng([11, seed])
    image = Image.new("RGB", size, tuple(int(v) for v in rng.integers(220, 241, size=3)))
    objects: list[Obj] = []
    scatter(rng, size, objects, int(rng.integers(count[0], count[1] + 1)), side, shapes, gap)
    return drawn(image, objects)


def seam_scene(
    seed: int,
    tiles: list[tuple[int, int, int, int]],
    size: tuple[int, int] = (560, 560),
    side: tuple[int, int] = (40, 45),
    others: int = 6,
) -> Scene:
    """One square (its side from `side`) across a seam (an inner tile edge) of `tiles`, a grid of tile boxes over
    `size` (as `tiles.tile_boxes` cuts it), the seam at 15-85 % of its width or height, then `others` circles and
    triangles away from it. The square is the scene's first object. Deterministic in `seed` and `tiles`."""
    rng = np.random.default_rng([13, seed])
    image = Image.new("RGB", size, tuple(int(v) for v in rng.integers(220, 241, size=3)))
    rows, cols = len({b[1] for b in tiles}), len({b[0] for b in tiles})
    axis = int(rng.integers(0, 2)) if rows > 1 and cols > 1 else int(cols == 1)  # 0: a vertical seam
    extent = size[axis]
    seams = sorted({b[axis + 2] for b in tiles if b[axis + 2] < extent} | {b[axis] for b in tiles if b[axis] > 0})
    s = int(rng.integers(side[0], side[1] + 1))
    start = min(max(int(rng.choice(seams)) - round(rng.uniform(0.15, 0.85) * s), 0), extent - s)
    across = int(rng.integers(0, size[1 - axis] - s + 1))
    x, y = (start, across) if axis == 0 else (across, start)
    objects = [Obj("square", str(rng.choice(list(COLORS))), (x, y, x + s, y + s))]
    scatter(rng, size, objects, others, (side[0] - 15, side[1]), ("circle", "triangle"), 8)
    return drawn(image, objects)


def scatter(
    rng: np.random.Generator,
    size: tuple[int, int],
    objects: list[Obj],
    n: int,
    side: tuple[int, int],
    shapes: tuple[str, ...],
    gap: int,
) -> None:
    """Add `n` shapes of `shapes` (sides from `side`, random colours) to `objects`, each at a random place at
    least `gap` pixels from the others."""
    for _ in range(n):
        while True:
            s = int(rng.integers(side[0], side[1] + 1))
            x, y = int(rng.integers(0, size[0] - s + 1)), int(rng.integers(0, size[1] - s + 1))
            if not any(overlaps((x, y, x + s, y + s), o.box, gap) for o in objects):
                break
        objects.append(Obj(str(rng.choice(shapes)), str(rng.choice(list(COLORS))), (x, y, x + s, y + s)))


def drawn(image: Image.Image, objects: list[Obj]) -> Scene:
    draw = ImageDraw.Draw(image)
    for obj in objects:
        draw_object(draw, obj, COLORS[obj.color])
    return Scene(image, tuple(objects))


@dataclass(frozen=True)
class Mover:
    """A shape moving at constant speed (pixels per frame), bouncing off the frame's edges."""

    shape: str
    color: str
    start: tuple[float, float]  # top-left corner at frame 0
    velocity: tuple[float, float]
    side: int

    def box(self, frame: int, size: tuple[int, int] = (224, 224)) -> tuple[int, int, int, int]:
        corner = []
        for start, speed, extent in zip(self.start, self.velocity, size, strict=True):
            span = extent - self.side
            p = (start + speed * frame) % (2 * span)
            corner.append(round(p if p <= span else 2 * span - p))
        x, y = corner
        return (x, y, x + self.side, y + self.side)


def moving_frames(
    movers: tuple[Mover, ...], n_frames: int, size: tuple[int, int] = (224, 224)
) -> Iterator[tuple[Image.Image, tuple[Obj, ...]]]:
    """`n_frames` RGB frames of `movers` on a light background, each with its ground-truth objects."""
    for frame in range(n_frames):
        image = Image.new("RGB", size, (232, 230, 226))
        draw = ImageDraw.Draw(image)
        objects = tuple(Obj(m.shape, m.color, m.box(frame, size)) for m in movers)
        for obj in objects:
            draw_object(draw, obj, COLORS[obj.color])
        yield image, objects


DEMO_MOVERS = (  # three lanes, so no two shapes ever meet; 10-11 px between frames sampled at 2 fps of 10 fps
    Mover("square", "yellow", (10, 22), (2.0, 0.0), 48),
    Mover("circle", "orange", (150, 92), (-1.5, 0.0), 44),
    Mover("square", "green", (160, 162), (-2.2, 0.0), 52),
)


def write_clip(
    path: str | Path,
    movers: tuple[Mover, ...] = DEMO_MOVERS,
    n_frames: int = 30,
    size: tuple[int, int] = (224, 224),
    rate: int = 10,
    faststart: bool = False,
) -> Path:
    """An H.264 clip (MPEG-4 part 2 where PyAV has no H.264 encoder) of `moving_frames`; needs PyAV (the `video`
    extra). `faststart`: the index at the front of the file, as for streaming."""
    import av

    with av.open(str(path), "w", options={"movflags": "faststart"} if faststart else {}) as container:
        stream = container.add_stream("libx264" if "libx264" in av.codecs_available else "mpeg4", rate=rate)
        stream.width, stream.height = size
        stream.pix_fmt = "yuv420p"
        for image, _ in moving_frames(movers, n_frames, size):
            container.mux(stream.encode(av.VideoFrame.from_image(image)))
        container.mux(stream.encode(None))
    return Path(path)
