"""Video: `mlx-locate-video --video in.mp4 --query Q [--query ...] --fps 2 --out frames.jsonl
[--annotated out.mp4] [--mot tracks.txt]`.

Frames are sampled by time (for each multiple of 1 / fps, the first decoded frame at or after it, less half a
frame for timestamp rounding), decoded to RGB by
PyAV (the `[video]` extra) and sent through one batched engine, a bounded window of frames in flight.
`python -m mlx_locate.commands.video` runs the same `main`.

- `--out`: JSONL. The first line describes the run (`video`, `size`, the model, `fps`, the questions, the
  decoding settings, and `complete`: false until every sampled frame of the video has its line, then rewritten
  in place to true); then one line per sampled frame, in order, written, flushed and fsynced at once:
  `{"frame": i, "time": t, "results": [{"query": Q, "objects": [{..., "track": id}], "empty_labels": [...]}]}`,
  `frame` being the index of the decoded frame and `time` its timestamp in seconds. Rerunning resumes: frames
  already in the file are not decoded by the model again, a last line cut by an interruption is redone, and a
  file written with other settings is refused, naming them (`jsonl.check_settings`).
- A truncated or damaged video (`Sampler`) is decoded as far as it goes: packets that do not decode are
  skipped, and the frames read are located and written; a warning says what was not read and the header
  keeps `"complete": false`.
- Tracks: an IoU tracker per query and label (`IouTracker`): detections join the track whose predicted box
  (constant velocity) they overlap most, greedily by IoU; a track unseen for more than `TRACK_MAX_AGE` sampled
  frames ends. Ids are unique over the run.
- `--mot`: the tracks in MOT Challenge format, `frame,id,x,y,w,h,conf,-1,-1,-1` with 1-based frame numbers of
  the source video; points are left out.
- `--annotated`: the sampled frames with boxes, labels, confidences and track ids drawn, at the sampling rate;
  written to a `.partial` file renamed when complete.

Exit status: 0 when every sampled frame was read and located; 1 when the video was read only in part (the
warning above); 2 for errors a user can cause (a missing, empty, unreadable or unsupported video, an existing
output, bad options): one `error: ...` line, naming the problem in words, and the lines written so far stay.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import NamedTuple

from PIL import Image
from tqdm import tqdm

from .. import jsonl
from ..draw import draw_objects
from ..engine import EventKind
from ..locate import LocateModel
from ..metrics import iou
from ..parse import LocatedObject
from ..prompts import CATEGORY_SEPARATOR, task_text
from ..request import DEFAULT_TASK, Request, RequestError, Result
from . import flags
from .folders import Jsonl, OutputError

DEFAULT_FPS = 2.0
TRACK_IOU = 0.3  # a detection continues a track when it overlaps the track's predicted box this much
TRACK_MAX_AGE = 2  # sampled frames a track may go unseen before it ends
TRACK_POINT_RADIUS = 0.05  # points: the same, within this fraction of the frame's shorter side
ENCODERS = {".webm": ("libvpx-vp9", "libvpx")}  # by output suffix; anything else: H.264, else MPEG-4 part 2
DEFAULT_ENCODERS = ("libx264", "h264", "mpeg4")
EXTRA = 'pip install "mlx-locate[video]"'
WHAT = "mlx-locate-video"
LINE_STARTS = (b'{"video": ', b'{"frame": ')  # how the header and the frame lines begin (json.dumps keeps key order)


class VideoError(ValueError):
    """A video that cannot be read or written."""


def import_av():
    try:
        import av
    except ImportError:
        raise VideoError(f"mlx-locate-video needs PyAV: {EXTRA}") from None
    return av


# --- Reading ----------------------------------------------------------------------------------------------


class Frame(NamedTuple):
    index: int  # position among the decoded frames of the stream, from 0
    time: float  # seconds
    image: Image.Image  # RGB


class VideoInfo(NamedTuple):
    size: tuple[int, int]
    rate: Fraction | None  # average frames per second
    duration: float | None  # seconds
    frames: int | None  # as the container's index declares them


def video_info(path: str | Path) -> VideoInfo:
    """Size, frame rate, duration and frame count of the first video stream; `VideoError` when there is none."""
    av = import_av()
    with open_video(av, path) as container:
        return stream_info(av, container, video_stream(container, path))


def stream_info(av, container, stream) -> VideoInfo:
    duration = None
    if stream.duration is not None and stream.time_base is not None:
        duration = float(stream.duration * stream.time_base)
    elif container.duration is not None:
        duration = container.duration / av.time_base
    size = (stream.codec_context.width, stream.codec_context.height)
    return VideoInfo(size, stream.average_rate, duration, stream.frames or None)


CONTAINERS = (  # (what a video file starts with, its kind): a file FFmpeg cannot open that starts so is damaged
    (lambda head: head[4:8] in (b"ftyp", b"moov", b"mdat", b"free", b"wide", b"skip"), "an MP4 or MOV file"),
    (lambda head: head.startswith(b"\x1a\x45\xdf\xa3"), "a Matroska or WebM file"),
    (lambda head: head.startswith(b"RIFF") and head[8:12] == b"AVI ", "an AVI file"),
    (lambda head: head.startswith(b"OggS"), "an Ogg file"),
    (lambda head: head.startswith(b"FLV"), "an FLV file"),
    (lambda head: head.startswith(b"\x00\x00\x01\xba"), "an MPEG program stream"),
    (lambda head: head.startswith(b"\x30\x26\xb2\x75"), "an ASF or WMV file"),
)


def ffmpeg_words(error: Exception) -> str:
    """FFmpeg's description of an error, without its errno."""
    return getattr(error, "strerror", None) or type(error).__name__


def open_video(av, path: str | Path):
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"video file not found: {path}")
    if not path.is_file():
        raise VideoError(f"{path} is not a file; expected a video file (MP4, MKV, WebM, ...)")
    if path.stat().st_size == 0:
        raise VideoError(f"{path} is empty (0 bytes); expected a video file (MP4, MKV, WebM, ...)")
    try:
        return av.open(str(path))
    except av.error.FFmpegError as e:
        with path.open("rb") as f:
            head = f.read(16)
        kind = next((kind for starts, kind in CONTAINERS if starts(head)), None)
        if kind is None:
            raise VideoError(
                f"{path} is not a video: FFmpeg reads no format in it ({ffmpeg_words(e)}; it starts with {head[:8]!r})"
            ) from None
        raise VideoError(
            f"{path} is truncated or damaged: it starts as {kind}, but FFmpeg cannot open it ({ffmpeg_words(e)})"
        ) from None


def video_stream(container, path: str | Path):
    if not container.streams.video:
        raise VideoError(f"{path} has no video stream")
    return container.streams.video[0]


class Sampler:
    """The frames of a video at `fps` (iterate): for each time k / fps, the first frame at or after it (half a
    source frame of slack for timestamp rounding), as RGB. Decoded as far as the file goes: a packet that does
    not decode is skipped, an error of the demuxer ends the frames; then `problem()` says what was not read."""

    def __init__(self, path: str | Path, fps: float):
        self.path, self.fps = path, fps
        self.info: VideoInfo | None = None
        self.stream_duration: float | None = None  # the video stream's own, not the container's
        self.decoded = self.sampled = self.skipped = 0  # frames decoded and given out, packets that failed
        self.last: float | None = None  # the last decoded frame's time
        self.error: str | None = None  # FFmpeg's words for the first failure

    def __iter__(self) -> Iterator[Frame]:
        av = import_av()
        with open_video(av, self.path) as container:
            stream = video_stream(container, self.path)
            stream.thread_type = "AUTO"
            self.info = stream_info(av, container, stream)
            if stream.duration is not None and stream.time_base is not None:
                self.stream_duration = float(stream.duration * stream.time_base)
            rate = float(stream.average_rate) if stream.average_rate else None
            slack = 0.5 / rate if rate else 1e-6
            next_time = 0.0
            for frame in self._decode(av, container, stream):
                t = frame.time if frame.time is not None else self.decoded / (rate or self.fps)
                self.decoded += 1
                self.last = t
                if t + slack < next_time:
                    continue
                next_time = (math.floor((t + slack) * self.fps) + 1) / self.fps
                self.sampled += 1
                yield Frame(self.decoded - 1, t, frame.to_image())

    def _decode(self, av, container, stream) -> Iterator:
        packets = container.demux(stream)
        while True:
            try:
                packet = next(packets)
            except StopIteration:
                return
            except av.error.FFmpegError as e:  # the file ends or breaks here
                self.error = self.error or ffmpeg_words(e)
                return
            try:
                yield from packet.decode()
            except av.error.FFmpegError as e:  # a damaged packet: the next ones may decode
                self.skipped += 1
                self.error = self.error or ffmpeg_words(e)

    def problem(self) -> str | None:
        """What the decoding did not read, in words (None when it read the whole video); after iterating.
        Without the stream's duration or frame count, an error of the demuxer is the only sign of a cut."""
        _, rate, duration, declared = self.info
        if self.stream_duration is not None and rate:  # the last frame within a frame and a half of the end
            short = (-1.0 if self.last is None else self.last) + 1.5 / float(rate) < self.stream_duration
        elif declared is not None:
            short = self.decoded < declared
        else:
            short = self.error is not None
        if not (short or self.skipped):
            return None
        parts = []
        if short and self.last is None:
            parts.append("not one frame decoded")
        elif short:
            length = "" if duration is None else f" of {duration:.2f} s"
            count = "" if declared is None else f", {self.decoded} of {declared} frames"
            parts.append(f"decoding ended at {self.last:.2f} s{length}{count}")
        if self.skipped:
            parts.append(f"{self.skipped} packet{'s' * (self.skipped != 1)} did not decode")
        words = f" ({self.error})" if self.error else ""
        expected = None if duration is None else math.ceil(duration * self.fps)
        sampled = f"{self.sampled} of {expected}" if expected and expected >= self.sampled else str(self.sampled)
        kind = "truncated or damaged" if short and self.skipped else "damaged" if self.skipped else "truncated"
        return f"{self.path} is {kind}: {'; '.join(parts)}{words}; {sampled} sampled frames read"


# --- Tracking ---------------------------------------------------------------------------------------------


@dataclass
class Track:
    id: int
    key: tuple  # (query, label): tracks never change class
    where: tuple[float, ...]  # last box (x1, y1, x2, y2) or point (x, y)
    velocity: tuple[float, ...]  # per sampled frame
    seen: int  # the sampled frame it was last seen in

    def predicted(self, frame: int) -> tuple[float, ...]:
        gap = frame - self.seen
        return tuple(w + v * gap for w, v in zip(self.where, self.velocity, strict=True))


class IouTracker:
    """Track ids for detections, one sampled frame at a time (module docstring)."""

    def __init__(self, frame_size: tuple[int, int]):
        self.radius = TRACK_POINT_RADIUS * min(frame_size)
        self.tracks: list[Track] = []
        self.frame = -1
        self.next_id = 1

    def similarity(self, track: Track, where: tuple[float, ...]) -> float | None:
        predicted = track.predicted(self.frame)
        if len(where) == 4:
            overlap = iou(predicted, where)
            return overlap if overlap >= TRACK_IOU else None
        distance = math.dist(predicted, where)
        return 1 - distance / self.radius if distance <= self.radius else None

    def update(self, detections: list[tuple[tuple, tuple[float, ...]]]) -> list[int]:
        """Track ids for this frame's `(key, box or point)` detections, in their order."""
        self.frame += 1
        pairs = sorted(
            (
                (s, i, j)
                for i, track in enumerate(self.tracks)
                for j, (key, where) in enumerate(detections)
                if key == track.key and len(where) == len(track.where)
                if (s := self.similarity(track, where)) is not None
            ),
            key=lambda p: (-p[0], p[1], p[2]),
        )
        ids: list[int | None] = [None] * len(detections)
        used: set[int] = set()
        for _, i, j in pairs:
            if i in used or ids[j] is not None:
                continue
            track, where = self.tracks[i], detections[j][1]
            gap = self.frame - track.seen
            track.velocity = tuple((n - o) / gap for n, o in zip(where, track.where, strict=True))
            track.where, track.seen = where, self.frame
            used.add(i)
            ids[j] = track.id
        for j, (key, where) in enumerate(detections):
            if ids[j] is None:
                self.tracks.append(Track(self.next_id, key, where, (0.0,) * len(where), self.frame))
                ids[j] = self.next_id
                self.next_id += 1
        self.tracks = [t for t in self.tracks if self.frame - t.seen <= TRACK_MAX_AGE]
        return ids


# --- Locating ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VideoSettings:
    """What a run asks; the JSONL's first line, compared on resume."""

    task: str
    queries: tuple[str | None, ...]
    prompt: str | None
    mode: str
    max_tokens: int
    fps: float
    tiles: str | tuple[int, int] | None
    tile_overlap: float
    tile_whole: bool
    decoding: dict = field(default_factory=dict)  # the other `Request` decoding fields (sampling, guards, ...)

    def requests(self, frame: Frame) -> list[Request]:
        tiling = {"tiles": self.tiles, "tile_overlap": self.tile_overlap, "tile_whole": self.tile_whole}
        return [
            Request(
                frame.image,
                q,
                task="raw" if self.prompt is not None else self.task,
                prompt=self.prompt,
                mode=self.mode,
                max_tokens=self.max_tokens,
                tag=(frame.index, i),
                **tiling,
                **self.decoding,
            )
            for i, q in enumerate(self.queries)
        ]

    def header(self, video: str | Path, size: tuple[int, int], model: dict) -> dict:
        """The JSONL's first line: the video, the model (`flags.model_settings`) and these settings, `complete`
        false until every sampled frame of the video has its line."""
        fields = {k: getattr(self, k) for k in self.__dataclass_fields__}
        return jsonl.plain({"video": str(video), "size": size, **model, **fields, "complete": False})


def frame_detections(line: dict) -> list[tuple[tuple, tuple[float, ...]]]:
    """The (key, box or point) of every object of a frame line, in order."""
    return [
        ((entry.get("query"), o.get("label")), tuple(o["box"] if o.get("box") is not None else o["point"]))
        for entry in line.get("results", [])
        for o in entry.get("objects", [])
    ]


def frame_line(frame: Frame, settings: VideoSettings, answers: list[Result | RequestError]) -> dict:
    """A frame's JSONL line (without track ids): per query its objects and empty labels, or its error."""
    results = []
    for query, answer in zip(settings.queries, answers, strict=True):
        if isinstance(answer, Result):
            results.append(
                {"query": query, "objects": answer.to_dict()["objects"], "empty_labels": answer.empty_labels}
            )
        else:
            results.append({"query": query, "error": str(answer)})
    return {"frame": frame.index, "time": round(frame.time, 6), "results": results}


def locate_frames(
    model: LocateModel,
    frames: Iterable[Frame],
    settings: VideoSettings,
    done: dict[int, dict] | None = None,
    max_rows: int | None = None,
) -> Iterator[tuple[Frame, dict, bool]]:
    """`(frame, line, new)` for every frame, in order, with track ids set on its objects.

    Frames in `done` (index -> its line from an earlier run) skip the model; the others go through one engine.
    At most `2 * rows` requests and as many frames are in flight, so memory does not grow with the video."""
    done = done or {}
    engine = model.engine(max_rows)
    window = max(2 * engine.max_rows, len(settings.queries))
    frames = iter(frames)
    queue: deque[tuple[Frame, list]] = deque()  # frames in order: their answers (or a line from `done`)
    answers_of: dict[int, list] = {}
    in_flight = 0
    tracker: IouTracker | None = None
    exhausted = False
    while True:
        while not exhausted and in_flight < window and len(queue) < window:
            frame = next(frames, None)
            if frame is None:
                exhausted = True
            elif frame.index in done:
                queue.append((frame, done[frame.index]))
            else:
                answers_of[frame.index] = [None] * len(settings.queries)
                queue.append((frame, answers_of[frame.index]))
                for request in settings.requests(frame):
                    engine.submit(request)
                    in_flight += 1
        while queue and (isinstance(queue[0][1], dict) or all(a is not None for a in queue[0][1])):
            frame, answers = queue.popleft()
            new = not isinstance(answers, dict)
            line = frame_line(frame, settings, answers) if new else answers
            if new:
                del answers_of[frame.index]
            tracker = tracker or IouTracker(frame.image.size)
            ids = iter(tracker.update(frame_detections(line)))
            for entry in line["results"]:
                for o in entry.get("objects", []):
                    o["track"] = next(ids)
            yield frame, line, new
        if exhausted and not queue:
            return
        for event in engine.step():
            if event.kind in (EventKind.DONE, EventKind.ERROR):
                index, i = event.handle.request.tag
                answers_of[index][i] = event.result if event.kind is EventKind.DONE else event.error
                in_flight -= 1


# --- Writing ----------------------------------------------------------------------------------------------


def line_objects(line: dict) -> list[LocatedObject]:
    """A frame line's objects as `LocatedObject`s labelled "#track label", for drawing."""
    out = []
    for entry in line["results"]:
        for o in entry.get("objects", []):
            label = f"#{o['track']} {o.get('label') or entry.get('query') or ''}".strip()
            box, point = o.get("box"), o.get("point")
            out.append(
                LocatedObject(
                    label,
                    None if box is None else tuple(box),
                    None,
                    None if point is None else tuple(point),
                    None,
                    o.get("confidence"),
                )
            )
    return out


def partial_path(path: Path) -> Path:
    return path.with_name(f"{path.stem}.partial{path.suffix}")


class AnnotatedVideo:
    """Frames with their objects drawn, encoded to a `.partial` file next to `path`; `close()` renames it."""

    def __init__(self, path: str | Path, rate: Fraction):
        av = import_av()
        self.av, self.path, self.partial = av, Path(path), partial_path(Path(path))
        try:
            self.container = av.open(str(self.partial), "w")
        except (av.error.FFmpegError, ValueError) as e:
            raise VideoError(f"cannot write {self.path}: {e}") from None
        self.codec = next((c for c in ENCODERS.get(self.path.suffix.lower(), DEFAULT_ENCODERS) if encodes(av, c)), None)
        if self.codec is None:
            self.container.close()
            raise VideoError(f"no video encoder for {self.path.suffix} files in this PyAV build; use .mp4")
        self.rate, self.stream, self.labels = rate, None, []

    def write(self, image: Image.Image, objects: list[LocatedObject]) -> None:
        self.labels += [o.label for o in objects if o.label not in self.labels]
        drawn = draw_objects(image, objects, labels=self.labels)
        width, height = drawn.size
        if width % 2 or height % 2:  # 4:2:0 chroma needs even sides: pad with black
            padded = Image.new("RGB", (width + width % 2, height + height % 2))
            padded.paste(drawn)
            drawn = padded
        if self.stream is None:
            self.stream = self.container.add_stream(self.codec, rate=self.rate)
            self.stream.width, self.stream.height = drawn.size
            self.stream.pix_fmt = "yuv420p"
        frame = self.av.VideoFrame.from_image(drawn)
        self.container.mux(self.stream.encode(frame))

    def close(self) -> None:
        if self.stream is not None:
            self.container.mux(self.stream.encode(None))
        self.container.close()
        os.replace(self.partial, self.path)

    def abandon(self) -> None:
        self.container.close()


def encodes(av, name: str) -> bool:
    try:
        av.Codec(name, "w")
    except (av.error.FFmpegError, ValueError):  # unknown, or a decoder only
        return False
    return True


def mot_rows(line: dict) -> Iterator[str]:
    """MOT Challenge rows of a frame line: `frame,id,x,y,w,h,conf,-1,-1,-1`, 1-based frames; boxes only."""
    for entry in line["results"]:
        for o in entry.get("objects", []):
            if o.get("box") is None:
                continue
            x1, y1, x2, y2 = o["box"]
            conf = o.get("confidence")
            conf = -1 if conf is None else round(conf, 4)
            yield f"{line['frame'] + 1},{o['track']},{x1:.2f},{y1:.2f},{x2 - x1:.2f},{y2 - y1:.2f},{conf},-1,-1,-1"


# --- Resuming ---------------------------------------------------------------------------------------------


def read_done(path: Path, header: dict) -> tuple[dict[int, dict], bool, list[str]]:
    """The frame lines of an earlier run at `path` (index -> line, track ids removed), whether the file has its
    header, and the settings that header does not record (`jsonl.check_settings`). A file that is not ours, a
    header from other settings or a line that is not a frame line raises `ValueError`, the file unchanged; then a
    last line of ours cut short (an interrupted write) is cut off the file."""
    if not path.exists():
        return {}, False, []
    text, tail = jsonl.complete_text(path, WHAT)
    done, unrecorded = {}, []
    if text.strip():
        lines = jsonl.values(text, path, jsonl.RESUME_HINT)
        try:
            _, first = next(lines)
        except ValueError:
            first = None
        if not isinstance(first, dict) or "video" not in first:
            raise ValueError(f"{path} is not a JSONL of {WHAT}; use another --out")
        recorded, wanted = ({k: v for k, v in h.items() if k != "complete"} for h in (first, header))
        unrecorded = jsonl.check_settings(path, recorded, wanted, "; use another --out to start over")
        for number, line in lines:
            if not isinstance(line, dict) or "frame" not in line or "results" not in line:
                raise ValueError(f"{path}:{number} is not a frame line of {WHAT}; use another --out")
            for entry in line["results"]:
                for o in entry.get("objects", []):
                    o.pop("track", None)
            done[line["frame"]] = line
    jsonl.cut_unfinished(path, tail, LINE_STARTS, WHAT)
    return done, bool(text.strip()), unrecorded


# --- Command line -----------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mlx-locate-video",
        description="Locate and track objects in a video with LocateAnything on MLX: JSONL per frame, MOT tracks, "
        "an annotated clip.",
    )
    flags.add_model(p)
    p.add_argument("--video", required=True, help="video file (anything FFmpeg reads: MP4, MKV, WebM, MOV, ...)")
    flags.add_questions(p, several_prompts=False)
    flags.add_categories(p)
    p.add_argument(
        "--fps", type=flags.positive_float, default=DEFAULT_FPS, help="frames per second to sample (default: 2)"
    )
    flags.add_rows(p)
    p.add_argument(
        "--out", required=True, type=flags.output_path, help="JSONL, one line per sampled frame; resumed if it exists"
    )
    p.add_argument(
        "--annotated", metavar="PATH", type=flags.output_path, help="write the sampled frames with boxes and tracks"
    )
    p.add_argument("--mot", metavar="PATH", type=flags.output_path, help="write the tracks in MOT Challenge format")
    flags.add_overwrite(p, "existing --annotated and --mot files")
    flags.add_progress(p)
    flags.add_decoding(p)
    flags.add_sampling(p)
    flags.add_tiling(p, "frame")
    flags.add_image_options(p)
    return p


def settings_of(args: argparse.Namespace) -> VideoSettings:
    """The run's settings; `ValueError` for a bad query, sampling or tiling value (before the model loads)."""
    task = args.task or DEFAULT_TASK
    categories = flags.categories_of(args)
    queries = (CATEGORY_SEPARATOR.join(categories),) if categories is not None else tuple(args.query or [None])
    if args.prompt is None:
        for query in queries:
            task_text(task, query)
    decoding = flags.request_options(args)
    tiling = flags.tiling_of(args)
    return VideoSettings(
        task=task,
        queries=queries if args.prompt is None else (None,),
        prompt=args.prompt,
        mode=decoding.pop("mode"),
        max_tokens=decoding.pop("max_tokens"),
        fps=args.fps,
        **tiling,
        decoding=decoding,
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    flags.check_questions(parser, args)
    flags.check_decoding(parser, args)
    flags.check_tiling_flags(parser, args)
    annotated = None
    try:
        settings = settings_of(args)
        flags.check_file_path(args.out, "--out", "frames.jsonl")
        for flag, path, example in (("--annotated", args.annotated, "annotated.mp4"), ("--mot", args.mot, "mot.txt")):
            if path is not None:
                flags.check_new_file(path, flag, example, args.overwrite)
        info = video_info(args.video)
        out = Path(args.out)
        header = settings.header(args.video, info.size, flags.model_settings(args))
        done, has_header, unrecorded = read_done(out, header)
        if unrecorded:
            print(jsonl.unrecorded_note(1, out), file=sys.stderr)  # the header
        rate = Fraction(args.fps).limit_denominator(1001)
        if info.rate:
            rate = min(rate, Fraction(info.rate))
        if args.annotated:
            annotated = AnnotatedVideo(args.annotated, rate)
        model = flags.load_model(args)
        written, problem = run(model, args, settings, info, out, header, done, has_header, annotated)
        annotated = None
    except (OSError, ValueError, OutputError) as e:  # OSError: a path that cannot be read or written
        if annotated is not None:
            annotated.abandon()
        print(f"error: {e}", file=sys.stderr)
        return 2
    if problem is not None:
        print(f'warning: {problem}; the header says "complete": false', file=sys.stderr)
    print(f"{written} frames located, {len(done)} resumed; lines in {args.out}", file=sys.stderr)
    return 0 if problem is None else 1


def run(
    model: LocateModel,
    args: argparse.Namespace,
    settings: VideoSettings,
    info: VideoInfo,
    out: Path,
    header: dict,
    done: dict[int, dict],
    has_header: bool,
    annotated: AnnotatedVideo | None,
) -> tuple[int, str | None]:
    """Locate every sampled frame, write its line, and the annotated clip and MOT file when asked; then mark the
    header complete when the whole video was read. Returns the number of frames the model decoded, and what
    the decoding did not read (None when nothing)."""
    total = None if info.duration is None else math.ceil(info.duration * settings.fps)
    if has_header:  # not complete while this run adds to it
        set_header(out, header)
    lines = Jsonl(out)
    mot: list[str] = []
    written = 0
    try:
        if not has_header:
            lines.write(header)
        frames = Sampler(args.video, settings.fps)
        with tqdm(total=total, unit="frame", disable=args.no_progress) as bar:
            for frame, line, new in locate_frames(model, frames, settings, done, args.max_rows):
                if new:
                    lines.write(line)
                    written += 1
                mot.extend(mot_rows(line))
                if annotated is not None:
                    annotated.write(frame.image, line_objects(line))
                bar.update(1)
    finally:
        lines.close()
    if annotated is not None:
        annotated.close()
    if args.mot:
        try:
            Path(args.mot).write_text("".join(row + "\n" for row in mot))
        except OSError as e:
            raise OutputError(f"cannot write {args.mot}: {e}") from e
    problem = frames.problem()
    if problem is None:
        set_header(out, {**header, "complete": True})
    return written, problem


def set_header(out: Path, header: dict) -> None:
    try:
        jsonl.set_first_line(out, header)
    except OSError as e:
        raise OutputError(f"cannot write {out}: {e}") from e


if __name__ == "__main__":
    raise SystemExit(main())
