"""Hugging Face (or mlx-vlm) LocateAnything checkpoint -> MLX checkpoint folder; see `mlx_locate.commands.convert`.

    python convert/convert_hf.py --hf-path nvidia/LocateAnything-3B --mlx-path LocateAnything-3B-q8 --quantize q8

The same command as `mlx-locate-convert` after `pip install`.
"""

import sys
from pathlib import Path

try:
    from mlx_locate.commands.convert import main
except ModuleNotFoundError:  # run from a checkout without `pip install`: import the package next to this folder
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from mlx_locate.commands.convert import main

if __name__ == "__main__":
    sys.exit(main())
