"""The generative engine process behind a real broker: sequences admitted one by one, continuous batching
across clients, streaming, cancel, bad input, engine loss. A tiny model saved and reloaded through
``from_pretrained(path)``."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import threading
import time

import pytest
import torch
from cluster import Cluster
from tinylm import build_tiny_lm

import zserve

TOML = """
[broker]
heartbeat_interval_ms = 100
heartbeat_liveness = 5

[[models]]
name = "lm"
handler = "zserve.models.causal_lm:CausalLM"
engines = {engines}
timeout_ms = 120000
[models.options]
path = "{path}"
block_size = 8
num_blocks = {num_blocks}
max_batched_tokens = 64
max_running = 8
max_new_tokens = 16
"""

PROMPTS = [
    "DeepSpeed is",
    "Seattle is a city",
    "zserve batches many small requests into well filled batches.",
    "The quick brown fox",
    "Emoji travel as several bytes: 🚀",
    "你好 世界",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "a",
]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return build_tiny_lm(tmp_path_factory.mktemp("tinylm"))


@pytest.fixture(scope="module")
def reference(tiny_path):
    """Greedy continuations from Hugging Face ``generate``, the oracle."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_path).eval()

    def generate(prompt: str, n: int) -> str:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)[0, ids.shape[1] :]
        # an unfinished UTF-8 sequence at the very end is not a character: the engine's text leaves it out
        return tokenizer.decode(out, skip_special_tokens=True).rstrip("\ufffd")

    return generate


def start(cluster_factory, tiny_path, engines: int = 1, num_blocks: int = 256):
    c = cluster_factory(TOML.format(path=tiny_path, engines=engines, num_blocks=num_blocks))
    c.start_broker()
    for i in range(engines):
        c.start_engine("lm", i)
    c.wait_ready({"lm": engines})
    return c


@pytest.fixture(scope="module")
def shared(tiny_path, tmp_path_factory):
    """One broker and engine (256 blocks) shared by the tests that need no other configuration: each leaves the
    engine idle (its sequences finished or aborted, waited for), and a start costs seconds of 2 shared cores."""
    c = Cluster(TOML.format(path=tiny_path, engines=1, num_blocks=256), tmp_path_factory.mktemp("shared-lm"))
    try:
        c.start_broker()
        c.start_engine("lm", 0)
        c.wait_ready({"lm": 1})
        yield c
    finally:
        c.stop()


def health(client) -> zserve.protocol.ModelHealth:
    return next(m for m in client.health().models if m.name == "lm")


def wait_for(condition, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_staggered_requests_from_many_clients_equal_generate(cluster_factory, tiny_path, reference):
    c = start(cluster_factory, tiny_path, num_blocks=48)  # small pool: sequences wait and get preempted
    client = c.client()
    lengths = [12, 30, 7, 40, 25, 18, 33, 9]
    futures = []
    for prompt, n in zip(PROMPTS, lengths, strict=True):
        futures.append(client.submit("lm", {"prompt": prompt, "max_new_tokens": n, "ignore_eos": True}))
        time.sleep(0.03)  # arrive while others run: they join the running batch
    for prompt, n, future in zip(PROMPTS, lengths, futures, strict=True):
        response = future.result(timeout=120)
        assert response["generated_text"] == reference(prompt, n), prompt
        assert response["generated_length"] == n and response["finish_reason"] == "length"
    report = health(client)
    assert report.generative and report.running_sequences == 0
    wait_for(lambda: health(client).free_kv_blocks == 48)  # every block came back


def test_stream_deltas_concatenate_to_the_response(shared):
    c = shared
    client = c.client()
    for prompt in ("Emoji travel as several bytes:", "你好"):
        stream = client.generate_stream(prompt, model="lm", max_new_tokens=40, ignore_eos=True, temperature=1, seed=5)
        deltas = list(stream)
        assert len(deltas) > 1  # several chunks, not one blob
        assert "".join(deltas) == stream.response.generated_text
        assert stream.response.generated_length == 40
        [same] = client.generate(prompt, model="lm", max_new_tokens=40, ignore_eos=True, temperature=1, seed=5)
        assert same.generated_text == stream.response.generated_text  # seeded sampling is reproducible


def test_stop_strings_and_chat_messages(shared):
    c = shared
    client = c.client()
    [full] = client.generate("The quick brown fox", model="lm", max_new_tokens=30, ignore_eos=True)
    stop = full.generated_text[5:8]
    [cut] = client.generate("The quick brown fox", model="lm", max_new_tokens=30, ignore_eos=True, stop=[stop])
    assert cut.finish_reason == "stop" and cut.generated_text == full.generated_text[: full.generated_text.find(stop)]
    chat = client.generate_stream([{"role": "user", "content": "hello"}], model="lm", max_new_tokens=5, ignore_eos=True)
    assert "".join(chat) == chat.response.generated_text and chat.response.generated_length == 5


def test_closing_a_stream_aborts_the_sequence_and_frees_its_blocks(shared):
    c = shared
    client = c.client()
    stream = client.generate_stream("DeepSpeed is", model="lm", max_new_tokens=400, ignore_eos=True)
    next(stream)
    next(stream)
    assert health(client).free_kv_blocks < 256 or health(client).running_sequences == 1
    stream.close()
    wait_for(lambda: health(client).free_kv_blocks == 256 and health(client).running_sequences == 0, 10)
    with pytest.raises(zserve.errors.Cancelled):
        list(stream)  # the stream ends, and says why


def test_bad_requests_name_the_field(cluster_factory, tiny_path):
    c = start(cluster_factory, tiny_path, num_blocks=32)
    client = c.client()
    cases = [
        ({"text": "no prompt"}, "text"),
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "max_new_tokens": 10_000}, "max_new_tokens"),  # past the model's context
        ({"prompt": "x " * 200, "max_new_tokens": 100}, "prompt"),  # more than the 32 x 8 slot pool
        ({"prompt": "x", "max_length": 1}, "max_length"),
    ]
    for body, field in cases:
        with pytest.raises(zserve.BadRequest) as info:
            client.predict("lm", body)
        assert info.value.field == field, (body, info.value.message)
    [ok] = client.generate("still serving", model="lm", max_new_tokens=3, ignore_eos=True)
    assert ok.generated_length == 3


def test_async_client_generate_and_stream(shared, reference):
    c = shared

    async def main():
        async with zserve.AsyncClient(c.plan.endpoints.client) as client:
            responses = await client.generate(PROMPTS[:4], model="lm", max_new_tokens=10, ignore_eos=True)
            stream = client.generate_stream(PROMPTS[0], model="lm", max_new_tokens=10, ignore_eos=True)
            deltas = [d async for d in stream]
            return responses, deltas, stream.response

    responses, deltas, streamed = asyncio.run(main())
    assert [r.generated_text for r in responses] == [reference(p, 10) for p in PROMPTS[:4]]
    assert "".join(deltas) == streamed.generated_text == responses[0].generated_text


def test_a_decoded_body_of_another_shape_is_read_as_before(shared):
    """A direct client's decoded body need not be a GenerateRequest's map: a prompt string is a prompt, as before the
    typed contract; a map missing its prompt is a 400 naming the field."""
    c = shared

    async def main():
        async with zserve.AsyncClient(c.plan.endpoints.client) as client:
            text = await client.infer("lm", "still serving", decoded=True)
            with pytest.raises(zserve.BadRequest) as info:
                await client.infer("lm", {"max_new_tokens": 2}, decoded=True)
            return text, info.value

    answer, error = asyncio.run(main())
    assert answer.value["generated_length"] >= 1 and error.field == "prompt", (answer.value, error.message)


def test_engine_killed_mid_generation_every_request_is_answered(cluster_factory, tiny_path):
    c = start(cluster_factory, tiny_path, engines=2)
    client = c.client()
    body = {"prompt": "DeepSpeed is", "max_new_tokens": 200, "ignore_eos": True}
    plain = [client.submit("lm", body) for _ in range(6)]
    streams = [client.generate_stream("Seattle is", model="lm", max_new_tokens=200, ignore_eos=True) for _ in range(4)]
    firsts = [next(s) for s in streams]  # every stream has text out
    assert all(isinstance(f, str) for f in firsts)
    os.kill(c.procs["engine-lm-0"].pid, signal.SIGKILL)
    lost = 0
    for stream in streams:
        try:
            list(stream)
        except zserve.EngineLost:
            lost += 1  # had text out: re-running would repeat it
    for future in plain:
        assert future.result(timeout=120)["generated_length"] == 200  # re-dispatched to the survivor
    assert 1 <= lost <= 4


def test_sequences_from_different_clients_share_engine_steps(shared):
    c = shared
    seen: list[int] = []
    stop = threading.Event()
    watcher = c.client()

    def watch():
        while not stop.is_set():
            seen.append(health(watcher).running_sequences)
            time.sleep(0.02)

    thread = threading.Thread(target=watch)
    thread.start()
    clients = [c.client() for _ in range(4)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda cl: cl.generate("The quick", model="lm", max_new_tokens=150, ignore_eos=True), clients))
    stop.set()
    thread.join()
    assert max(seen) >= 2  # admitted together, not one after the other
