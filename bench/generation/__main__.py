"""``python -m bench.generation``: the generation suite (bench/README.md)."""

import sys

from bench.common.cli import Scenario, dispatch

SCENARIOS = {
    "compare": Scenario("bench.generation.compare", "zserve against static batching and one request at a time"),
    "vllm": Scenario("bench.generation.vs_vllm", "zserve against vLLM's CPU build, one OpenAI streaming client"),
    "llama-server": Scenario(
        "bench.generation.vs_llamacpp", "zserve against llama.cpp's llama-server on the same GGUF, same client"
    ),
    "prefix": Scenario("bench.generation.prefix", "requests sharing a long system prompt, prefix caching off and on"),
    "routing": Scenario("bench.generation.routing", "cache-aware routing across 2 engines against least-loaded"),
    "routing-cost": Scenario("bench.generation.routing_cost", "the broker's CPU per request for routing, 64 engines"),
    "openai": Scenario("bench.generation.openai_features", "cost per token of structured output, penalties, logprobs"),
    "decode-bound": Scenario("bench.generation.decode_bound", "the decode step against the memory-bandwidth bound"),
}

if __name__ == "__main__":
    sys.exit(dispatch("generation", SCENARIOS))
