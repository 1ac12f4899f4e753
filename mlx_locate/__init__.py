"""mlx_locate: NVIDIA LocateAnything grounding on Apple MLX, with Parallel Box Decoding."""

from .decide import Guards, Mode
from .locate import LocateModel, Result, load
from .parse import LocatedObject
from .sampling import Sampling

__all__ = ["Guards", "LocateModel", "LocatedObject", "Mode", "Result", "Sampling", "load"]
