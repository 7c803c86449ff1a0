"""Time to prepare one image for a vision-language model, per image library.

"Prepare" starts from the encoded bytes (already base64-decoded) and ends with raw 8-bit RGB
pixels plus width and height: read the header and refuse an image over `--max-pixels` before
decoding; decode; apply the EXIF orientation; flatten alpha onto white; shrink so that the
longer edge is at most 1024 (Lanczos-class filter, never upscaling). Variants:
`pillow naive` opens, exif_transposes, converts and resizes (LANCZOS) the full-size image;
`pillow fast` uses thumbnail(reducing_gap=2): JPEG draft (DCT-domain reduce-on-decode) and
reduce() before the final Lanczos, then transposes and flattens the small image; `pillow
draft` is the same with reducing_gap=1, so draft/reduce do all they can; `pyvips thumbnail`
is thumbnail_buffer (shrink-on-load, autorotate), sRGB, flatten. Pillow rows are labelled
`pillow-simd` when Pillow-SIMD is the installed PIL.

One CPU (`--cpu`), libvips with one worker thread. Inputs are generated once (needs numpy
and Pillow) into `--images`: gradients plus coarse and fine noise, so they do not compress
trivially, as JPEG q90 (4:2:0; the 12 MP one has EXIF orientation 6, a phone held upright)
and PNG, and one RGBA PNG. Run each library with the Python that has it, from the repository
root; `--out` is merged across runs and the printed table covers all of them:

    python -m bench.micro.image_libs --libs pillow          # generates the inputs first
    /tmp/imgvenv-vips/bin/python -m bench.micro.image_libs --libs pyvips
    /tmp/imgvenv-simd/bin/python -m bench.micro.image_libs --libs pillow
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import re
import struct
import sys
import time
import zlib
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

# Before pyvips loads libvips: one worker thread, so every library gets one core.
os.environ.setdefault("VIPS_CONCURRENCY", "1")

LONG_EDGE = 1024
MAX_PIXELS = 1 << 25  # the dispatcher's default [dispatcher.input] max_image_pixels
# WIDTHxHEIGHT, then -rot6: EXIF orientation 6, -alpha: RGBA; the suffix gives the format.
INPUTS = [
    "640x480.jpg",
    "1920x1080.jpg",
    "4032x3024-rot6.jpg",
    "640x480.png",
    "1920x1080.png",
    "4032x3024.png",
    "1920x1080-alpha.png",
]

Prepared = tuple[bytes, int, int]
Variants = dict[str, Callable[[bytes], Prepared]]


class TooLarge(ValueError):
    """Refused from the header, before any pixel is decoded."""


def generate_inputs(directory: Path, seed: int) -> None:
    import numpy as np
    from PIL import Image

    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for name in INPUTS:
        w, h = map(int, re.match(r"(\d+)x(\d+)", name).groups())
        yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
        xx, yy = xx / w, yy / h
        base = np.stack([xx, yy, 0.5 + 0.5 * np.sin(6 * xx + 4 * yy)], axis=-1) * 255
        # Coarse noise looks like objects; fine noise like sensor grain (kills run-lengths).
        coarse = rng.integers(0, 256, (h // 48 + 2, w // 48 + 2, 3), dtype=np.uint8)
        coarse = np.asarray(Image.fromarray(coarse).resize((w, h), Image.Resampling.BICUBIC))
        pixels = 0.55 * base + 0.45 * coarse + rng.normal(0, 5, (h, w, 3))
        image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))
        if "-alpha" in name:
            a = 255 * (1 - np.hypot(xx - 0.5, yy - 0.5)) + rng.normal(0, 8, (h, w))
            image.putalpha(Image.fromarray(np.clip(a, 0, 255).astype(np.uint8)))
        options: dict[str, object] = {"quality": 90} if name.endswith(".jpg") else {}
        if "-rot6" in name:
            exif = Image.Exif()
            exif[0x0112] = 6  # Orientation: stored landscape, shown rotated 90 degrees CW
            options["exif"] = exif.tobytes()
        image.save(directory / name, **options)


def oversized_png(width: int = 10000, height: int = 10000) -> bytes:
    """A valid-looking PNG whose header claims far more pixels than it holds."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return (
            struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
        )

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\0" * 4))
        + chunk(b"IEND", b"")
    )


def fit(width: int, height: int) -> tuple[int, int]:
    scale = min(1.0, LONG_EDGE / max(width, height))
    return max(1, round(width * scale)), max(1, round(height * scale))


def pillow_variants(max_pixels: int) -> tuple[str, Variants] | None:
    try:
        import PIL
        from PIL import Image, ImageOps
    except ImportError:
        return None
    try:
        flavour = "pillow-simd" if metadata.version("Pillow-SIMD") else "pillow"
    except metadata.PackageNotFoundError:
        flavour = "pillow"

    def open_checked(data: bytes) -> Image.Image:
        image = Image.open(io.BytesIO(data))  # lazy: parses the header only
        if image.width * image.height > max_pixels:
            raise TooLarge(f"{image.width}x{image.height}")
        return image

    def to_rgb(image: Image.Image) -> Image.Image:
        if image.mode == "P" and "transparency" in image.info:
            image = image.convert("RGBA")
        if image.mode in ("RGBA", "LA", "PA", "RGBa"):
            image = image.convert("RGBA")
            flat = Image.new("RGB", image.size, (255, 255, 255))
            flat.paste(image, mask=image.getchannel("A"))
            return flat
        return image if image.mode == "RGB" else image.convert("RGB")

    def naive(data: bytes) -> Prepared:
        image = to_rgb(ImageOps.exif_transpose(open_checked(data)))
        size = fit(*image.size)
        if size != image.size:
            image = image.resize(size, Image.Resampling.LANCZOS)
        return image.tobytes(), image.width, image.height

    def shrink_first(gap: float) -> Callable[[bytes], Prepared]:
        def prepare(data: bytes) -> Prepared:
            image = open_checked(data)
            # The box is square, so shrinking before the rotation gives the same bound,
            # and rotating or flattening the small image is cheaper.
            image.thumbnail((LONG_EDGE, LONG_EDGE), Image.Resampling.LANCZOS, reducing_gap=gap)
            ImageOps.exif_transpose(image, in_place=True)
            image = to_rgb(image)
            return image.tobytes(), image.width, image.height

        return prepare

    # gap 2: draft/reduce stop at >= 2x the target, leaving real work to Lanczos;
    # gap 1: draft/reduce straight to >= the target, faster and a little less clean.
    label = f"{flavour} {PIL.__version__}"
    variants = {"naive": naive, "fast": shrink_first(2.0), "draft": shrink_first(1.0)}
    try:  # the worker's own path, where fairq is importable (not in a bare venv)
        from workers.images import ImageRefused, prepare_image
    except ImportError:
        return label, variants

    def fairq(data: bytes) -> Prepared:
        try:
            prepared = prepare_image(data, 0, max_pixels, LONG_EDGE)
        except ImageRefused as refused:
            raise TooLarge(str(refused)) from None
        return prepared.rgb, prepared.width, prepared.height

    return label, {**variants, "fairq": fairq}


def pyvips_variants(max_pixels: int) -> tuple[str, Variants] | None:
    try:
        import pyvips
    except (ImportError, OSError):  # OSError: the binding is there but no libvips
        return None
    pyvips.cache_set_max(0)  # repeated calls on the same bytes must not hit the cache

    def thumbnail(data: bytes) -> Prepared:
        header = pyvips.Image.new_from_buffer(data, "", access="sequential")  # header only
        if header.width * header.height > max_pixels:
            raise TooLarge(f"{header.width}x{header.height}")
        image = pyvips.Image.thumbnail_buffer(data, LONG_EDGE, height=LONG_EDGE, size="down")
        if image.interpretation != "srgb":
            image = image.colourspace("srgb")
        if image.hasalpha():
            image = image.flatten(background=[255, 255, 255])
        if image.format != "uchar":
            image = image.cast("uchar")
        return image.write_to_memory(), image.width, image.height

    libvips = ".".join(str(pyvips.version(i)) for i in range(3))
    return f"pyvips {pyvips.__version__} (libvips {libvips})", {"thumbnail": thumbnail}


def measure(
    fn: Callable[[bytes], Prepared], data: bytes, min_reps: int, min_seconds: float
) -> tuple[list[float], Prepared]:
    out = fn(data)
    fn(data)  # warm-up: the first calls pay for lazy plugin loading
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_reps or time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter()
        fn(data)
        times.append((time.perf_counter() - t0) * 1e3)
    return times, out


def fingerprint(pixels: bytes, width: int, height: int) -> list[int]:
    """Mean of each quadrant's R, G, B: the same orientation across libraries matches."""
    means = []
    for y0, y1 in ((0, height // 2), (height // 2, height)):
        for x0, x1 in ((0, width // 2), (width // 2, width)):
            rows = [pixels[(y * width + x0) * 3 : (y * width + x1) * 3] for y in range(y0, y1)]
            block = b"".join(rows)
            means += [round(sum(block[c::3]) / max(1, len(block) // 3)) for c in range(3)]
    return means


def run_library(lib: str, args: argparse.Namespace) -> tuple[str, list[dict]]:
    found = (pillow_variants if lib == "pillow" else pyvips_variants)(args.max_pixels)
    if found is None:
        return f"{lib} (not installed)", []
    label, variants = f"{found[0]}{args.tag}", found[1]
    rows = []
    for variant, fn in variants.items():
        try:
            fn(oversized_png())
            refused = False
        except Exception as error:  # any other error means it tried to decode
            refused = isinstance(error, TooLarge)
        for name in INPUTS:
            data = (args.images / name).read_bytes()
            times, (pixels, width, height) = measure(fn, data, args.min_reps, args.min_seconds)
            assert len(pixels) == width * height * 3, "not 8-bit RGB"
            ranked = sorted(times)
            rows.append(
                {
                    "library": label,
                    "variant": variant,
                    "input": name,
                    "input_bytes": len(data),
                    "out": f"{width}x{height}",
                    "reps": len(times),
                    "median_ms": ranked[len(ranked) // 2],
                    "p95_ms": ranked[math.ceil(0.95 * len(ranked)) - 1],
                    "refuses_oversized": refused,
                    "quadrant_rgb": fingerprint(pixels, width, height),
                }
            )
            print(f"{label} {variant} {name}: {rows[-1]['median_ms']:.2f} ms", file=sys.stderr)
    return label, rows


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.micro.image_libs", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--libs", nargs="+", choices=["pillow", "pyvips"], default=["pillow", "pyvips"]
    )
    parser.add_argument(
        "--images",
        type=Path,
        default=Path("/tmp/fairq-image-libs"),
        help="input directory; generated when files are missing",
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results/image_libs/results.json"))
    parser.add_argument("--min-reps", type=int, default=20)
    parser.add_argument("--min-seconds", type=float, default=2.0)
    parser.add_argument("--max-pixels", type=int, default=MAX_PIXELS)
    parser.add_argument("--cpu", type=int, default=max(os.sched_getaffinity(0)))
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--tag", default="", help="appended to the library label (a build)")
    args = parser.parse_args()

    os.sched_setaffinity(0, {args.cpu})  # one core, whatever the library would use
    if not all((args.images / name).exists() for name in INPUTS):
        try:
            generate_inputs(args.images, args.seed)
        except ImportError:
            sys.exit(
                f"{args.images} lacks inputs; generate them with a Python that has "
                "numpy and Pillow (python -m bench.micro.image_libs --libs pillow)"
            )
    merged = json.loads(args.out.read_text()) if args.out.exists() else {"runs": {}}
    for lib in args.libs:
        label, rows = run_library(lib, args)
        if not rows:
            print(f"{label}: not measured\n")
            continue
        merged["runs"][label] = {"python": sys.executable, "cpu": args.cpu, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(merged, indent=1) + "\n")

    order = {name: i for i, name in enumerate(INPUTS)}
    rows = sorted(
        (r for run in merged["runs"].values() for r in run["rows"]),
        key=lambda r: (order.get(r["input"], 99), r["library"], r["variant"]),
    )
    print("| input | KiB | library | variant | out | reps | median ms | p95 ms |")
    print("|---|--:|---|---|---|--:|--:|--:|")
    for r in rows:
        print(
            f"| {r['input']} | {r['input_bytes'] // 1024} | {r['library']} | {r['variant']} "
            f"| {r['out']} | {r['reps']} | {r['median_ms']:.2f} | {r['p95_ms']:.2f} |"
        )


if __name__ == "__main__":
    main()
