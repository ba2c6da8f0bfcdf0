"""The OpenAPI document's error answers (zserve/frontends/openapi.py): 429 (a tenant's quota) and 403 (a key's priority
cap) exactly on the routes whose requests reach the broker when API keys are on, with Retry-After on 429 and 503."""

from __future__ import annotations

from openapi_spec_validator import validate

from zserve.frontends.openapi import openapi_document


def _codes(doc: dict, path: str, method: str = "post") -> set[str]:
    return set(doc["paths"][path][method]["responses"])


def test_keyed_routes_that_reach_the_broker_document_429_and_403_with_retry_after() -> None:
    doc = openapi_document(["echo", "lm"], ["lm"], [], [], secured=True, auth_health=False)
    validate(doc)
    for path in ("/v1/models/{name}/predict", "/v1/completions", "/v1/chat/completions"):
        assert {"401", "403", "429", "503"} <= _codes(doc, path), path
        responses = doc["paths"][path]["post"]["responses"]
        assert "Retry-After" in responses["429"]["headers"] and "Retry-After" in responses["503"]["headers"]
    assert "408" in _codes(doc, "/v1/models/{name}/predict")
    for path in ("/v1/models", "/readyz", "/openapi.json"):  # nothing there is queued in the broker
        assert not {"403", "429"} & _codes(doc, path, "get"), path


def test_without_keys_there_is_no_tenant_so_no_429() -> None:
    doc = openapi_document(["echo"], [], [], [], secured=False, auth_health=False)
    validate(doc)
    assert not {"401", "403", "429"} & _codes(doc, "/v1/models/{name}/predict")
