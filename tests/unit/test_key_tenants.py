"""API key lines naming a tenant and a default priority (zserve/frontends/auth.py), and how a request's priority is
chosen: the body's, else the native routes' header, else the key's."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from zserve.frontends.auth import ANONYMOUS, ApiKeys, Caller, read_keys_file
from zserve.frontends.resources import RequestError, priority_and_tenant


def test_key_lines_name_a_tenant_and_a_priority(tmp_path) -> None:
    path = tmp_path / "keys"
    path.write_text("# keys\nplain\nteam-a tenant=a\nbatch tenant=nightly priority=7\n\n")
    assert read_keys_file(str(path)) == [
        (b"plain", ANONYMOUS),
        (b"team-a", Caller("a", 0)),
        (b"batch", Caller("nightly", 7, 7)),
    ]
    keys = ApiKeys(str(path), [(b"env", ANONYMOUS)])
    assert keys.caller("Bearer batch") == Caller("nightly", 7, 7)
    assert keys.caller("Bearer env") is ANONYMOUS
    assert keys.caller("Bearer nope") is None and not keys.allows("Bearer nope") and keys.allows("Bearer plain")


@pytest.mark.parametrize(
    "line",
    ["k tenant", "k colour=red", "k priority=high", "k tenant=a tenant=b", "k tenant=", "k max_priority=soon",
     "k priority=-1 max_priority=0", "k max_priority=5", "k priority=2000000"],
)  # fmt: skip
def test_bad_key_lines_name_the_line_not_the_key(tmp_path, line: str) -> None:
    path = tmp_path / "keys"
    path.write_text(f"ok\n{line}\n")
    with pytest.raises(ValueError, match=r"keys:2: ") as info:
        read_keys_file(str(path))
    assert "k " not in str(info.value)


class _Req:
    def __init__(self, caller: Caller | None, header: str | None = None) -> None:
        self.context = SimpleNamespace() if caller is None else SimpleNamespace(caller=caller)
        self.header = header

    def get_header(self, name: str) -> str | None:
        return self.header if name == "X-Zserve-Priority" else None


def test_priority_is_the_bodys_else_the_headers_else_the_keys() -> None:
    key = Caller("t", 4, -5)
    assert priority_and_tenant(_Req(key), -2) == (-2, "t")
    assert priority_and_tenant(_Req(key, "-1")) == (-1, "t")
    assert priority_and_tenant(_Req(key)) == (4, "t")
    assert priority_and_tenant(_Req(None)) == (0, "")
    for bad in ("soon", "99999999"):
        with pytest.raises(RequestError) as info:
            priority_and_tenant(_Req(None, bad))
        assert info.value.status == 400 and info.value.field == "X-Zserve-Priority"


def test_a_key_line_may_allow_more_urgent_priorities_than_its_own(tmp_path) -> None:
    path = tmp_path / "keys"
    path.write_text("app tenant=app max_priority=-10\nbatch tenant=b priority=5\nops priority=-3\n")
    assert [c for _, c in read_keys_file(str(path))] == [Caller("app", 0, -10), Caller("b", 5, 5), Caller("", -3, -3)]


def test_a_priority_more_urgent_than_the_key_allows_is_403_naming_where_it_came_from() -> None:
    batch = Caller("b", 5, 5)
    assert priority_and_tenant(_Req(batch), 9) == (9, "b")  # less urgent: always allowed
    assert priority_and_tenant(_Req(batch), 5) == (5, "b")
    for req, body, field in ((_Req(batch), 4, "priority"), (_Req(batch, "0"), None, "X-Zserve-Priority")):
        with pytest.raises(RequestError) as info:
            priority_and_tenant(req, body)
        assert info.value.status == 403 and info.value.type_name == "permission_denied"
        assert info.value.field == field and "max_priority" in info.value.message
    with pytest.raises(RequestError):
        priority_and_tenant(_Req(ANONYMOUS), -1)  # a plain key: its own priority 0 is the most urgent
    assert priority_and_tenant(_Req(None), -1000) == (-1000, "")  # no keys: an open API trusts its callers
