from __future__ import annotations

from zserve.broker.requests import RequestTable


def test_deadlines_expire_in_order_and_answered_requests_never_do():
    t = RequestTable()
    a = t.add(b"c", 1, "m", [], False, now=0.0, timeout_s=1.0)
    b = t.add(b"c", 2, "m", [], False, now=0.0, timeout_s=0.5)
    c = t.add(b"d", 1, "m", [], False, now=0.0, timeout_s=2.0)
    assert len({a.item_id, b.item_id, c.item_id}) == 3  # clients' ids may collide, the table's never
    assert t.find(b"d", 1) is c
    t.pop(a.item_id)
    assert t.next_deadline_s() == 0.5
    assert t.expired(0.4) == []
    assert t.expired(1.5) == [b]  # a was answered already
    t.pop(b.item_id)
    assert t.next_deadline_s() == 2.0
    assert len(t) == 1
