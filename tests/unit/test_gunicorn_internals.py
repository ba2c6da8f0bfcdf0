"""What the fast path takes of gunicorn's internals is still where it was (zserve/frontends/gunicorn_internals.py):
this fails naming the attribute and gunicorn's version when a release moves one."""

from __future__ import annotations

import os

from gunicorn.config import Config
from gunicorn.glogging import Logger
from gunicorn.workers import gasgi

from zserve.frontends import gunicorn_internals as gi
from zserve.frontends.fast_worker import FastPathWorker


def test_the_installed_gunicorn_has_every_internal_the_fast_path_uses():
    assert gi.class_problems() == []
    assert gi.idle_close_problems() == [] and gi.IDLE_CLOSE  # the tested gunicorn closes idle connections at a stop
    cfg = Config()
    worker = FastPathWorker(1, os.getppid(), [], None, 30, cfg, Logger(cfg))
    worker.loop = None  # set by init_process
    worker.asgi = None  # set by load_wsgi
    assert gi.worker_problems(worker) == []


def test_a_moved_internal_is_named_with_the_version(monkeypatch):
    async def _serve(self):  # a release that builds connections some other way
        pass

    monkeypatch.setattr(gasgi.ASGIWorker, "_serve", _serve)
    [problem] = gi.class_problems()
    assert f"gunicorn {gi.VERSION}" in problem and "ASGIProtocol" in problem
    assert f"gunicorn {gi.VERSION}: worker.nr_conns" in "\n".join(gi.worker_problems(object()))


def test_a_gunicorn_without_the_idle_close_internals_still_serves_and_leaves_the_protocol_alone(monkeypatch):
    """gunicorn 27.0.0 (pyproject.toml's floor) lacks some of what close_if_idle uses: the worker serves there,
    and a stopping one leaves idle falcon-path connections to their keep-alive, as before."""
    monkeypatch.delattr(gi.ASGIProtocol, "_arm_keepalive_timer")
    [problem] = gi.idle_close_problems()
    assert f"gunicorn {gi.VERSION}" in problem and "_arm_keepalive_timer" in problem
    assert gi.class_problems() == []  # not a reason to refuse to start
    monkeypatch.setattr(gi, "IDLE_CLOSE", False)

    class Protocol:  # what close_if_idle would look at: it must not, nor wrap anything
        _feed_callback_parser = _on_message_complete = _arm_keepalive_timer = None

    protocol = Protocol()
    gi._note_reads(protocol)
    assert not hasattr(protocol, "reads") and gi.close_if_idle(protocol, 1e9, 0.0) is False


def test_a_release_that_feeds_its_parser_without_self_loses_the_idle_close(monkeypatch):
    """The read counter wraps _feed_callback_parser on the instance: were it fed some other way, a head begun
    would pass for idle, and a stop would close it; such a release must lose the prompt close instead."""

    def data_received(self, data):  # a release that feeds its parser directly
        self._callback_parser.feed(data)

    monkeypatch.setattr(gi.ASGIProtocol, "data_received", data_received)
    [problem] = gi.idle_close_problems()
    assert "ASGIProtocol.data_received no longer calls self._feed_callback_parser" in problem
