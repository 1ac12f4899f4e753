"""Scenes for tiling and video: large images of many small shapes, and clips of shapes moving in straight lines.

    python -c "from mlx_locate.tuner.large_scenes import dense_scene; dense_scene(1).image.save('dense.png')"
    python -c "from mlx_locate.tuner.large_scenes import write_clip; write_clip('shapes.mp4')"


Drawn like `synthetic.make_scene` (same shapes, colours and background), so the demo model knows the shapes;
only the sizes differ: in a dense scene each shape sits in its own cell and is small next to the image, as
after the model's resize it is too small to find.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from .synthetic import COLORS, Obj, Scene, _draw


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
            _draw(draw, obj, COLORS[obj.color])
            objects.append(obj)
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
            _draw(draw, obj, COLORS[obj.color])
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
) -> Path:
    """An H.264 clip (MPEG-4 part 2 where PyAV has no H.264 encoder) of `moving_frames`; needs PyAV."""
    from ..video import encodes, import_av

    av = import_av()
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264" if encodes(av, "libx264") else "mpeg4", rate=rate)
        stream.width, stream.height = size
        stream.pix_fmt = "yuv420p"
        for image, _ in moving_frames(movers, n_frames, size):
            container.mux(stream.encode(av.VideoFrame.from_image(image)))
        container.mux(stream.encode(None))
    return Path(path)
