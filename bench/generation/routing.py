#!/usr/bin/env python
"""Cache-aware routing across engines against least-loaded admission, in one run (issue 35).

Each leg starts its own deployment (``zserve.serve``: broker, ``--engines`` generative engines of
``--threads`` torch threads each, one frontend worker), routing ``least_loaded`` or ``cache_aware``, and sends
the workloads through HTTP with the ``openai`` client (streamed /v1/completions; TTFT at the first text chunk):

  * capacity (least_loaded leg only): ``--calibrate`` random prompts of ``--prefix`` + ``--suffix`` tokens,
    ``--concurrency`` callers in a closed loop; requests/s is the deployment's capacity, and every open-loop
    rate below is a share of it, the same in both legs; with the hot workload, as many requests behind the hot
    prefix measure its own capacity the same way (a hot request's prefix is cached: it costs far less than a
    cold one, so a rate calibrated on cold prompts would not load an engine);
  * shared: ``--groups`` system prompts of ``--prefix`` tokens, each followed by ``--turns`` different user turns
    of ``--suffix`` tokens, in random order, Poisson arrivals at ``--load`` x capacity;
  * none: as many prompts of random words (``--prefix`` + ``--suffix`` tokens), nothing shared, same arrivals;
  * chats: ``--chats`` conversations of ``--chat-turns`` turns (a ``--chat-system`` token system prompt, user
    turns of ``--suffix`` tokens), each turn sent when the previous answer came back (after an exponential
    think time of mean ``--chat-think-ms``, 0 by default: at once), its answer in the history;
  * hot: ``--hot`` requests behind one system prompt of ``--prefix`` tokens, Poisson at ``--hot-load`` x one
    engine's hot capacity (the hot calibration's / engines); per engine the requests routed to it (the broker's
    routing counters: cache_aware only), and every request's outcome (answered, 503 at admission, anything else).

``--workloads`` runs a subset (e.g. ``chats``); the ratios are reported for the workloads run. Each engine's KV
pool has room for ``--max-running`` sequences and every prefix besides, so each engine can keep them all (and
least_loaded finds a prefix once each engine computed it); ``--kv-blocks N`` gives it N blocks instead, e.g. room
for every prefix once across the engines but not in each, as where a deployment's prefixes outgrow one engine.

Reports per leg and workload TTFT p50/p99, output tok/s, and the engines' prefix-cache hit rate (cached prompt
tokens / prompt tokens, from the broker's health report), with the ratios cache_aware / least_loaded, and the hit
rate one engine with room for every prefix would reach (each prefix computed once: computed from the workload).

    .venv/bin/python -m bench.generation routing                      # SmolLM2-135M, 2 engines x 1 thread
    .venv/bin/python -m bench.generation routing --model tiny --groups 2 --turns 2 --prefix 64   # smoke run

With ``--sglang-router CMD`` a leg puts SGLang's router (``sglang-router``, cache_aware policy, its approximate
radix tree over the request text) in front of ``--engines`` single-engine deployments, and with ``--vllm-router
CMD`` vLLM's router (``vllm-router``, a Rust router of the same lineage; cache_aware policy) likewise; both probe
``/health``, so each deployment sits behind a bench-only alias to zserve's ``/healthz`` (``HealthAlias``).
vllm-router (0.1.17) matches token ids, which it asks the workers for before it routes (vLLM's
``/v1/completions/render``, then ``/tokenize``, which zserve serves). The broker's cost with 64 simulated engines is
``routing-cost``. Writes bench/results/routing-DATE-TIME.json.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.common.paths import RESULTS
from bench.generation.workload import GenRequest, Timing, closed_loop, summarize, text_of_length
from bench.generation.zserve_leg import HANDLER, SERVED_NAME, engine_options, resolve_model

# the issue's targets: shared TTFT p50 and tok/s, chats' TTFT p50, none's tok/s, hot's busiest engine / mean
TTFT_TARGET, TOK_S_TARGET, CHAT_TTFT_TARGET, NONE_TOK_S_TARGET, HOT_SKEW_TARGET = 0.5, 1.0, 0.5, 0.97, 1.3
WORKLOADS = ("shared", "none", "chats", "hot")
DEADLINE_MS = 300_000  # every request's deadline (the deployment's timeout_ms): answered by then, or refused


def workloads(tokenizer: Any, args: argparse.Namespace) -> dict[str, list[GenRequest]]:
    rng = random.Random(args.seed)

    def request(text: str) -> GenRequest:
        return GenRequest(text, tokenizer(text)["input_ids"], args.output)

    shared = []
    for _ in range(args.groups):
        system = text_of_length(tokenizer, args.prefix, rng)
        shared += [request(system + " " + text_of_length(tokenizer, args.suffix, rng)) for _ in range(args.turns)]
    rng.shuffle(shared)
    random_prompt = lambda: request(text_of_length(tokenizer, args.prefix + args.suffix, rng))  # noqa: E731
    none = [random_prompt() for _ in shared]
    calibrate = [random_prompt() for _ in range(args.calibrate)]
    hot_system = text_of_length(tokenizer, args.prefix, rng)
    hot = [request(hot_system + " " + text_of_length(tokenizer, args.suffix, rng)) for _ in range(args.hot)]
    hot_calibrate = [request(hot_system + " " + text_of_length(tokenizer, args.suffix, rng))
                     for _ in range(args.calibrate)]  # fmt: skip
    return {"calibrate": calibrate, "shared": shared, "none": none, "hot": hot, "hot_calibrate": hot_calibrate}


def chats(tokenizer: Any, args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    """Each conversation's system prompt and user turns (the answers join the history as they come)."""
    rng = random.Random(args.seed + 1)
    return [(text_of_length(tokenizer, args.chat_system, rng),
             [text_of_length(tokenizer, args.suffix, rng) for _ in range(args.chat_turns)])
            for _ in range(args.chats)]  # fmt: skip


def ideal_hit_rate(requests: list[GenRequest], block_size: int) -> float:
    """One engine that keeps every block: each block computed the first time it is seen, found after."""
    seen: set[tuple[int, ...]] = set()
    prompt = cached = 0
    for r in requests:
        ids = r.prompt_ids
        prompt += len(ids)
        for end in range(block_size, len(ids), block_size):  # the block holding the last token is never shared
            key = tuple(ids[:end])
            if key in seen:
                cached += block_size
            seen.add(key)
    return cached / prompt if prompt else 0.0


class HttpLeg:
    """One streamed completion per call through the deployment's HTTP frontend, with the openai client."""

    def __init__(self, url: str) -> None:
        import openai

        self.local = threading.local()
        self.make = lambda: openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=3600)
        self.mismatches: list[str] = []

    def __call__(self, request: GenRequest, deadline: float | None) -> Timing:
        return self.send(request)[0]

    def send(self, request: GenRequest) -> tuple[Timing, str]:
        """The request's timing and its generated text."""
        client = getattr(self.local, "client", None) or self.make()
        self.local.client = client
        start = time.perf_counter()
        first = last = None
        tokens, text = 0, []
        stream = client.completions.create(
            model=SERVED_NAME, prompt=request.prompt_text, max_tokens=request.output_len, temperature=0,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                last = time.perf_counter()
                first = first or last
                text.append(chunk.choices[0].text)
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        end = time.perf_counter()
        if tokens != request.output_len:
            self.mismatches.append(f"asked {request.output_len} tokens, got {tokens}")
        return Timing(start, first or end, last or end, tokens), "".join(text)


def open_loop(leg: HttpLeg, requests: list[GenRequest], rate_per_s: float, seed: int) -> tuple[list, float, dict]:
    """Each request sent at its Poisson arrival time (exponential gaps at ``rate_per_s``), on a thread of its own
    whatever is in flight. Returns the answered requests' timings, the wall time and every outcome's count
    ("ok", an HTTP status, or the error's type)."""
    import openai

    rng = random.Random(seed)
    timings: list[Timing] = []
    outcomes: dict[str, int] = {}
    lock = threading.Lock()

    def send(request: GenRequest) -> None:
        try:
            timing, outcome = leg(request, None), "ok"
        except openai.APIStatusError as exc:
            timing, outcome = None, str(exc.status_code)
        except Exception as exc:  # counted, never lost: the caller reads every outcome
            timing, outcome = None, type(exc).__name__
        with lock:
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
            if timing is not None:
                timings.append(timing)

    started = time.perf_counter()
    at = started
    threads = []
    for request in requests:
        at += rng.expovariate(rate_per_s)
        time.sleep(max(0.0, at - time.perf_counter()))
        threads.append(threading.Thread(target=send, args=(request,), daemon=True))
        threads[-1].start()
    for t in threads:
        t.join()
    ended = max((t.last_s for t in timings), default=time.perf_counter())
    return timings, ended - started, outcomes


def chat_loop(
    leg: HttpLeg, conversations: list[tuple[str, list[str]]], output: int, think_ms: float = 0.0, seed: int = 0
) -> tuple[list, float, list]:
    """Every conversation at once, each turn sent when the previous answer came back (its text in the prompt),
    after an exponential think time of mean ``think_ms`` (0: at once). Returns every turn's timing, the wall
    time, and the TTFTs (s) of the turns after the first."""
    timings: list[Timing] = []
    later: list[float] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def converse(system: str, turns: list[str], rng: random.Random) -> None:
        history = system
        for index, turn in enumerate(turns):
            if index and think_ms:
                time.sleep(rng.expovariate(1000.0 / think_ms))
            prompt = f"{history}\nUser: {turn}\nAssistant:"
            try:
                timing, answer = leg.send(GenRequest(prompt, [], output))
            except BaseException as exc:
                errors.append(exc)
                return
            with lock:
                timings.append(timing)
                if index:
                    later.append(timing.ttft_s)
            history = prompt + answer

    started = time.perf_counter()
    threads = [threading.Thread(target=converse, args=(*c, random.Random(seed + i)), daemon=True)
               for i, c in enumerate(conversations)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return timings, max(t.last_s for t in timings) - started, later


def counters(clients: list[Any]) -> tuple[int, int, dict[str, int]]:
    """Prompt tokens, cached prompt tokens (over every deployment of the leg), and the requests routed to each
    engine (cache_aware's counters)."""
    prompt = cached = 0
    routed: dict[str, int] = {}
    for client in clients:
        [model] = [m for m in client.health().models if m.name == SERVED_NAME]
        prompt, cached = prompt + model.prompt_tokens, cached + model.cached_prompt_tokens
        routed |= {r.engine: r.match + r.spill + r.least_loaded for r in model.routing}
    return prompt, cached, routed


class HealthAlias:
    """A byte pump in front of a zserve frontend that answers SGLang's router's probe of ``/health`` with the
    frontend's ``/healthz`` (the router's worker detection asks ``/health`` whatever its health options say).
    Bench-only; the peer's requests pass through it unchanged."""

    def __init__(self, target_url: str) -> None:
        import asyncio

        host_port = target_url.split("//", 1)[1].rstrip("/")
        self.host, port = host_port.rsplit(":", 1)
        self.port = int(port)
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        self.url = ""

        async def start() -> None:
            server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
            self.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
            ready.set()

        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(start(), self.loop)
        ready.wait(10)

    async def _serve(self, reader: Any, writer: Any) -> None:
        import asyncio

        up_reader, up_writer = await asyncio.open_connection(self.host, self.port)

        async def pump(src: Any, dst: Any, rewrite: bool) -> None:
            try:
                while data := await src.read(65536):
                    if rewrite:
                        data = data.replace(b"GET /health HTTP/1.1\r\n", b"GET /healthz HTTP/1.1\r\n")
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pump(reader, up_writer, True), pump(up_reader, writer, False))

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)


def load_tokenizer(url: str) -> None:
    """Have the deployment at ``url`` load its tokenizer (``POST /tokenize``), as a token-level router's first
    request would."""
    import urllib.request

    request = urllib.request.Request(url + "/tokenize", data=json.dumps({"prompt": "warm up"}).encode(),
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=120) as answer:
        json.loads(answer.read())


def peer_argv(routing: str, command: str, workers: list[str], port: int) -> list[str]:
    """How each peer router is started with its cache-aware policy in front of ``workers``, on ``port``."""
    where = ["--worker-urls", *workers, "--policy", "cache_aware", "--host", "127.0.0.1", "--port", str(port)]
    if routing == "sglang_router":
        return [command, "launch", *where, "--disable-health-check"]
    # vllm-router checks its workers every 30 s until they answer by default: at once here
    return [command, *where, "--worker-startup-check-interval", "1"]


PEERS = ("sglang_router", "vllm_router")


def deploy(path: str, routing: str, options: dict[str, Any], args: argparse.Namespace) -> tuple[str, list, Any]:
    """The leg's URL, its zserve deployments and what stops the rest. A peer (``PEERS``): that router
    (cache_aware policy) in front of ``--engines`` single-engine deployments."""
    import subprocess

    import zserve

    def one(engines: int, how: str) -> Any:
        return zserve.serve(HANDLER, name=SERVED_NAME, options=options, engines=engines, threads=args.threads,
                            routing=how, timeout_ms=DEADLINE_MS, workers=1)  # fmt: skip

    if routing not in PEERS:
        client = one(args.engines, routing)
        deadline = time.monotonic() + 120
        while routing == "cache_aware" and "routing: tokenizer loaded" not in client.output:
            if time.monotonic() > deadline:
                raise RuntimeError("the frontend never loaded the tokenizer for routing")
            time.sleep(0.1)
        return client.url, [client], lambda: None
    clients = [one(1, "least_loaded") for _ in range(args.engines)]
    for c in clients:  # each frontend loads its tokenizer on the first /tokenize: before the clock, not during it
        load_tokenizer(c.url)
    aliases = [HealthAlias(c.url) for c in clients]
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log = open(Path(tempfile.gettempdir()) / f"zserve-bench-{routing}.log", "w")  # closed by stop()
    argv = peer_argv(routing, getattr(args, routing), [a.url for a in aliases], port)
    router = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)

    def stop() -> None:
        router.terminate()
        router.wait(30)
        log.close()
        for a in aliases:
            a.close()

    return f"http://127.0.0.1:{port}", clients, stop


def run_leg(
    path: str,
    routing: str,
    loads: dict[str, list[GenRequest]],
    talks: list[tuple[str, list[str]]],
    capacity: dict[str, float] | None,
    args: argparse.Namespace,
) -> tuple[list[dict], dict[str, float]]:
    """The leg's rows, and the capacities (requests/s: "cold" prompts, "hot" requests) its open loops were
    driven at a share of (measured here when ``capacity`` is None)."""
    import openai

    chat_tokens = args.chat_system + args.chat_turns * (args.suffix + args.output + 8)
    tokens_per_seq = max(max(len(r.prompt_ids) for rs in loads.values() for r in rs), chat_tokens) + args.output
    # room for every sequence that can be in flight (max_running), plus the prefixes kept between requests
    options = engine_options(path, args.dtype, args.max_running, tokens_per_seq, args.max_batched_tokens)
    options["num_blocks"] += args.groups * (args.prefix // 16 + 1)
    if args.kv_blocks:  # a pool that cannot keep every prefix: what the engines' caches hold together counts
        options["num_blocks"] = args.kv_blocks
    url, clients, stop = deploy(path, routing, options, args)
    rows = []
    try:
        leg = HttpLeg(url)
        deadline = time.monotonic() + 180
        while True:  # the peer's router finds its workers after it starts: ready when it answers
            try:
                leg(GenRequest("warm up", [], 2), None)
                break
            except (openai.APIStatusError, openai.APIConnectionError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(1.0)
        leg.mismatches.clear()
        if capacity is None:
            capacity = {}
            for kind, pool in (("cold", "calibrate"), ("hot", "hot_calibrate")):
                if kind == "hot" and "hot" not in args.workloads:
                    continue
                callers = [loads[pool][i :: args.concurrency] for i in range(args.concurrency)]
                timings, wall_s = closed_loop(leg, callers)
                capacity[kind] = len(timings) / wall_s
                print(f"  capacity ({routing}, closed loop c{args.concurrency}, {kind}): "
                      f"{capacity[kind]:.3f} requests/s")  # fmt: skip
        rates = {"shared": args.load * capacity["cold"], "none": args.load * capacity["cold"]}
        if "hot" in capacity:
            rates["hot"] = args.hot_load * capacity["hot"] / args.engines
        for name in args.workloads:
            before = counters(clients)
            later: list[float] = []
            if name == "chats":
                timings, wall_s, later = chat_loop(leg, talks, args.output, args.chat_think_ms, args.seed)
                outcomes = {"ok": len(timings)}
            else:
                timings, wall_s, outcomes = open_loop(leg, loads[name], rates[name], args.seed)
            after = counters(clients)
            prompt, cached = after[0] - before[0], after[1] - before[1]
            routed = {e: n - before[2].get(e, 0) for e, n in after[2].items()}
            row = summarize(routing, 0, timings, wall_s).to_json()
            row |= {"workload": name, "routing": routing, "prompt_tokens": prompt, "cached_prompt_tokens": cached,
                    "hit_rate": cached / prompt if prompt else 0.0, "rate_rps": rates.get(name),
                    "outcomes": outcomes, "routed": routed}  # fmt: skip
            if later:  # the chats' turns after the first: those whose history an engine may hold
                row["ttft_p50_later_turns_ms"] = statistics.median(later) * 1000
            print(f"  {routing} {name}: TTFT p50 {row['ttft_p50_ms']:.0f} ms, {row['tok_s']:.1f} tok/s, "
                  f"hit rate {row['hit_rate']:.3f}, outcomes {outcomes}, routed {routed}")  # fmt: skip
            rows.append(row)
        if leg.mismatches:
            raise RuntimeError(f"{routing}: wrong answers {leg.mismatches[:3]}")
    finally:
        stop()
        codes = [c.terminate() for c in clients]
    if any(codes):
        raise RuntimeError(f"{routing}: a deployment exited {codes}")
    return rows, capacity


def skew(row: dict) -> float | None:
    """The busiest engine's requests / the mean (None without per-engine counters: least_loaded)."""
    counts = list(row["routed"].values())
    return max(counts) / (sum(counts) / len(counts)) if counts and sum(counts) else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", help="a transformers folder, smollm2 or tiny (default %(default)s)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads per engine (default %(default)s)")
    p.add_argument("--groups", type=int, default=16, help="system prompts (default %(default)s)")
    p.add_argument("--turns", type=int, default=8, help="user turns per system prompt (default %(default)s)")
    p.add_argument("--prefix", type=int, default=1000, help="system prompt tokens (default %(default)s)")
    p.add_argument("--suffix", type=int, default=16, help="user turn tokens (default %(default)s)")
    p.add_argument("--output", type=int, default=16, help="tokens generated per request (default %(default)s)")
    p.add_argument("--load", type=float, default=0.7, help="shared/none arrivals x capacity (default %(default)s)")
    p.add_argument("--calibrate", type=int, default=16, help="requests measuring capacity (default %(default)s)")
    p.add_argument("--concurrency", type=int, default=4, help="callers measuring capacity (default %(default)s)")
    p.add_argument("--chats", type=int, default=32, help="conversations (default %(default)s)")
    p.add_argument("--chat-turns", type=int, default=6, help="turns per conversation (default %(default)s)")
    p.add_argument("--chat-system", type=int, default=200, help="a conversation's system prompt tokens")
    p.add_argument("--chat-think-ms", type=float, default=0.0, help="mean think time between a chat's turns")
    p.add_argument("--hot", type=int, default=32, help="requests behind the one hot prefix (default %(default)s)")
    p.add_argument("--hot-load", type=float, default=2.0, help="their arrivals x one engine's hot capacity")
    p.add_argument("--workloads", type=lambda s: s.split(","), default=list(WORKLOADS),
                   help="a comma-separated subset of %(default)s")  # fmt: skip
    p.add_argument("--max-running", type=int, default=16, help="sequences per engine (default %(default)s)")
    p.add_argument("--max-batched-tokens", type=int, default=256)
    p.add_argument(
        "--kv-blocks",
        type=int,
        default=0,
        help="each engine's KV pool in blocks of 16 (default: room for max-running sequences and every "
        "prefix besides, so each engine can keep them all)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--sglang-router",
        default="",
        help="the sglang-router command: a leg with SGLang's router "
        "(cache_aware) in front of --engines single-engine deployments (pip install sglang-router)",
    )
    p.add_argument(
        "--vllm-router",
        default="",
        help="the vllm-router command: a leg with vLLM's router "
        "(cache_aware) in front of --engines single-engine deployments (pip install vllm-router)",
    )
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if unknown := set(args.workloads) - set(WORKLOADS):
        p.error(f"--workloads: unknown {sorted(unknown)}, choose from {WORKLOADS}")
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="zserve-routing-bench-") as tmp:
        path = resolve_model(args.model, args.dtype, Path(tmp))
        tokenizer = AutoTokenizer.from_pretrained(path)
        loads, talks = workloads(tokenizer, args), chats(tokenizer, args)
        ideal = ideal_hit_rate(loads["shared"], 16)
        print(f"{len(loads['shared'])} requests shared/none, {args.chats} x {args.chat_turns} chat turns, "
              f"{args.hot} hot; one engine keeping every prefix would hit {ideal:.3f} of shared")  # fmt: skip
        rows, capacity = run_leg(path, "least_loaded", loads, talks, None, args)
        rows += run_leg(path, "cache_aware", loads, talks, capacity, args)[0]
        for peer in PEERS:
            if getattr(args, peer):
                rows += run_leg(path, peer, loads, talks, capacity, args)[0]
    by = {(r["routing"], r["workload"]): r for r in rows}
    print(f"{'ROUTING':>12} {'WORKLOAD':>8} {'REQS':>5} {'TTFT_P50_MS':>11} {'TTFT_P99_MS':>11} {'TOK/S':>7} "
          f"{'HIT_RATE':>8} {'SKEW':>5}  OUTCOMES")  # fmt: skip
    for r in rows:
        s = skew(r)
        print(f"{r['routing']:>12} {r['workload']:>8} {r['requests']:>5} {r['ttft_p50_ms']:>11.0f} "
              f"{r['ttft_p99_ms']:>11.0f} {r['tok_s']:>7.1f} {r['hit_rate']:>8.3f} "
              f"{'-' if s is None else f'{s:.2f}':>5}  {r['outcomes']}")  # fmt: skip

    def ratio(workload: str, key: str) -> float:
        return by["cache_aware", workload][key] / by["least_loaded", workload][key]

    ratios: dict[str, float | None] = {}
    said = []  # each target's figure, for the summary line
    if "shared" in args.workloads:
        ratios["shared_ttft_p50"] = ratio("shared", "ttft_p50_ms")
        ratios["shared_tok_s"] = ratio("shared", "tok_s")
        ratios["shared_hit_vs_one_engine"] = by["cache_aware", "shared"]["hit_rate"] / ideal if ideal else 0.0
        said.append(f"shared TTFT p50 {ratios['shared_ttft_p50']:.2f}x (target <= {TTFT_TARGET}), tok/s "
                    f"{ratios['shared_tok_s']:.2f}x (target >= {TOK_S_TARGET}), hit rate "
                    f"{ratios['shared_hit_vs_one_engine']:.2f}x one engine's (target >= 0.9)")  # fmt: skip
    if "chats" in args.workloads:
        ratios["chats_ttft_p50"] = ratio("chats", "ttft_p50_ms")
        said.append(f"chats TTFT p50 {ratios['chats_ttft_p50']:.2f}x (target <= {CHAT_TTFT_TARGET})")
    if "none" in args.workloads:
        ratios["none_tok_s"] = ratio("none", "tok_s")
        said.append(f"none tok/s {ratios['none_tok_s']:.2f}x (target >= {NONE_TOK_S_TARGET})")
    if "hot" in args.workloads:
        ratios["hot_busiest_vs_mean"] = skew(by["cache_aware", "hot"])
        said.append(f"hot busiest engine {ratios['hot_busiest_vs_mean'] or 0:.2f}x the mean (target <= "
                    f"{HOT_SKEW_TARGET}), outcomes {by['cache_aware', 'hot']['outcomes']}")  # fmt: skip
    for name in PEERS:  # zserve's broker against each peer router: hit rate >= 1x, TTFT p50 <= 1x
        if (name, "shared") not in by:
            continue
        ours, peer = by["cache_aware", "shared"], by[name, "shared"]
        hit = ratios[f"shared_hit_vs_{name}"] = ours["hit_rate"] / max(peer["hit_rate"], 1e-9)
        ttft = ratios[f"shared_ttft_p50_vs_{name}"] = ours["ttft_p50_ms"] / peer["ttft_p50_ms"]
        print(f"cache_aware / {name} (shared): hit rate {hit:.2f}x (target >= 1.0), "
              f"TTFT p50 {ttft:.2f}x (target <= 1.0)")  # fmt: skip
    print(f"capacity {', '.join(f'{k} {v:.3f}' for k, v in capacity.items())} requests/s; cache_aware / "
          f"least_loaded: {'; '.join(said)}; {args.engines} engines x {args.threads} threads")  # fmt: skip
    out = args.out or RESULTS / f"routing-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    document = {"args": vars(args) | {"out": str(out)}, "rows": rows, "ideal_hit_rate": ideal, "ratios": ratios,
                "capacity_rps": capacity}  # fmt: skip
    out.write_text(json.dumps(document, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
