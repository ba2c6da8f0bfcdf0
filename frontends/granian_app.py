"""The app granian serves: zserve's falcon ASGI app, plus what gunicorn's asgi worker does for it and
granian does not: when the client hangs up before the response is complete, cancel the request's task
(gunicorn does this with ``--asgi-disconnect-grace-period 0``), so that the broker cancels the request
instead of computing it for nobody. granian reports the hang-up only as an ``http.disconnect`` message
from ``receive()``; once the body is read, a watcher waits for it."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from zserve.frontends.app import create_app as create_falcon_app

Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class CancelOnDisconnect:
    def __init__(self, app: Callable[[dict, Receive, Send], Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        task = asyncio.current_task()
        length = next((int(v) for k, v in scope["headers"] if k.lower() == b"content-length" and v.isdigit()), None)
        received = 0
        later: asyncio.Queue[Message] = asyncio.Queue()  # what receive() returns once the watcher owns it
        watcher: asyncio.Task | None = None
        done = False  # the response is complete: a hang-up now cancels nothing

        async def watch() -> None:
            while True:
                message = await receive()
                later.put_nowait(message)
                if message["type"] == "http.disconnect":
                    if not done and task is not None:
                        task.cancel()
                    return

        async def wrapped_receive() -> Message:
            nonlocal watcher, received
            if watcher is not None:
                return await later.get()
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                # falcon stops reading at Content-Length, before granian's final empty message
                if not message.get("more_body", False) or (length is not None and received >= length):
                    watcher = asyncio.create_task(watch())
            return message

        async def wrapped_send(message: Message) -> None:
            nonlocal done
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                done = True
            await send(message)

        try:
            await self.app(scope, wrapped_receive, wrapped_send)
        finally:
            if watcher is not None:
                watcher.cancel()


def create_app() -> CancelOnDisconnect:
    return CancelOnDisconnect(create_falcon_app())
