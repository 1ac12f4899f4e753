"""mlx_locate: NVIDIA LocateAnything grounding on Apple MLX, with Parallel Box Decoding."""

from .decide import Guards, Mode
from .engine import Engine, EngineEvent, EventKind, Handle
from .locate import LocateModel, load
from .parse import LocatedObject, parse_text
from .request import Request, RequestError, Result
from .sampling import Sampling
from .weights.checkpoint import DEMO_IMAGE

__all__ = [
    "DEMO_IMAGE",
    "Engine",
    "EngineEvent",
    "EventKind",
    "Guards",
    "Handle",
    "LocateModel",
    "LocatedObject",
    "Mode",
    "Request",
    "RequestError",
    "Result",
    "Sampling",
    "load",
    "parse_text",
]
