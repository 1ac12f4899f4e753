"""Where a folder's tokens at 16 rows part from one row's: for every image that differs, the ids and the
probability of each around the first difference, and how far the probabilities of the tokens both runs share
move. Fast and slow mode, the demo model (its default dtype: bf16 on a GPU) on the bench's folder.

    python benchmarks/parity_probe.py [--images 64] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench import folder_images, parting, tf32_setting  # noqa: E402

import mlx_locate  # noqa: E402
from mlx_locate import Request  # noqa: E402


def around(values: list, at: int) -> list:
    return values[max(0, at - 2) : at + 3]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    model = mlx_locate.load("demo")
    with tempfile.TemporaryDirectory() as work:
        paths, query = folder_images("demo", (640, 480), args.images, Path(work))
        report = {
            "device": str(mx.default_device()),
            "dtype": str(model.runtime.network.language_model.model.norm.weight.dtype),
            "mlx_enable_tf32": tf32_setting(),
        }
        model.runtime.measure_rows(16)
        for mode in ("fast", "slow"):
            runs = {}
            for rows in (1, 16):
                engine = model.engine(rows)
                handles = [engine.submit(Request(p, query, mode=mode, max_tokens=128)) for p in paths]
                engine.run()
                runs[rows] = [h.result for h in handles]
            drift, differing = 0.0, []
            for i, (one, many) in enumerate(zip(runs[1], runs[16], strict=True)):
                at = parting(one.token_ids, many.token_ids)
                shared = len(one.token_ids) if at is None else at
                moved = [abs(p - q) for p, q in zip(one.token_probs[:shared], many.token_probs[:shared], strict=True)]
                drift = max([drift, *moved])
                if at is not None:
                    differing.append(
                        {
                            "image": i,
                            "at_token": at,
                            "ids_1_row": around(one.token_ids, at),
                            "ids_16_rows": around(many.token_ids, at),
                            "probs_1_row": [round(p, 4) for p in around(one.token_probs, at)],
                            "probs_16_rows": [round(p, 4) for p in around(many.token_probs, at)],
                        }
                    )
            report[mode] = {"max_prob_change_of_shared_tokens": drift, "differing": differing}
            print(mode, json.dumps(report[mode]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
