"""Images made ready for the engine (workers/images.py): the preparation itself, the
process pool around it (timeouts, a process that dies), and a worker on a real
nats-server that prepares them for its engine, refuses a bad one for its request alone,
never starts the pool for text, and charges each image its model units."""

from __future__ import annotations

import asyncio
import base64
import io
import os
import time

import msgspec
import nats
import numpy as np
import pytest
from PIL import Image
from PIL.PngImagePlugin import PngInfo

from broker_config.config import (
    ConfigError,
    ImageOptions,
    WorkerOptions,
    load_config,
    parse_config,
)
from broker_config.subjects import message_bytes
from broker_config.wire import ChatMessage, Encoding, Submission, SubmitRequest
from dispatcher.core.limits import MemoryLimiterStore
from dispatcher.core.scheduler import Scheduler
from dispatcher.dispatch.convert import to_request
from tests.core_support import ONE_SLOT
from tests.dispatch.test_dataplane_e2e import collect, stack_options, submit
from tests.local_stack import LocalStack
from workers.engine import EngineRequest
from workers.images import ImagePool, PreparedImage, Turns, prepare_images

LIMITS = dict(max_pixels=1 << 25, max_edge=1024)


def encoded(image: Image.Image, fmt: str, **save: object) -> str:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **save)
    return base64.b64encode(buffer.getvalue()).decode()


def photo(size: tuple[int, int]) -> Image.Image:
    """Not one colour, so that codecs and filters have work to do."""
    return Image.radial_gradient("L").resize(size).convert("RGB")


def pixel(prepared: PreparedImage, x: int, y: int) -> tuple[int, int, int]:
    offset = 3 * (y * prepared.width + x)
    return tuple(prepared.rgb[offset : offset + 3])


def test_a_large_photo_is_scaled_to_the_longer_edge_keeping_its_shape() -> None:
    (prepared,) = prepare_images([encoded(photo((4032, 3024)), "JPEG", quality=90)], **LIMITS)
    assert (prepared.width, prepared.height) == (1024, 768)
    assert len(prepared.rgb) == 1024 * 768 * 3


def test_a_small_image_keeps_its_size_and_every_format_is_rgb() -> None:
    images = [encoded(photo((40, 30)), fmt) for fmt in ("PNG", "JPEG", "GIF", "WEBP")]
    prepared = prepare_images(images, **LIMITS)
    assert [(p.width, p.height, len(p.rgb)) for p in prepared] == [(40, 30, 3600)] * 4


def test_palette_cmyk_and_16_bit_images_come_out_rgb_and_scaled() -> None:
    source = photo((2048, 1024))
    grey = source.convert("L")
    wide = Image.fromarray(np.asarray(grey, dtype=np.uint16) * 257)  # 16 bits, full range
    assert wide.mode.startswith("I;16")
    reference, palette, cmyk, grey_8, grey_16 = prepare_images(
        [
            encoded(source, "PNG"),
            encoded(source.convert("P"), "PNG"),
            encoded(source.convert("CMYK"), "JPEG"),
            encoded(grey, "PNG"),
            encoded(wide, "PNG"),
        ],
        **LIMITS,
    )
    for prepared, like in ((palette, reference), (cmyk, reference), (grey_16, grey_8)):
        assert (prepared.width, prepared.height, len(prepared.rgb)) == (1024, 512, 1024 * 512 * 3)
        for x, y in ((0, 0), (300, 100), (512, 256), (1000, 500)):
            assert all(
                abs(a - b) <= 24 for a, b in zip(pixel(prepared, x, y), pixel(like, x, y))
            ), (x, y)
    # Scaled smoothly, not by dropping pixels: a one-pixel checkerboard halved is grey,
    # where NEAREST would keep black or white.
    rows = (bytes([0, 255]) * 1024 + bytes([255, 0]) * 1024) * 512
    checkers = Image.frombytes("L", (2048, 1024), rows).convert("P")
    (halved,) = prepare_images([encoded(checkers, "PNG")], **LIMITS)
    assert all(96 < level < 160 for level in pixel(halved, 512, 256))


def test_exif_orientation_is_applied() -> None:
    exif = Image.Exif()
    exif[0x0112] = 6  # stored sideways: turn 90 degrees clockwise to show it
    (prepared,) = prepare_images([encoded(photo((64, 32)), "JPEG", exif=exif)], **LIMITS)
    assert (prepared.width, prepared.height) == (32, 64)


def test_transparency_is_laid_on_white() -> None:
    image = Image.new("RGBA", (4, 4), (255, 0, 0, 255))
    image.putpixel((0, 0), (0, 0, 0, 0))
    (prepared,) = prepare_images([encoded(image, "PNG")], **LIMITS)
    assert pixel(prepared, 0, 0) == (255, 255, 255)
    assert pixel(prepared, 1, 1) == (255, 0, 0)


@pytest.mark.parametrize(
    ("image", "message"),
    [
        ("not base64!", "image 1 is not valid base64"),
        (base64.b64encode(b"plain text, no image").decode(), "image 1 could not be decoded"),
        (encoded(photo((8, 8)), "BMP"), "image 1 could not be decoded"),
        # A real JPEG header, its data cut off: the dispatcher's header check passes it.
        (encoded(photo((512, 512)), "JPEG")[:2000], "image 1 could not be decoded"),
    ],
    ids=["base64", "no-image", "bmp", "truncated"],
)
def test_a_bad_image_is_a_value_error_naming_it(image: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        prepare_images([encoded(photo((4, 4)), "PNG"), image], **LIMITS)


def test_a_compressed_text_chunk_that_inflates_to_20_mb_is_refused() -> None:
    text = PngInfo()
    text.add_text("comment", "a" * (20 << 20), zip=True)  # 20 KB on the wire
    bomb = encoded(photo((8, 8)), "PNG", pnginfo=text)
    assert len(bomb) < 100_000
    with pytest.raises(ValueError, match="image 0 could not be decoded: .*too large"):
        prepare_images([bomb], **LIMITS)


def test_the_pixel_limit_holds_before_decoding() -> None:
    # 20,000 x 20,000 of one colour: a few hundred KB that would decode to 1.2 GB.
    bomb = encoded(Image.new("L", (20000, 20000)), "PNG")
    assert len(bomb) < 1 << 20
    with pytest.raises(
        ValueError, match="max_image_pixels is 33554432, image 0 has 20000x20000 = 400000000 pixels"
    ):
        prepare_images([bomb], **LIMITS)


async def test_the_pool_prepares_images_in_another_process() -> None:
    async with ImagePool() as pool:
        assert not pool.started
        (prepared,) = await pool.prepare([encoded(photo((2048, 1024)), "PNG")], "acme")
        assert pool.started
    assert (prepared.width, prepared.height) == (1024, 512)
    assert not pool.started


def noise_png(size: tuple[int, int]) -> str:
    """Slow to decode (none of it compresses): about 0.5 s for 4000x4000 here."""
    width, height = size
    image = Image.frombytes("RGB", size, os.urandom(width * height * 3))
    return encoded(image, "PNG", compress_level=1)


async def test_an_image_over_the_time_limit_fails_alone_and_the_pool_restarts() -> None:
    async with ImagePool(ImageOptions(timeout_s=0.15)) as pool:
        with pytest.raises(ValueError, match="its images took longer than 0.15 s"):
            await pool.prepare([noise_png((4000, 4000))], "acme")
        assert pool.restarts == 1 and not pool.started
        (after,) = await pool.prepare([encoded(photo((8, 8)), "PNG")], "acme")
        assert after.width == 8 and pool.restarts == 1  # a new pool serves


async def test_requests_whose_process_died_are_prepared_again_alone() -> None:
    slow = noise_png((3000, 3000))
    async with ImagePool(ImageOptions(processes=2)) as pool:
        await pool.prepare([encoded(photo((8, 8)), "PNG")], "acme")  # the pool is up
        tasks = [asyncio.create_task(pool.prepare([slow], tenant)) for tenant in ("acme", "globex")]
        await asyncio.sleep(0.1)
        assert not any(task.done() for task in tasks)
        # As a decoder that crashes would: the pool breaks under both requests (the
        # executor keeps its processes privately).
        for process in list(pool._executor._processes.values()):
            process.kill()
        for task in tasks:
            (prepared,) = await asyncio.wait_for(task, 60)
            assert (prepared.width, prepared.height) == (1024, 1024)
        assert pool.restarts == 1


async def test_leaving_stops_a_process_busy_with_an_image_at_once() -> None:
    pool = ImagePool()
    task = asyncio.create_task(pool.prepare([noise_png((4000, 4000))], "acme"))
    await asyncio.sleep(0.2)
    (process,) = pool._executor._processes.values()
    task.cancel()  # as the worker's drain abandons it
    started = time.monotonic()
    await pool.__aexit__(None, None, None)
    assert time.monotonic() - started < 1.0
    process.join(timeout=5)
    assert not process.is_alive()


async def test_a_request_stopped_while_it_waited_is_not_prepared() -> None:
    async with ImagePool() as pool:
        assert (
            await pool.prepare([encoded(photo((8, 8)), "PNG")], "acme", wanted=lambda: False)
            is None
        )
        assert not pool.started


async def test_free_processes_go_to_the_tenants_waiting_in_turn() -> None:
    turns = Turns(1)
    order: list[str] = []

    async def take(name: str, tenant: str) -> None:
        async with turns.turn(tenant):
            order.append(name)
            await asyncio.sleep(0.01)

    first = asyncio.create_task(take("a1", "a"))
    await asyncio.sleep(0)  # a1 holds the only slot
    waiting = [asyncio.create_task(take(name, name[0])) for name in ("a2", "a3", "a4", "b1")]
    cancelled = asyncio.create_task(take("c1", "c"))
    await asyncio.sleep(0)
    cancelled.cancel()  # leaves the line without taking a turn
    await asyncio.gather(first, *waiting)
    assert order == ["a1", "a2", "b1", "a3", "a4"]
    async with asyncio.timeout(1):
        await take("d1", "d")  # the slot came back
    assert order[-1] == "d1"


def test_the_dispatcher_charges_each_image_its_model_units() -> None:
    config = load_config()
    gamma = config.profiles[config.endpoints["chat"].profile].gamma
    charged = []
    for images in (0, 3):
        body = SubmitRequest(
            prompt="look",
            input_tokens=10,
            max_tokens=5,
            images=[encoded(photo((8, 8)), "PNG")] * images,
        )
        request = to_request(
            Submission("chat", "acme", "r", body, None, Encoding.JSON), 0.0, 1024, None
        )
        scheduler = Scheduler(config)
        scheduler.admit(request, 0.0, MemoryLimiterStore())
        (sent,) = scheduler.next_batch("chat", ONE_SLOT, 0.0).requests
        charged.append(sent.charged_cost)
    assert gamma > 0
    assert charged[1] - charged[0] == pytest.approx(3 * gamma)


@pytest.mark.integration
async def test_a_worker_prepares_images_refuses_a_bad_one_alone_and_charges_them(
    nats_url, client
) -> None:
    options = stack_options(
        workers_settings=WorkerOptions(heartbeat_interval_s=0.2, images=ImageOptions(max_edge=256))
    )
    good = [encoded(photo((1600, 1200)), "JPEG"), encoded(Image.new("RGBA", (64, 64)), "PNG")]
    truncated = encoded(photo((512, 512)), "JPEG")[:2000]
    async with LocalStack(load_config(), options, nats_url=nats_url) as stack:
        (worker,), (engine,) = stack.workers, stack.engines
        _, text = await submit(client, "chat", "acme", {"prompt": "text only", "max_tokens": 4})
        assert (await collect(text))[-1]["type"] == "done"
        assert not worker.image_pool.started  # text never touches the pool
        seen: list[list[PreparedImage]] = []
        generate = engine.generate

        def recording(request):
            if request.images:
                seen.append(request.images)
            return generate(request)

        engine.generate = recording
        _, with_images = await submit(
            client,
            "chat",
            "acme",
            {"prompt": "describe", "max_tokens": 4, "input_tokens": 100, "images": good},
        )
        _, bad = await submit(
            client, "chat", "globex", {"prompt": "describe", "images": [truncated]}
        )
        _, beside = await submit(client, "chat", "globex", {"prompt": "and this", "max_tokens": 4})
        done, error, other = [(await collect(sub, 30))[-1] for sub in (with_images, bad, beside)]
    assert done["type"] == "done", done
    assert [[(p.width, p.height) for p in images] for images in seen] == [[(256, 192), (64, 64)]]
    profile = stack.config.profiles[stack.config.endpoints["chat"].profile]
    usage = done["usage"]
    assert usage["other_units"] == 2
    assert usage["model_units"] == pytest.approx(
        profile.model_units(usage["input_tokens"], usage["output_tokens"], 2)
    )
    assert error["type"] == "error" and error["code"] == "invalid_request", error
    assert "image 0 could not be decoded" in error["message"]
    assert other["type"] == "done", other


@pytest.fixture
async def client(nats_url):
    nc = await nats.connect(nats_url)
    yield nc
    await nc.drain()


def test_image_options_come_from_the_workers_table() -> None:
    config = parse_config(
        '[endpoints.chat]\n[[tiers]]\nname = "a"\n[workers.images]\nprocesses = 2\nmax_edge = 512\n'
    )
    assert config.workers.images == ImageOptions(processes=2, max_edge=512)
    with pytest.raises(ConfigError, match="workers.images.max_edge"):
        parse_config('[endpoints.chat]\n[[tiers]]\nname = "a"\n[workers.images]\nmax_edge = 0\n')


@pytest.mark.integration
async def test_large_image_requests_reach_the_worker_in_batches_within_the_brokers_limit(
    nats_url, client
) -> None:
    # Noise does not compress: each PNG is about 600 KB as base64, so no two fit together
    # in a message of nats-server's default 1 MiB.
    noisy = encoded(Image.frombytes("RGB", (400, 375), os.urandom(400 * 375 * 3)), "PNG")
    assert 500_000 < len(noisy) < 700_000
    async with LocalStack(load_config(), stack_options(), nats_url=nats_url) as stack:
        batches = await client.subscribe(stack.config.subjects.work("chat", "chat-w1"))
        subs = [
            (
                await submit(
                    client, "chat", "acme", {"prompt": "x", "images": [noisy], "max_tokens": 2}
                )
            )[1]
            for _ in range(3)
        ]
        # Within the body limit, but no room is left for the dispatcher's own fields.
        _, too_large = await submit(
            client,
            "chat",
            "acme",
            {"prompt": "x" * (client.max_payload - len(noisy) - 300), "images": [noisy]},
        )
        finals = [(await collect(sub, 30))[-1] for sub in (*subs, too_large)]
        sent = []
        while batches.pending_msgs:
            sent.append(await batches.next_msg(timeout=1))
    assert [final["type"] for final in finals[:3]] == ["done"] * 3, finals
    # One request per message: no two fit in one.
    assert sorted(len(msgspec.msgpack.decode(m.data)["items"]) for m in sent) == [1, 1, 1]
    assert all(message_bytes(m.data, m.headers) <= client.max_payload for m in sent)
    assert finals[3]["code"] == "invalid_request", finals[3]
    assert "over the broker's largest message (max_payload 1048576)" in finals[3]["message"]


def test_vllm_gets_the_images_as_pil_parts_of_the_last_user_message() -> None:
    from workers.vllm_engine import _chat, _text_prompt  # vllm itself is not imported

    image = PreparedImage(2, 1, bytes([255, 0, 0, 0, 0, 255]))
    request = EngineRequest(
        id="r",
        max_tokens=4,
        images=[image],
        messages=[
            ChatMessage("system", "be brief"),
            ChatMessage("user", "first"),
            ChatMessage("assistant", "ok"),
            ChatMessage("user", "what is this?"),
        ],
    )
    system, first, answer, last = _chat(request)
    assert (system["content"], first["content"], answer["content"]) == ("be brief", "first", "ok")
    part, text = last["content"]
    assert text == {"type": "text", "text": "what is this?"}
    assert part["type"] == "image_pil"
    assert part["image_pil"].size == (2, 1)
    assert part["image_pil"].getpixel((1, 0)) == (0, 0, 255)
    prompt = _text_prompt(
        EngineRequest(id="p", max_tokens=4, prompt="<image> what?", images=[image, image])
    )
    assert prompt["prompt"] == "<image> what?"
    assert [i.size for i in prompt["multi_modal_data"]["image"]] == [(2, 1), (2, 1)]
    with pytest.raises(ValueError, match="no user message to put them in"):
        _chat(
            EngineRequest(
                id="s", max_tokens=4, images=[image], messages=[ChatMessage("system", "only this")]
            )
        )
