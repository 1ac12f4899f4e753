"""The vision of staged images, run in pieces behind the decode steps (`VisionAhead`).

While rows decode, the device waits for the host between steps. The engine stages the next waiting requests and a
`runtime.TowerJob` runs their images' tower and connector a few blocks at a time, each piece queued behind a step's
forward (behind the forward queued ahead, in an all-AR step), for the device to run while the host prepares the
next step. A piece is sized by the host's time per step at the tower's measured cost (`tower_block_s_of`) and by
how long the reads wait: one block more per piece while the reads wait about as long as the shortest wait seen,
one fewer when they wait longer.
"""

from __future__ import annotations

import mlx.core as mx

from .request import PreparedImage
from .runtime import Runtime, TowerJob


def tower_block_s_of(runtime: Runtime, job: TowerJob) -> float | None:
    """Seconds a block of `job`'s next piece takes at the cost measured for its patch grid (a grid not measured yet:
    at the dearest measured cost per patch); None before any measurement."""
    grid, images, _ = job.next_piece()
    cost = runtime.tower_block_s.get(grid)
    if cost is None:
        per_patch = [c / (g[0] * g[1]) for g, c in runtime.tower_block_s.items()]
        if not per_patch:
            return None
        cost = max(per_patch) * grid[0] * grid[1]
    return cost * images


class VisionAhead:
    """One engine's vision run ahead: the job under way (`job`, None when there is none), the pieces' size and what
    the reads' waits taught it. `blocks` fixed: `Schedule.tower_ahead` blocks a piece; None: sized as above."""

    def __init__(self, runtime: Runtime, blocks: int | None = None):
        self.runtime = runtime
        self.fixed_blocks = blocks
        self.job: TowerJob | None = None
        self.blocks_run = 0  # image-blocks of the tower run behind decode steps
        self.piece_blocks = 1  # blocks per piece, as the reads' waits show the device takes them
        self.wait_floor: dict[tuple[int, bool], float] = {}  # the shortest read wait seen, by cache rows and kind
        self.unread = 0.0  # expected seconds of the pieces queued since the last read (the next read waits on them)

    def start(self, images: list[PreparedImage]) -> None:
        """Start the vision of `images` (distinct content), to run in pieces behind the next steps."""
        if images:
            self.job = TowerJob(self.runtime, images)

    def queue(self, spare: float | None) -> None:
        """Queue the next piece behind the forward just queued: the fixed blocks, else `piece_blocks`, at most what
        the device runs in `spare` (the host's time this step) at the tower's measured cost."""
        job = self.job
        cost = None if job.done or spare is None else tower_block_s_of(self.runtime, job)
        if cost is None:
            return
        blocks = self.fixed_blocks
        if blocks is None:
            blocks = min(self.piece_blocks, int(spare / cost))
        if blocks <= 0:
            return
        _, images, blocks = job.next_piece(blocks)
        try:
            mx.async_eval(job.advance(blocks))
        except Exception:  # noqa: BLE001 - not the decoding rows' failure: admission redoes it, row by row
            self.job = None
            return
        self.blocks_run += images * blocks
        self.unread += blocks * cost

    def read(self, wait: float, kind: tuple[int, bool]) -> None:
        """After a step's read that waited `wait` seconds: one block more per piece while the read waited less than
        half the queued pieces' time longer than the shortest wait seen for reads of this `kind` (cache rows,
        whether of a forward queued a step ahead), one fewer (at least one) when it waited more."""
        floor = self.wait_floor[kind] = min(wait, self.wait_floor.get(kind, wait))
        if self.unread > 0:
            longer = wait - floor > self.unread / 2
            self.piece_blocks = max(1, self.piece_blocks - 1) if longer else self.piece_blocks + 1
        self.unread = 0.0

    def finish(self) -> dict[tuple, mx.array] | None:
        """Run what is left of the job now; its features by image key (None without a job)."""
        job = self.job
        if job is None:
            return None
        while not job.done:
            self.runtime.run_piece(job)
        self.job, self.unread = None, 0.0
        return job.features
