"""A request's images made ready for the engine, away from the worker's event loop.

`prepare_images` (run in a child process) turns each image, as sent (base64), into
upright 8-bit RGB pixels whose longer side is at most `max_edge`: the header is read and
the pixel limit checked before anything is decoded, JPEGs are decoded at a reduced scale
when they are to be scaled down anyway (the slow part of a large photo), transparency is
laid on white. Pillow does the work: bench/micro/image_libs.py measured it against pyvips and
Pillow-SIMD (docs/benchmarks.md).

`ImagePool` runs it in a pool of processes, started at the first image, so text-only
requests never touch it and a worker that sees no image runs no extra process; a free
process goes to the tenants waiting in turn. An image that is not one, is over a limit
or cannot be decoded ends its request alone with `invalid_request` (a ValueError naming
the image). One that takes longer than `timeout_s` does too, and the pool is restarted
so that it holds no process; a request whose process dies (or is killed by that
restart) is prepared once more, in a process of its own, so that only the request whose
images kill a process twice ends for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import math
import multiprocessing
import os
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Self

from broker_config.config import ImageOptions
from broker_config.limits import decode_image, over_pixels

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
        data = decode_image(index, image)
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
    is most of the time saved (bench/micro/image_libs.py)."""
    from PIL import Image, ImageOps

    with Image.open(io.BytesIO(data), formats=FORMATS) as image:  # reads the header only
        width, height = image.size
        refusal = over_pixels(index, width, height, max_pixels)
        if refusal is not None:
            raise ImageRefused(refusal)
        scale = max_edge / max(width, height)
        if scale < 1 and image.format == "JPEG":
            # Decoded at 1/2, 1/4 or 1/8 scale, still at least the size asked for: most
            # of a large photo's time (thumbnail alone stops at twice the size).
            image.draft(image.mode, (math.ceil(width * scale), math.ceil(height * scale)))
        transparent = image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info
        if image.mode.startswith("I"):
            # 16-bit grey: to 8 bits by its high byte (a plain convert clips at 255).
            image = image.convert("I").point(lambda value: value / 256).convert("L")
        elif image.mode not in ("RGB", "RGBA", "L", "LA"):
            # Palette and CMYK images: Pillow would scale some with NEAREST only.
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

    A free process goes to the tenants waiting in turn (`Turns`), so that one tenant's
    burst of photos does not hold another's image behind it: the dispatcher's fair
    order cannot reach inside the worker. An async context manager; leaving stops the
    processes at once (the worker service leaves it after its requests are done, so
    nothing waits for them).
    """

    def __init__(self, options: ImageOptions = ImageOptions()) -> None:
        self.options = options
        self._executor: ProcessPoolExecutor | None = None
        # Work goes to the pool only when a process is free, so that `timeout_s`
        # measures the work and not the wait behind a burst of other requests' images.
        self._turns = Turns(options.processes)
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
            _stop(executor)

    async def prepare(
        self, images: list[str], tenant: str, wanted: Callable[[], bool] = lambda: True
    ) -> list[PreparedImage] | None:
        """The images prepared; ValueError for a bad one (the request's error). None if
        `wanted()` says no once its turn came (the request was stopped meanwhile)."""
        async with self._turns.turn(tenant):
            if not wanted():
                return None
            executor = self._running_executor()
            try:
                return await self._run(executor, images)
            except _Broken:
                self._restart(executor, "a process of the pool died")
        # Again, in a process of its own: if that dies too, this request's images did it,
        # not a neighbour's.
        alone = _executor(1)
        try:
            return await self._run(alone, images)
        except _Broken:
            raise ValueError("its images stopped the image decoder's process") from None
        finally:
            _stop(alone)

    async def _run(self, executor: ProcessPoolExecutor, images: list[str]) -> list[PreparedImage]:
        timeout = self.options.timeout_s
        try:
            # From a thread: a submit may start the pool's processes (and, the first
            # time, the fork server), which blocks for 100 ms and more.
            future = await asyncio.to_thread(
                executor.submit,
                prepare_images,
                images,
                self.options.max_image_pixels,
                self.options.max_edge,
            )
        except (BrokenProcessPool, RuntimeError) as exc:  # shut down by another's restart
            raise _Broken from exc
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), timeout)
        except TimeoutError:
            self._restart(executor, f"images took over {timeout} s")
            raise ValueError(f"its images took longer than {timeout} s to prepare") from None
        except BrokenProcessPool as exc:
            raise _Broken from exc

    def _running_executor(self) -> ProcessPoolExecutor:
        if self._executor is None:
            self._executor = _executor(self.options.processes)
        return self._executor

    def _restart(self, executor: ProcessPoolExecutor, why: str) -> None:
        """Stop `executor`'s processes (still running a hostile image, perhaps); the next
        image starts a new pool. Once per broken pool, however many requests saw it."""
        if executor is not self._executor:
            _stop(executor)  # a request's pool of its own, or one already replaced
            return
        log.warning("restarting the image pool: %s", why)
        self._executor = None
        self.restarts += 1
        _stop(executor)


class _Broken(Exception):
    """A process of the pool died (or the pool was stopped) under a request's images."""


def _executor(processes: int) -> ProcessPoolExecutor:
    # Forked from a fork server, not from a worker that may run an engine's threads; the
    # server imports Pillow once, so that a new process (after a restart) starts warm.
    # Below the worker in CPU priority, whose event loop streams every request's tokens.
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__, "PIL.Image", "PIL.ImageOps"])
    return ProcessPoolExecutor(
        processes, mp_context=context, initializer=os.nice, initargs=(POOL_NICENESS,)
    )


def _stop(executor: ProcessPoolExecutor) -> None:
    """Kill the processes: ProcessPoolExecutor cannot stop a task under way. The tasks
    they held fail with BrokenProcessPool (their requests run them again)."""
    for process in list((executor._processes or {}).values()):  # None once broken
        process.kill()
    executor.shutdown(wait=False)


class Turns:
    """`slots` held at once; a freed slot goes to the next tenant waiting, in rotation,
    one request of each at a time (round robin, no weights: the dispatcher's DRR
    already decided which requests came here)."""

    def __init__(self, slots: int) -> None:
        self._free = slots
        # Tenants in the order of their turn; each one's requests in arrival order.
        self._waiting: dict[str, deque[asyncio.Future[None]]] = {}

    @contextlib.asynccontextmanager
    async def turn(self, tenant: str) -> AsyncIterator[None]:
        await self._acquire(tenant)
        try:
            yield
        finally:
            self._release()

    async def _acquire(self, tenant: str) -> None:
        if self._free and not self._waiting:
            self._free -= 1
            return
        granted = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(tenant, deque()).append(granted)
        try:
            await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():
                self._release()  # granted as it was cancelled: pass the slot on
            else:
                queue = self._waiting.get(tenant)
                if queue is not None and granted in queue:
                    queue.remove(granted)
                    if not queue:
                        del self._waiting[tenant]
            raise

    def _release(self) -> None:
        while self._waiting:
            tenant = next(iter(self._waiting))
            queue = self._waiting.pop(tenant)
            granted = queue.popleft()
            if queue:
                self._waiting[tenant] = queue  # to the back of the rotation
            if not granted.done():
                granted.set_result(None)
                return
        self._free += 1
