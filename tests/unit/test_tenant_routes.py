"""Every route hands the broker its API key's tenant and priority, rerank, score and MII included: a keyed tenant
past its quota is answered 429 there too, and a key asking more urgent than its ``max_priority`` gets 403 before
anything reaches the broker. The frontend's real falcon app (``create_app``), with its broker client standing in
for a broker whose quota refuses every request of tenant "capped" (as the broker's admission answers it)."""

from __future__ import annotations

from typing import Any

import falcon.testing
import pytest

from zserve.client import AsyncClient
from zserve.config import FrontendSettings, ServedModel
from zserve.errors import RateLimited
from zserve.frontends import app as app_module

CAPPED_KEY = "zs-capped-0123456789"
LOW_KEY = "zs-low-0123456789"
RERANK = {"model": "rerank", "query": "q", "documents": ["a", "b"]}
SCORE = {"model": "rerank", "text_1": "q", "text_2": ["a", "b"]}
MII = {"prompts": ["a", "b"], "max_new_tokens": 2}
ROUTES = [("/v1/rerank", RERANK), ("/v2/rerank", RERANK), ("/v1/score", SCORE), ("/mii/lm", MII)]


class _QuotaBroker(AsyncClient):
    """What the broker's admission does with a request's tenant: "capped" is past its quota (429)."""

    seen: list[tuple[int, str]] = []

    async def infer(self, model: str, item: Any, *, priority: int = 0, tenant: str = "", **kwargs: Any) -> Any:
        self.seen.append((priority, tenant))
        if tenant == "capped":
            raise RateLimited(f"tenant {tenant!r} is past requests_per_s", field="requests_per_s")
        raise AssertionError(f"tenant {tenant!r} priority {priority} reached the broker")


@pytest.fixture(scope="module")
def client(tmp_path_factory, tiny_cross_encoder) -> falcon.testing.TestClient:
    run = tmp_path_factory.mktemp("quota-broker")
    keys = run / "api_keys"
    keys.write_text(f"{CAPPED_KEY} tenant=capped\n{LOW_KEY} tenant=low priority=10 max_priority=10\n")
    settings = FrontendSettings(
        client_endpoint=f"ipc://{run}/client.sock",
        api_keys_file=str(keys),
        models=[
            ServedModel(name="lm", handler="zserve.models.causal_lm:CausalLM", options={"path": str(run)}),
            ServedModel(name="rerank", handler="zserve.models.rerank:CrossEncoderRerank",
                        options={"path": str(tiny_cross_encoder)}),
        ],
    )  # fmt: skip
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(app_module, "AsyncClient", _QuotaBroker)
        return falcon.testing.TestClient(app_module.create_app(settings))


@pytest.mark.parametrize(("path", "body"), ROUTES, ids=[p for p, _ in ROUTES])
def test_a_tenant_past_its_quota_gets_429_on_every_route(client, path, body):
    _QuotaBroker.seen.clear()
    resp = client.simulate_post(path, json=body, headers={"Authorization": f"Bearer {CAPPED_KEY}"})
    assert resp.status_code == 429, resp.text
    error = resp.json["error"]
    assert "rate_limited" in (error["type"], error.get("code")), error
    assert (error.get("param") or error.get("field")) == "requests_per_s", error
    assert _QuotaBroker.seen and all(seen == (0, "capped") for seen in _QuotaBroker.seen), _QuotaBroker.seen


@pytest.mark.parametrize(("path", "body"), ROUTES, ids=[p for p, _ in ROUTES])
def test_a_key_asking_more_urgent_than_its_max_priority_gets_403_on_every_route(client, path, body):
    _QuotaBroker.seen.clear()
    resp = client.simulate_post(path, json={**body, "priority": 0}, headers={"Authorization": f"Bearer {LOW_KEY}"})
    assert resp.status_code == 403, resp.text
    error = resp.json["error"]
    assert "permission_denied" in (error["type"], error.get("code")), error
    assert (error.get("param") or error.get("field")) == "priority", error
    assert _QuotaBroker.seen == []
