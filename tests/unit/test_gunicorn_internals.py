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
