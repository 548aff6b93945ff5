"""The servers' client session never reuses a connection the server may be closing: an idle connection is
dropped by the client before the vLLM server's keep-alive runs out (a call sent on a connection the server
had just closed failed with "Server disconnected" and failed a weight publish)."""

from __future__ import annotations

import asyncio

from aiohttp import web

from libra.rollout.client import SERVER_KEEP_ALIVE_S, client_session


async def _ports_of_two_calls(idle_s: float) -> list[int]:
    """The client ports the server saw for two calls `idle_s` apart (the same port: a reused connection)."""
    ports: list[int] = []

    async def handler(request: web.Request) -> web.Response:
        peer = request.transport.get_extra_info("peername") if request.transport else None
        ports.append(int(peer[1]) if peer else -1)
        return web.json_response({})

    app = web.Application()
    app.router.add_get("/health", handler)
    runner = web.AppRunner(app, keepalive_timeout=SERVER_KEEP_ALIVE_S)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        async with client_session() as session:
            for pause in (0.0, idle_s):
                await asyncio.sleep(pause)
                async with session.get(f"http://127.0.0.1:{port}/health") as resp:
                    assert resp.status == 200
    finally:
        await runner.cleanup()
    return ports


def test_a_connection_idle_past_half_the_servers_keep_alive_is_not_reused() -> None:
    first, second = asyncio.run(_ports_of_two_calls(SERVER_KEEP_ALIVE_S / 2 + 0.3))
    assert first != second, "the client reused a connection the server was about to close"


def test_a_connection_in_steady_use_is_reused() -> None:
    first, second = asyncio.run(_ports_of_two_calls(0.1))
    assert first == second
