"""mlx-vlm 0.7.10 (`mlx_vlm/models/locateanything`) as a benchmark peer; prints ONE JSON object.

Run with the peer virtualenv's python (benchmarks/README.md), not ours:

    LD_PRELOAD=$OPENBLAS .bench/venv/bin/python benchmarks/peer_mlxvlm.py --model DIR --image IMG \
        (--prompt-ids IDS | --query TEXT) --mode slow|fast|hybrid|generate [--max-tokens 64] [--repeat 3]
    .bench/venv/bin/python benchmarks/peer_mlxvlm.py --model DIR --image IMG... --query TEXT --mode batch \
        --batch-size 4 [--max-tokens 48]

`--model` is a checkpoint in the original Hugging Face layout (mlx-vlm's `load` renames it in `sanitize`).
Modes slow/fast/hybrid drive mlx-vlm's own `PBDDecoder` (what `Model.pbd_generate` runs), with its language model
wrapped to count forwards and its decision methods wrapped to record what each step committed. `generate` is
mlx-vlm's plain `stream_generate` (what `python -m mlx_vlm.generate` runs: greedy AR, stops on every eos id).
`batch` is mlx-vlm's `batch_generate` (greedy AR) over the images in calls of `--batch-size` images, each with
the same `--query`, after one warm-up call. `--prompt-ids` (a JSON list, or a JSON file holding a list or an
object with `input_ids`, such as a golden case) feeds exactly our prompt; `--query` renders it the mlx-vlm way
(Jinja template, no `<image K>`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import time
from pathlib import Path

MODES = ("slow", "fast", "hybrid", "generate", "batch")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, type=Path, help="checkpoint folder, original HF layout")
    p.add_argument("--image", required=True, type=Path, nargs="+", help="one image; with --mode batch, the folder")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt-ids", help="JSON list of ids, or a JSON file (list or object with input_ids)")
    src.add_argument("--query", help="task text, e.g. 'Locate all the instances that matches ...: red box.'")
    p.add_argument("--mode", choices=MODES, default="hybrid")
    p.add_argument("--batch-size", type=int, help="with --mode batch: images per batch_generate call (default 1)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeat", type=int, default=1, help="requests after load; timings are the median run")
    p.add_argument("--dtype", choices=("stored", "float32", "bfloat16"), default="stored")
    p.add_argument("--trace", action="store_true", help="include every step (kind, q_len, committed tokens)")
    return p


def blas_info() -> dict:
    """Which BLAS the process has mapped (call after a matmul has run)."""
    libs = set()
    with open("/proc/self/maps") as f:
        for line in f:
            path = line.split()[-1] if len(line.split()) >= 6 else ""
            name = os.path.basename(path).lower()
            if any(k in name for k in ("blas", "lapack", "mkl", "accelerate")):
                libs.add(path)
    preload = os.environ.get("LD_PRELOAD", "")
    return {
        "ld_preload": preload or None,
        "mapped": sorted(libs),
        # mlx's CPU wheel links a bundled reference BLAS (cblas_sgemm); a preloaded OpenBLAS takes its symbols.
        "effective": "openblas" if "openblas" in preload.lower() else "bundled (mlx_cpu.libs libblas)",
    }


def read_prompt_ids(arg: str) -> list[int]:
    text = Path(arg).read_text() if Path(arg).is_file() else arg
    data = json.loads(text)
    if isinstance(data, dict):
        data = data.get("input_ids")
    if not isinstance(data, list) or not all(isinstance(t, int) for t in data):
        raise ValueError("--prompt-ids: expected a JSON list of ints or an object with input_ids")
    return data


def count_boxes(ids: list[int], cfg) -> int:
    """Complete boxes `<box> c c c c </box>` and points `<box> c c </box>` in `ids`."""
    lo, hi = cfg.coord_start_token_id, cfg.coord_end_token_id
    n, i = 0, 0
    while i < len(ids):
        if ids[i] == cfg.box_start_token_id:
            for k in (4, 2):
                body, end = ids[i + 1 : i + 1 + k], ids[i + 1 + k : i + 2 + k]
                if len(body) == k and all(lo <= t <= hi for t in body) and end == [cfg.box_end_token_id]:
                    n += 1
                    i += k + 1
                    break
        i += 1
    return n


class CountingLM:
    """Stands in for `model.language_model` inside PBDDecoder: counts forwards, records their kind and q_len."""

    def __init__(self, lm, log: list):
        self._lm = lm
        self._log = log

    def __getattr__(self, name):
        return getattr(self._lm, name)

    def __call__(self, inputs=None, inputs_embeds=None, mask=None, cache=None, position_ids=None, **kw):
        x = inputs_embeds if inputs_embeds is not None else inputs
        kind = "mtp" if position_ids is not None else "ar"  # PBDDecoder passes position_ids only to block steps
        past = cache[0].offset if cache else 0
        self._log.append({"kind": kind, "q_len": int(x.shape[1]), "past_len": int(past), "t": time.perf_counter()})
        return self._lm(inputs, inputs_embeds=inputs_embeds, mask=mask, cache=cache, position_ids=position_ids, **kw)


def run_pbd(model, mode, input_ids, embeds, max_tokens, t_request):
    import mlx.core as mx
    from mlx_vlm.models.locateanything.pbd import PBDDecoder

    forwards: list[dict] = []
    steps: list[dict] = []
    decoder = PBDDecoder(model, generation_mode=mode)
    decoder.lm = CountingLM(model.language_model, forwards)
    consume, sample_ar = decoder._consume_block, decoder._sample_ar
    state = {"first_box": None, "ids": []}

    def record(out_type, tokens):
        state["ids"] += tokens
        now = time.perf_counter()
        if state["first_box"] is None and count_boxes(state["ids"], model.config):
            state["first_box"] = now - t_request
        steps.append({**forwards[-1], "out_type": out_type, "committed": list(tokens), "t_done": now})

    def consume_wrapped(block_logits):
        out_type, tokens = consume(block_logits)
        record(out_type, tokens)
        return out_type, tokens

    def sample_ar_wrapped(logits):
        out_type, token = sample_ar(logits)
        record(out_type, [token])
        return out_type, token

    decoder._consume_block = consume_wrapped
    decoder._sample_ar = sample_ar_wrapped
    cache = model.make_cache()
    t0 = time.perf_counter()
    ids = decoder.generate(input_ids, embeds, cache, max_tokens=max_tokens)
    t1 = time.perf_counter()
    mx.eval(mx.zeros(1))
    last = steps[-1] if steps else {}
    if last.get("out_type") == "im_end":
        if last["kind"] == "mtp":
            stop = "im_end_block"
        elif mode == "hybrid" and last["committed"] != [decoder.im_end]:
            stop = "hybrid_ar_stop"
        else:
            stop = "im_end"
    else:
        stop = "length_cap"
    prefill = steps[0]["t_done"] - t0 if steps else 0.0
    n_block = sum(s["kind"] == "mtp" for s in steps)
    return {
        "generated_ids": ids,
        "stop": stop,
        "committed_before_truncation": len(state["ids"]),
        "first_committed": len(steps[0]["committed"]) if steps else 0,
        "forwards": {"total": len(steps), "block": n_block, "ar": len(steps) - n_block},
        "t_prefill": prefill,
        "t_decode": t1 - t0 - prefill,
        "t_first_box": state["first_box"],
        "steps": [
            {k: s[k] for k in ("kind", "q_len", "past_len", "out_type", "committed")}
            | {"ms": round(1e3 * (s["t_done"] - s["t"]), 3)}
            for s in steps
        ],
    }


def run_plain(model, processor, prompt, image_path, max_tokens, t_request):
    from mlx_vlm.generate import stream_generate

    ids, t_first, t_first_box, last = [], None, None, None
    t0 = time.perf_counter()
    for r in stream_generate(model, processor, prompt, image=[str(image_path)], max_tokens=max_tokens, temperature=0.0):
        now = time.perf_counter()
        t_first = t_first or now
        if r.token is not None:
            ids.append(int(r.token))
            if t_first_box is None and count_boxes(ids, model.config):
                t_first_box = now - t_request
        last = r
    t1 = time.perf_counter()
    return {
        "generated_ids": ids,
        "stop": last.finish_reason if last else None,
        "committed_before_truncation": len(ids),
        "first_committed": 1,
        "forwards": {"total": len(ids), "block": 0, "ar": len(ids)},
        "t_prefill": (t_first or t1) - t0,  # includes preprocessing and vision: stream_generate does them inside
        "t_decode": t1 - (t_first or t1),
        "t_first_box": t_first_box,
        "mlxvlm_stats": {
            "prompt_tokens": last.prompt_tokens,
            "prompt_tps": last.prompt_tps,
            "generation_tps": last.generation_tps,
            "peak_memory_gb": last.peak_memory,
        }
        if last
        else None,
    }


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse what a mode cannot do (through `parser.error`: usage, the reason, exit status 2)."""
    batch = args.mode == "batch"
    if args.mode in ("generate", "batch") and args.query is None:
        parser.error(f"--mode {args.mode} needs --query (mlx-vlm renders and tokenizes the prompt itself)")
    if len(args.image) > 1 and not batch:
        parser.error(f"--mode {args.mode} takes one --image; several are for --mode batch")
    if args.batch_size is not None and not batch:
        parser.error("--batch-size is for --mode batch")
    if batch and (args.repeat != 1 or args.trace):
        parser.error("--mode batch times one run over every image after a warm-up call: no --repeat or --trace")
    if args.batch_size is not None and args.batch_size < 1:
        parser.error(f"--batch-size must be at least 1, got {args.batch_size}")
    if args.max_tokens < 1:
        parser.error(f"--max-tokens must be at least 1, got {args.max_tokens}")
    missing = [str(path) for path in args.image if not path.is_file()]
    if missing:
        parser.error(f"--image: no such file: {', '.join(missing)}")


def batches(items: list, size: int) -> list[list]:
    """`items` in consecutive calls of `size` (the last one shorter)."""
    return [items[i : i + size] for i in range(0, len(items), size)]


def ids_by_image(groups: list[list[int]], rows: list[list[list[int]]]) -> list[list[int]]:
    """Token ids per image in the caller's order, from `batch_generate`'s shape groups (image indices, in the
    order it ran them) and each group's rows (in the order it inserted them)."""
    if [len(g) for g in groups] != [len(r) for r in rows]:
        raise ValueError(f"batch_generate ran groups of {[len(r) for r in rows]} rows for images {groups}")
    out: list[list[int] | None] = [None] * sum(len(g) for g in groups)
    for group, group_rows in zip(groups, rows, strict=True):
        for index, ids in zip(group, group_rows, strict=True):
            out[index] = ids
    return out


def recording_generator(base: type, made: list) -> type:
    """A subclass of mlx-vlm's `BatchGenerator` that keeps the token ids it hands `batch_generate` (which keeps
    only text): each instance, one per shape group, joins `made` with its rows in insertion order."""

    class Recording(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.uids: list[int] = []
            self.ids: dict[int, list[int]] = {}
            made.append(self)

        def insert(self, *args, **kwargs):
            uids = super().insert(*args, **kwargs)
            self.uids += list(uids)
            return uids

        def next(self, **kwargs):
            prompts, generated = super().next(**kwargs)
            for r in generated:
                if r.finish_reason != "stop":  # batch_generate's own rule: the stop token is not output
                    self.ids.setdefault(r.uid, []).append(int(r.token))
            return prompts, generated

        def rows(self) -> list[list[int]]:
            return [self.ids.get(uid, []) for uid in self.uids]

    return Recording


def run_batch(model, processor, images: list[Path], query: str, batch_size: int, max_tokens: int) -> dict:
    """mlx-vlm's `batch_generate` over `images` in calls of `batch_size`, one `query` each, greedy (its default
    sampler), after one warm-up call on the first batch: seconds and images/s over the whole run, peak memory,
    the token ids per image."""
    import mlx.core as mx
    from mlx_vlm.generate import ar
    from mlx_vlm.utils import load_image

    made: list = []
    ar.BatchGenerator = recording_generator(ar.BatchGenerator, made)  # what batch_generate builds, per group

    def call(chunk: list[Path]):
        return ar.batch_generate(
            model, processor, images=[str(p) for p in chunk], prompts=[query] * len(chunk), max_tokens=max_tokens
        )

    chunks = batches(images, batch_size)
    t = time.perf_counter()
    call(chunks[0])
    warmup = time.perf_counter() - t
    made.clear()
    mx.reset_peak_memory()
    t = time.perf_counter()
    responses = [call(chunk) for chunk in chunks]
    seconds = time.perf_counter() - t
    peak = int(mx.get_peak_memory())
    ids: list[list[int]] = []
    for chunk in chunks:  # the groups batch_generate formed, from its own loader and grouping
        _, grouped = ar.group_images_by_shape([load_image(str(p)) for p in chunk])
        groups = list(grouped.values())
        ids += ids_by_image(groups, [made.pop(0).rows() for _ in groups])
    stats = [r.stats for r in responses]
    return {
        "batch_size": batch_size,
        "batch_calls": len(chunks),
        "images": len(images),
        "images_per_s": len(images) / seconds,
        "seconds": seconds,
        "warmup_seconds": warmup,
        "tokens_per_image": [len(x) for x in ids],
        "generated_ids": ids,
        "peak_memory_bytes": peak,
        "mlxvlm_stats": {
            "prompt_tokens": sum(s.prompt_tokens for s in stats),
            "prompt_s": sum(s.prompt_time for s in stats),
            "generation_tokens": sum(s.generation_tokens for s in stats),
            "generation_s": sum(s.generation_time for s in stats),
        },
    }


def describe(model, args: argparse.Namespace) -> dict:
    """What every report starts with: the peer, its versions, device, BLAS, checkpoint and dtype."""
    import mlx.core as mx
    import mlx_vlm
    import transformers

    return {
        "peer": "mlx-vlm",
        "versions": {
            "mlx_vlm": mlx_vlm.__version__,
            "mlx": mx.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
        },
        "device": str(mx.default_device()),
        "blas": blas_info(),
        "model": str(args.model),
        "dtype": args.dtype,
        "weights_dtype": str(model.language_model.model.embed_tokens.weight.dtype),
        "mode": args.mode,
        "max_tokens": args.max_tokens,
    }


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)

    import mlx.core as mx
    from mlx_vlm import load
    from mlx_vlm.prompt_utils import apply_chat_template
    from PIL import Image

    t = time.perf_counter()
    model, processor = load(str(args.model))
    if args.dtype != "stored":
        model.set_dtype(getattr(mx, args.dtype))
    mx.eval(model.parameters())
    t_load = time.perf_counter() - t
    cfg = model.config
    image_token = cfg.image_token_index
    tok = processor.tokenizer
    prompt_ids = read_prompt_ids(args.prompt_ids) if args.prompt_ids else None
    prompt_text = None
    if args.query is not None:
        prompt_text = apply_chat_template(processor, cfg, args.query, num_images=1)
    if args.mode == "batch":  # batch_generate renders each prompt as above
        out = run_batch(model, processor, args.image, args.query, args.batch_size or 1, args.max_tokens)
        out = describe(model, args) | {"query": args.query, "prompt_text": prompt_text} | out
        out["timings_s"] = {"load": t_load}
        out["max_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        json.dump(out, sys.stdout)
        sys.stdout.write("\n")
        return 0
    image_path = args.image[0]

    runs = []
    for _ in range(max(1, args.repeat)):
        mx.reset_peak_memory()
        t_request = time.perf_counter()
        image = Image.open(image_path)
        info = {"image_size": list(image.size)}
        if args.mode == "generate":
            res = run_plain(model, processor, prompt_text, image_path, args.max_tokens, t_request)
            t_pre = t_vis = None
        else:
            if prompt_ids is None:
                batch = processor(images=[image], text=[prompt_text])
                ids = batch["input_ids"]
            else:
                batch = processor.image_processor(image)
                ids = mx.array([prompt_ids])
            pixel_values, grid = batch["pixel_values"], batch["image_grid_hws"]
            shapes = batch["_grid_shapes"]
            mx.eval(ids, pixel_values)
            t_pre = time.perf_counter() - t_request
            t = time.perf_counter()
            feats = model.multi_modal_projector(
                model.vision_tower(pixel_values.transpose(0, 2, 3, 1), grid_thw=grid, grid_shapes=shapes)
            )
            mx.eval(feats)
            t_vis = time.perf_counter() - t
            n_img = int((ids == image_token).sum().item())
            if n_img != feats.shape[0]:
                raise SystemExit(
                    f"prompt has {n_img} image tokens but mlx-vlm's processor made {feats.shape[0]} features "
                    f"(grid {shapes}); the ids were made for another image size"
                )
            embeds = model.get_input_embeddings(ids, pixel_values, cached_image_features=feats).inputs_embeds
            mx.eval(embeds)
            info |= {"grid_hw": list(shapes[0]), "num_image_tokens": n_img, "prompt_len": int(ids.shape[1])}
            res = run_pbd(model, args.mode, ids, embeds, args.max_tokens, t_request)
        res["t_total"] = time.perf_counter() - t_request
        res["t_preprocess"], res["t_vision"] = t_pre, t_vis
        res["peak_memory_bytes"] = int(mx.get_peak_memory())
        res |= info
        runs.append(res)

    best = sorted(runs, key=lambda r: r["t_total"])[len(runs) // 2]  # the median run
    n_gen = len(best["generated_ids"])
    n_boxes = count_boxes(best["generated_ids"], cfg)
    decode = best["t_decode"]
    out = describe(model, args) | {
        "image": str(image_path),
        "prompt_source": "ids" if prompt_ids else "query",
        **{k: best.get(k) for k in ("image_size", "grid_hw", "num_image_tokens", "prompt_len")},
        "generated_ids": best["generated_ids"],
        "text": tok.decode(best["generated_ids"], skip_special_tokens=False),
        "num_generated": n_gen,
        "stop": best["stop"],
        "committed_before_truncation": best["committed_before_truncation"],
        "forwards": best["forwards"],
        "boxes": n_boxes,
        "timings_s": {
            "load": t_load,
            "preprocess": best["t_preprocess"],
            "vision": best["t_vision"],
            "prefill": best["t_prefill"],
            "first_box": best["t_first_box"],
            "decode": decode,
            "total": best["t_total"],
        },
        # Decode rates exclude the prefill forward and what it committed.
        "tokens_per_s": (n_gen - best["first_committed"]) / decode if decode > 0 else None,
        "blocks_per_s": (best["forwards"]["block"] - 1) / decode if best["forwards"]["block"] > 1 else None,
        "forwards_per_s": (best["forwards"]["total"] - 1) / decode if decode > 0 else None,
        "boxes_per_s": n_boxes / best["t_total"],
        "peak_memory_bytes": best["peak_memory_bytes"],
        "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "repeat": len(runs),
        "deterministic": all(r["generated_ids"] == runs[0]["generated_ids"] for r in runs),
        "runs_total_s": [r["t_total"] for r in runs],
    }
    if best.get("mlxvlm_stats"):
        out["mlxvlm_stats"] = best["mlxvlm_stats"]
    if args.trace and "steps" in best:
        out["steps"] = best["steps"]
    json.dump(out, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
