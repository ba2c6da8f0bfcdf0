"""The live deployment the HTTP fuzz suites share: test_http_fuzz.py (fuzzed bodies, by hypothesis) and
test_openapi.py (its document, and schemathesis against it). One start for both: a start of these models is about
18 s on CI's 2 cores. Package-scoped (this folder is a package): stopped once this folder's tests are done."""

from __future__ import annotations

import pytest
from deployment import Deployment, free_port, write_config
from tinylm import build_tiny_lm

KEY = "zs-fuzz-test-key"
AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}

# API keys with auth_health (test_openapi.py's document says so), a 64 KiB body limit; an echo, an embedding,
# a rerank and a generative model, each of the embedding and rerank ones with a preprocess stage
CONFIG = """
[frontends]
workers = 1
port = {port}
auth_health = true
max_body_bytes = 65536

[[models]]
name = "echo"
handler = "zserve.models.echo:Echo"

[[models]]
name = "minilm"
handler = "zserve.models.embedding:SentenceEmbedding"
credits = 1
preprocess_workers = 1

[[models]]
name = "rerank"
handler = "zserve.models.rerank:CrossEncoderRerank"
max_batch_cost = 4096
preprocess_workers = 1
[models.options]
path = "{reranker}"

[[models]]
name = "tiny"
handler = "zserve.models.causal_lm:CausalLM"
timeout_ms = 60000
[models.options]
path = "{lm}"
block_size = 8
num_blocks = 256
max_running = 8
max_new_tokens = 8
"""


@pytest.fixture(scope="package")
def deployment(tmp_path_factory, tiny_cross_encoder):
    tmp = tmp_path_factory.mktemp("fuzz")
    lm = build_tiny_lm(tmp / "tinylm")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("ZSERVE_API_KEYS", KEY)
        d = Deployment(write_config(tmp, CONFIG.format(port=free_port(), lm=lm, reranker=tiny_cross_encoder)))
    yield d.wait_ready()  # the supervisor's /readyz polls pass with auth_health on
    assert d.request("GET", "/readyz", None, AUTH)[0] == 200  # still serving after everything
    assert d.stop() == 0, d.output
