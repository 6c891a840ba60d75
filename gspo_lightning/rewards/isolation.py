"""Running user reward functions so that a hang, a crash or an infinite loop cannot take the trainer down.

``RewardRunner`` calls one reward function on one rollout batch in one of three ways:

- ``"thread"``: in a fresh daemon thread, waiting at most ``timeout_s``. Python cannot stop a thread, so a
  call that overruns is abandoned: the thread keeps running (and using CPU) until the function returns or the
  process ends, but the trainer moves on and the thread never blocks the interpreter's exit.
- ``"process"``: in a worker process (a ``ProcessPoolExecutor`` with the ``spawn`` start method, created on
  first use and reused). On a timeout, or when the worker dies (segfault, ``os._exit``, out of memory), the
  worker is killed and a fresh one is started for the next call. Functions, prompts, completions and columns
  must be picklable (module-level functions or classes, not lambdas or closures).
- ``"none"``: a direct call in the trainer's thread; no timeout can be enforced.
"""

from __future__ import annotations

import multiprocessing
import pickle
import threading
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Literal

RewardIsolation = Literal["thread", "process", "none"]
REWARD_ISOLATIONS: tuple[str, ...] = ("thread", "process", "none")

# Starting a spawned worker and importing a reward function's module (which may import torch) is not the
# reward's own time: it gets this long, once per function and worker, before the timeout applies.
WORKER_STARTUP_TIMEOUT_S = 600.0


class RewardTimeoutError(TimeoutError):
    """A reward function did not return within the timeout."""


class RewardWorkerCrashedError(RuntimeError):
    """The worker process running a reward function died (segfault, ``os._exit``, out of memory)."""


class RewardNotPicklableError(TypeError):
    """A reward function or its inputs cannot be sent to a worker process."""


class RewardRunner:
    """Calls reward functions under an isolation mode and a timeout (see the module docstring).

    Args:
        isolation: ``"thread"``, ``"process"`` or ``"none"``.
        timeout_s: seconds one call may take (None: no limit); must be None with ``"none"``.
    """

    def __init__(self, isolation: RewardIsolation = "thread", timeout_s: float | None = 60.0) -> None:
        if isolation not in REWARD_ISOLATIONS:
            raise ValueError(f"reward isolation must be one of {list(REWARD_ISOLATIONS)}, got {isolation!r}")
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"the reward timeout must be > 0 seconds or None, got {timeout_s}")
        if isolation == "none" and timeout_s is not None:
            raise ValueError("a reward timeout needs isolation 'thread' or 'process': 'none' cannot stop a call")
        self.isolation = isolation
        self.timeout_s = timeout_s
        self._pool: ProcessPoolExecutor | None = None
        self._warmed: set[int] = set()

    def __call__(self, fn: Any, prompts: list[Any], completions: list[str], columns: dict[str, list[Any]]) -> Any:
        """``fn(prompts, completions, **columns)``; raises what ``fn`` raises, or one of this module's errors."""
        if self.isolation == "process":
            return self._in_process(fn, prompts, completions, columns)
        if self.isolation == "thread" and self.timeout_s is not None:
            return self._in_thread(fn, prompts, completions, columns)
        return fn(prompts, completions, **columns)

    def _in_thread(self, fn: Any, prompts: list[Any], completions: list[str], columns: dict[str, list[Any]]) -> Any:
        assert self.timeout_s is not None
        late = RewardTimeoutError(f"did not return within reward_timeout_s={self.timeout_s} s (its thread was "
                                  "abandoned and keeps running in the background)")  # fmt: skip
        return in_daemon_thread(lambda: fn(prompts, completions, **columns), self.timeout_s, "gspo-reward", late)

    def _in_process(
        self, fn: Any, prompts: list[Any], completions: list[str], columns: dict[str, list[Any]]
    ) -> Any:
        _check_picklable(fn, "the reward function")
        _check_picklable((prompts, completions, columns), "the prompts, completions or columns")
        pool = self._worker_pool()
        # Builtins as the worker's entry points: the worker imports only what ``fn`` itself needs.
        if id(fn) not in self._warmed:  # unpickling `fn` imports its module, outside the reward's time limit
            self._wait(pool.submit(id, fn), WORKER_STARTUP_TIMEOUT_S, " while loading")
            self._warmed.add(id(fn))
        return self._wait(pool.submit(fn, prompts, completions, **columns), self.timeout_s, "")

    def _wait(self, future: Any, timeout_s: float | None, when: str) -> Any:
        try:
            return future.result(timeout=timeout_s)
        except FutureTimeoutError as error:
            if future.done():  # finished at the deadline, or ``fn`` raised a TimeoutError of its own
                return future.result()
            self.close()
            raise RewardTimeoutError(
                f"did not return within {timeout_s} s{when} (reward_timeout_s={self.timeout_s}); its worker "
                "process was killed and a new one will serve the next call"
            ) from error
        except BrokenProcessPool as error:
            self.close()
            raise RewardWorkerCrashedError(
                f"killed its worker process{when} (segfault, os._exit, out of memory or a signal); "
                "a new worker will serve the next call"
            ) from error

    def _worker_pool(self) -> ProcessPoolExecutor:
        if self._pool is None:
            context = multiprocessing.get_context("spawn")
            self._pool = ProcessPoolExecutor(max_workers=1, mp_context=context)
            self._warmed = set()
        return self._pool

    def close(self) -> None:
        """Kill the worker process, if any (a later call starts a new one)."""
        pool, self._pool = self._pool, None
        if pool is None:
            return
        processes = getattr(pool, "_processes", None) or {}  # private, but the only handle on the workers
        for process in list(processes.values()):
            if process.is_alive():
                process.kill()
        pool.shutdown(wait=True, cancel_futures=True)

    def __getstate__(self) -> dict[str, Any]:
        # A copy of the runner (deepcopy, pickling) starts without the original's worker.
        return {**self.__dict__, "_pool": None, "_warmed": set()}


def in_daemon_thread(call: Callable[[], Any], timeout_s: float, name: str, late: Exception) -> Any:
    """``call()`` in a fresh daemon thread, waiting at most ``timeout_s``; raises ``late`` when it overruns (the
    thread is abandoned: Python cannot stop one) and the call's own error, in the caller's thread."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = call()
        except BaseException as error:  # handed to the caller's thread
            outcome["error"] = error

    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise late
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _check_picklable(value: Any, what: str) -> None:
    try:
        pickle.dumps(value)
    except Exception as error:
        raise RewardNotPicklableError(
            f"cannot send {what} to a worker process ({type(error).__name__}: {error}); "
            "sampler.reward_isolation='process' needs picklable reward functions and columns: define the "
            "function at module level (not a lambda or closure), or use reward_isolation 'thread'"
        ) from error
