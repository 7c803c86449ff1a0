"""A request's images made ready for the engine, away from the worker's event loop.

`prepare_images` (run in a child process) turns each image, as sent (base64), into
upright 8-bit RGB pixels whose longer side is at most `max_edge`: the header is read and
the pixel limit checked before anything is decoded, JPEGs are decoded at a reduced scale
when they are to be scaled down anyway (the slow part of a large photo), transparency is
laid on white. Pillow does the work: bench/image_libs.py measured it against pyvips and
Pillow-SIMD (docs/benchmarks.md).

`ImagePool` runs it in a pool of processes, started at the first image, so text-only
requests never touch it and a worker that sees no image runs no extra process. An image
that is not one, is over a limit or cannot be decoded ends its request alone with
`invalid_request` (a ValueError naming the image). One that takes longer than
`timeout_s`, or that kills its process, gets the pool restarted: the other requests it
held are prepared again once, in the new pool.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import logging
import math
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Self

from broker_config.config import ImageOptions

log = logging.getLogger(__name__)

FORMATS = ("PNG", "JPEG", "GIF", "WEBP")
WHITE = (255, 255, 255)
POOL_NICENESS = 10


@dataclass(frozen=True, slots=True)
class PreparedImage:
    """Pixels ready for a model: RGB, 3 bytes per pixel, rows from the top."""

    width: int
    height: int
    rgb: bytes


class ImageRefused(ValueError):
    """An image over a limit (the decoders' own ValueErrors mean a broken file)."""


def prepare_images(images: list[str], max_pixels: int, max_edge: int) -> list[PreparedImage]:
    """Every image of a request, prepared; ValueError naming the first bad one."""
    from PIL import Image

    # Pillow's own bomb check reads the same header as `prepare_image`'s, whose message names
    # the setting to change.
    Image.MAX_IMAGE_PIXELS = None
    prepared = []
    for index, image in enumerate(images):
        try:
            data = base64.b64decode(image, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ValueError(f"image {index} is not valid base64: {exc}") from None
        try:
            prepared.append(prepare_image(data, index, max_pixels, max_edge))
        except ImageRefused:
            raise
        except Exception as exc:  # each decoder fails its own way on a broken file
            raise ValueError(f"image {index} could not be decoded: {exc}") from None
    return prepared


def prepare_image(data: bytes, index: int, max_pixels: int, max_edge: int) -> PreparedImage:
    """One image (`index` of its request) from its encoded bytes; ValueError if it is
    over the pixel limit or broken.

    Shrinks first and turns and converts the small image after: on a 12 MP photo that
    is most of the time saved (bench/image_libs.py)."""
    from PIL import Image, ImageOps

    with Image.open(io.BytesIO(data), formats=FORMATS) as image:  # reads the header only
        width, height = image.size
        if width * height > max_pixels:
            raise ImageRefused(f"max_image_pixels is {max_pixels}, image {index} has "
                               f"{width}x{height} = {width * height} pixels")
        scale = max_edge / max(width, height)
        if scale < 1 and image.format == "JPEG":
            # Decoded at 1/2, 1/4 or 1/8 scale, still at least the size asked for: most
            # of a large photo's time (thumbnail alone stops at twice the size).
            image.draft(image.mode, (math.ceil(width * scale), math.ceil(height * scale)))
        transparent = image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info
        if image.mode not in ("RGB", "RGBA", "L", "LA"):
            # Palette, CMYK and 16-bit images: Pillow would scale some with NEAREST only.
            image = image.convert("RGBA" if transparent else "RGB")
        # Never enlarges: whole-factor reduction to twice the size, then Lanczos
        # (reducing_gap 2: Pillow's "indistinguishable from fair resampling").
        image.thumbnail((max_edge, max_edge), Image.Resampling.LANCZOS, reducing_gap=2.0)
        ImageOps.exif_transpose(image, in_place=True)
        if transparent:
            rgb = Image.new("RGB", image.size, WHITE)
            rgba = image.convert("RGBA")
            rgb.paste(rgba, mask=rgba.getchannel("A"))
        else:
            rgb = image.convert("RGB")
    return PreparedImage(rgb.width, rgb.height, rgb.tobytes())


class ImagePool:
    """Prepares requests' images in child processes (see the module docstring).

    An async context manager; leaving waits for the images being prepared (the worker
    service leaves it after its requests have drained) and stops the processes.
    """

    def __init__(self, options: ImageOptions = ImageOptions()) -> None:
        self.options = options
        self._executor: ProcessPoolExecutor | None = None
        # Work goes to the pool only when a process is free, so that `timeout_s`
        # measures the work and not the wait behind a burst of other requests' images.
        self._free = asyncio.Semaphore(options.processes)
        self.restarts = 0

    @property
    def started(self) -> bool:
        """Its processes run (from the first image until it is left or restarted)."""
        return self._executor is not None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        executor, self._executor = self._executor, None
        if executor is not None:
            await asyncio.to_thread(executor.shutdown, wait=True, cancel_futures=True)

    async def prepare(self, images: list[str]) -> list[PreparedImage]:
        """The images prepared; ValueError for a bad one (the request's error)."""
        timeout = self.options.timeout_s
        async with self._free:
            for _ in range(2):
                executor = self._running_executor()
                try:
                    # From a thread: a submit may start the pool's processes (and, the
                    # first time, the fork server), which blocks for 100 ms and more.
                    future = await asyncio.to_thread(
                        executor.submit, prepare_images, images,
                        self.options.max_image_pixels, self.options.max_edge)
                    return await asyncio.wait_for(asyncio.wrap_future(future), timeout)
                except TimeoutError:
                    self._restart(executor, f"images took over {timeout} s")
                    raise ValueError(f"its images took longer than {timeout} s to "
                                     "prepare") from None
                except BrokenProcessPool:
                    self._restart(executor, "a process of the pool died")
        raise ValueError("its images stopped the image decoder's process twice")

    def _running_executor(self) -> ProcessPoolExecutor:
        if self._executor is None:
            # Not forked from a worker that may run an engine's threads; below the
            # worker in CPU priority, whose event loop streams every request's tokens.
            self._executor = ProcessPoolExecutor(
                self.options.processes, mp_context=multiprocessing.get_context("forkserver"),
                initializer=os.nice, initargs=(POOL_NICENESS,))
        return self._executor

    def _restart(self, executor: ProcessPoolExecutor, why: str) -> None:
        """Stop `executor`'s processes (still running a hostile image, perhaps); the next
        image starts a new pool. Once per broken pool, however many requests saw it."""
        if executor is not self._executor:
            return
        log.warning("restarting the image pool: %s", why)
        self._executor = None
        self.restarts += 1
        # ProcessPoolExecutor cannot stop a task under way: its processes are killed,
        # which fails the other tasks it held with BrokenProcessPool (they run again).
        for process in list(executor._processes.values()):  # noqa: SLF001
            process.kill()
        executor.shutdown(wait=False, cancel_futures=True)
