"""The rollout producer: keeps the rollout pool busy with prompt groups as far as the sample buffer admits
them, scores each finished group and hands it to the buffer.

It runs its own asyncio event loop on a background thread, so generation overlaps training in
asynchronous mode (max_head_offpolicyness > 0) and the controller's main thread stays synchronous.
A failed generation releases its slot, is counted, puts its prompt back at the head of the stream and
pauses all admissions for a back-off that doubles with each consecutive failure (reset by a success); it
never stops the producer. Generations that were already in flight when a failure set the back-off fail of the
same cause (the only instance died under all of them) and do not double it again: counted one by one, a burst
of N would wait 2^N times the first back-off after the cause was gone.

A stop cancels what is in flight: every drawn prompt whose generation it cancelled is recorded
(`cancelled_prompts`), and the buffer slot of a generation that had not begun yet is released as a begun one's
is. `wait_paused` returns once the loop has seen a pause, after which nothing more is admitted.

A resume hands the producer the stream from the first prompt not done (`prompts_drawn`, the index it starts
counting from) and the indices done past it (`skip`), as `libra.controller.prompt_ledger` kept them.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from libra.controller.batching import Group, SampleBuffer
from libra.controller.events import EventLog
from libra.data.prompt import response_budget
from libra.observability.phase_trace import get_tracer

log = logging.getLogger(__name__)

GenerateFn = Callable[..., Awaitable[Sequence[Any]]]
"""`await generate(prompt_ids, n=, max_new_tokens=, temperature=, top_p=, seed=) -> [Completion]`."""
ScoreFn = Callable[[Any, list[int]], float]
"""`score(prompt, response_ids) -> reward`."""


@dataclass(frozen=True)
class SamplingSettings:
    n_samples: int
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0


class BusyClock:
    """Wall time during which at least one generation was in flight (the rollout share of a run)."""

    def __init__(self) -> None:
        self._active = 0
        self._since = 0.0
        self._total = 0.0
        self._lock = threading.Lock()

    def enter(self) -> None:
        with self._lock:
            if self._active == 0:
                self._since = time.monotonic()
            self._active += 1

    def exit(self) -> None:
        with self._lock:
            self._active -= 1
            if self._active == 0:
                self._total += time.monotonic() - self._since

    def total(self) -> float:
        with self._lock:
            extra = time.monotonic() - self._since if self._active else 0.0
            return self._total + extra


class RolloutProducer:
    def __init__(
        self,
        generate: GenerateFn,
        prompts: Iterator[Any],
        score: ScoreFn,
        buffer: SampleBuffer,
        sampling: SamplingSettings,
        events: EventLog,
        prompts_drawn: int = 0,
        skip: Collection[int] = (),
        poll_s: float = 0.1,
        error_backoff_s: float = 1.0,
        max_error_backoff_s: float = 30.0,
    ) -> None:
        self.generate = generate
        self.prompts = prompts
        self.score = score
        self.buffer = buffer
        self.sampling = sampling
        self.events = events
        self.prompts_drawn = prompts_drawn
        self.skip = frozenset(skip)
        self.poll_s = poll_s
        self.error_backoff_s = error_backoff_s
        self.max_error_backoff_s = max_error_backoff_s
        self._consecutive_failures = 0
        self._pause_until = 0.0
        self._backoff_raised_at = 0.0  # when the back-off last doubled (monotonic)
        self._retry: deque[tuple[int, Any]] = deque()
        self.groups_done = 0
        self.failures = 0
        self.response_tokens = 0
        self.busy = BusyClock()
        self._stop = threading.Event()
        self._paused = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._begun: set[int] = set()  # the prompts whose generation task has begun running
        self.cancelled_prompts: list[int] = []  # drawn prompts whose generation a stop cancelled
        self._pause_seen = threading.Event()
        self._last_error_event = 0.0

    # ---- lifecycle ------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._thread_main, name="libra-rollout-producer", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop admitting, cancel in-flight generations and join the thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout)
            if self._thread.is_alive():
                log.warning("rollout producer did not stop within %.0fs", timeout)
            self._thread = None

    def pause(self) -> None:
        """Admit no new groups (in-flight ones finish)."""
        self._pause_seen.clear()
        self._paused.set()

    def wait_paused(self, timeout: float) -> bool:
        """Wait until the loop has seen the pause (a group it was admitting when `pause` came is drawn by
        then); True at once when the producer does not run. False after `timeout`."""
        if not self.running:
            return True
        return self._pause_seen.wait(timeout)

    def resume(self) -> None:
        self._paused.clear()

    def run_coroutine(self, coro: Any, timeout: float) -> Any:
        """Run `coro` on the producer's event loop (where the rollout pool's clients live) and wait."""
        loop = self._loop
        if loop is None or not self.running:
            coro.close()
            raise RuntimeError("the rollout producer is not running")
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _thread_main(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._main())
        except Exception as exc:  # keep the cause in the event log; the training loop times out visibly
            self.events.emit("error", f"rollout producer stopped: {type(exc).__name__}: {exc}")
            log.exception("rollout producer crashed")
        finally:
            loop.close()
            self._loop = None

    async def _main(self) -> None:
        loop = asyncio.get_running_loop()
        changed = asyncio.Event()

        def wake() -> None:
            if not loop.is_closed():
                try:
                    loop.call_soon_threadsafe(changed.set)
                except RuntimeError:  # the loop closed in between: nobody is waiting any more
                    pass

        self.buffer.add_listener(wake)
        while not self._stop.is_set():
            changed.clear()
            if self._paused.is_set():
                self._pause_seen.set()
            if (self._paused.is_set() or time.monotonic() < self._pause_until) or not self.buffer.admit():
                # woken by the buffer (a batch taken, new weights served, a group done) or after poll_s
                try:
                    await asyncio.wait_for(changed.wait(), self.poll_s)
                except TimeoutError:
                    pass
                continue
            if self._retry:
                index, prompt = self._retry.popleft()
            else:
                try:
                    index, prompt = self._draw()
                except StopIteration:
                    self.buffer.cancel()
                    self.events.emit("error", "the prompt stream is exhausted")
                    break
            task = asyncio.create_task(self._one(index, prompt))
            self._tasks.add(task)
            task.add_done_callback(functools.partial(self._task_done, index))
        self._pause_seen.set()  # nothing is admitted any more
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def _draw(self) -> tuple[int, Any]:
        """The next prompt of the stream and its index, past those in `skip` (done before a resume)."""
        while True:
            prompt = next(self.prompts)
            index = self.prompts_drawn
            self.prompts_drawn += 1
            if index not in self.skip:
                return index, prompt

    def _task_done(self, index: int, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            self.cancelled_prompts.append(index)
            if index not in self._begun:  # cancelled before it ran: its slot is released here, not in _one
                self.buffer.cancel()
        self._begun.discard(index)

    async def _one(self, index: int, prompt: Any) -> None:
        self._begun.add(index)
        s = self.sampling
        started, started_monotonic = time.time(), time.monotonic()
        self.busy.enter()
        try:
            with get_tracer().span("rollout.generate", prompt=index, n=s.n_samples) as span:
                completions = await self.generate(
                    list(prompt.token_ids),
                    n=s.n_samples,
                    max_new_tokens=response_budget(prompt, s.max_new_tokens),  # a task may ask for fewer
                    temperature=s.temperature,
                    top_p=s.top_p,
                    seed=s.seed + index,
                )
                span.set(instance=str(getattr(completions[0], "instance_id", "")) if completions else "")
            with get_tracer().span("rollout.reward", prompt=index):
                responses = [list(c.token_ids) for c in completions]
                rewards = [float(self.score(prompt, r)) for r in responses]
        except asyncio.CancelledError:
            self.busy.exit()
            self.buffer.cancel()
            raise
        except Exception as exc:
            self.busy.exit()
            self.failures += 1
            now = time.monotonic()
            if started_monotonic >= self._backoff_raised_at or not self._consecutive_failures:
                self._consecutive_failures += 1  # an attempt made after the last doubling failed too
                self._backoff_raised_at = now
            backoff = min(self.max_error_backoff_s, self.error_backoff_s * 2 ** (self._consecutive_failures - 1))
            self._pause_until = max(self._pause_until, now + backoff)
            self._retry.append((index, prompt))
            self.buffer.cancel()
            if now - self._last_error_event > 10.0:  # one event per burst of failures
                self._last_error_event = now
                self.events.emit("rollout_error", f"{type(exc).__name__}: {exc}", failures=self.failures,
                                 backoff_s=round(backoff, 2))
            return
        except BaseException:
            self.busy.exit()
            raise
        self.busy.exit()
        self._consecutive_failures = 0
        group = Group(
            index=index,
            prompt=prompt,
            prompt_ids=list(prompt.token_ids),
            responses=responses,
            logprobs=[list(c.logprobs) for c in completions],
            versions=[int(c.weight_version) for c in completions],
            rewards=rewards,
            finish_reasons=[str(c.finish_reason) for c in completions],
            started_at=started,
            finished_at=time.time(),
        )
        self.groups_done += 1
        self.response_tokens += group.response_tokens
        self.buffer.finish(group)
