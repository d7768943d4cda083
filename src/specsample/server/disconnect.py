"""A client that hangs up: noticing it while its request waits, and settling the work it leaves behind."""

from __future__ import annotations

import asyncio

from fastapi import Request


async def until_disconnected(request: Request) -> None:
    """Return once the client of `request` has gone away."""
    while not await request.is_disconnected():
        await asyncio.sleep(0.25)


def settle(future: asyncio.Future) -> None:
    """Collect a cancelled or abandoned future's outcome, so asyncio logs no 'exception was never retrieved'."""
    if not future.cancelled():
        future.exception()
