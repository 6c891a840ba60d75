"""Pieces shared by the hostile-program suite: victims outside the run, leftover processes, honest programs."""

from __future__ import annotations

import hashlib
import itertools
import os
import socket
import stat
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from gspo_lightning.sandbox import Sandbox, isolation_unavailable_reason
from gspo_lightning.sandbox.spec import LaunchSpec, Outcome

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "gspo_lightning/data/samples/code.jsonl"
LAUNCHER = ROOT / "gspo_lightning/sandbox/launcher"

needs_isolation = pytest.mark.skipif(
    isolation_unavailable_reason() is not None, reason=f"no sandbox isolation here: {isolation_unavailable_reason()}"
)
needs_root = pytest.mark.skipif(os.getuid() != 0, reason="needs a trainer running as root (per-run uids)")

# What the program may not know how to solve without cheating: the sample's first problem, `add`.
ADD_TESTS = '[{"input": [1, 2], "output": 3}, {"input": [-5, 5], "output": 0}, {"input": [100, 23], "output": 123}]'
HONEST_ADD = "def add(a, b):\n    return a + b\n"
# An honest sibling that is still running while a hostile program looks around.
SLOW_HONEST_ADD = "import time\ntime.sleep(0.5)\ndef add(a, b):\n    return a + b\n"
# An honest program that needs what a poisoned slot would lack: threads, files in its directory and /tmp.
THREADED_HONEST_ADD = (
    "import threading, tempfile, os\n"
    "results = []\n"
    "threads = [threading.Thread(target=results.append, args=(i,)) for i in range(16)]\n"
    "[t.start() for t in threads]\n[t.join() for t in threads]\n"
    "assert sorted(results) == list(range(16))\n"
    "with open('mine.txt', 'w') as handle:\n    handle.write('x')\n"
    "with tempfile.NamedTemporaryFile(dir='/tmp') as handle:\n    handle.write(b'y')\n"
    "def add(a, b):\n    return a + b\n"
)


def processes_of(uids: set[int]) -> list[int]:
    """Processes on this machine whose real uid is one of ``uids`` (a program's uid: whatever it became)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
        except OSError:  # gone
            continue
        uid_line = next(line for line in status.splitlines() if line.startswith("Uid:"))
        if int(uid_line.split()[1]) in uids:
            found.append(int(entry.name))
    return found


def run_launcher(spec: LaunchSpec) -> tuple[subprocess.CompletedProcess, Outcome]:
    """Start the launcher by hand on ``spec``, as ``Sandbox`` does, and read its outcome."""
    spec_file, status = os.memfd_create("spec"), os.memfd_create("status")
    try:
        os.write(spec_file, spec.to_wire())
        os.lseek(spec_file, 0, os.SEEK_SET)
        command = [sys.executable, "-I", "-S", str(LAUNCHER), str(spec_file), str(status)]
        completed = subprocess.run(command, pass_fds=(spec_file, status), capture_output=True, timeout=60)
        return completed, Outcome.from_wire(os.pread(status, 1 << 16, 0))
    finally:
        os.close(spec_file)
        os.close(status)


def sandbox_uids(sandbox: Sandbox) -> set[int]:
    """Every uid a sandbox has given its programs so far."""
    return set(sandbox.uids_used)


@dataclass
class Victims:
    """Files and folders outside any run that a hostile program would like to read, change or delete.

    The folder is world-traversable, so only the sandbox (not file modes) keeps a program away from them.
    """

    root: Path
    servers: list[socket.socket] = field(default_factory=list)
    _before: dict[str, tuple] = field(default_factory=dict)

    @property
    def checkpoints(self) -> Path:
        return self.root / "runs/exp/checkpoints"

    @property
    def dataset(self) -> Path:
        return self.root / "data/train.jsonl"

    @property
    def socket_path(self) -> Path:
        return self.root / "victim.sock"

    @property
    def abstract_socket(self) -> str:
        """A socket in the abstract namespace (no file), served on the trainer's network namespace."""
        return f"gspo-victim-{self.root.name}"

    @property
    def drop(self) -> Path:
        """A world-writable folder: anything a program leaves here escaped."""
        return self.root / "drop"

    def snapshot(self) -> dict[str, tuple]:
        state = {}
        for path in sorted(self.root.rglob("*")):
            info = path.lstat()
            content = hashlib.sha256(path.read_bytes()).hexdigest() if stat.S_ISREG(info.st_mode) else None
            state[str(path)] = (stat.filemode(info.st_mode), info.st_uid, content)
        state[str(self.root)] = (stat.filemode(self.root.lstat().st_mode),)
        return state

    def changes(self) -> dict[str, tuple]:
        """What differs from the state at creation: path -> (before, after)."""
        after = self.snapshot()
        return {
            path: (self._before.get(path), after.get(path))
            for path in set(self._before) | set(after)
            if self._before.get(path) != after.get(path)
        }


_victim_counter = itertools.count()


def _serve(server: socket.socket) -> None:
    while True:
        try:
            connection, _ = server.accept()
        except OSError:  # closed: the test is over
            return
        with connection:
            connection.sendall(b"pong")


@pytest.fixture
def victims() -> Victims:
    root = Path(f"/tmp/gspo-victims-{os.getpid()}-{next(_victim_counter)}")
    root.mkdir(mode=0o755)
    root.chmod(0o755)
    victims = Victims(root)
    victims.checkpoints.mkdir(parents=True)
    (victims.checkpoints / "last.ckpt").write_bytes(b"weights" * 1000)
    victims.dataset.parent.mkdir()
    victims.dataset.write_text(SAMPLE.read_text())  # the user's copy of the data set, expected outputs included
    (root / "secret.txt").write_text("hf_token_s3cret")
    (root / "secret.txt").chmod(0o600)
    victims.drop.mkdir()
    victims.drop.chmod(0o777)
    for folder in (victims.checkpoints, victims.checkpoints.parent, victims.checkpoints.parent.parent):
        folder.chmod(0o755)
    for address in (str(victims.socket_path), "\0" + victims.abstract_socket):
        server = socket.socket(socket.AF_UNIX)
        server.bind(address)
        server.listen(8)
        victims.servers.append(server)
        threading.Thread(target=_serve, args=(server,), daemon=True).start()
    victims.socket_path.chmod(0o777)
    victims._before = victims.snapshot()
    yield victims
    for server in victims.servers:
        server.close()
    # Without namespaces (the best_effort fallback) a program shares the host's /tmp: links it left there pointing
    # into the victims go with them (hostile.py's links_to_victims_left_behind makes /tmp/runs)
    for path in Path("/tmp").iterdir():
        if path.is_symlink() and os.readlink(path).startswith(str(root)):
            path.unlink()
    for path in sorted(root.rglob("*"), key=lambda p: -len(p.parts)):
        if path.is_dir() and not path.is_symlink():
            path.chmod(0o700)
            path.rmdir()
        else:
            path.unlink()
    root.rmdir()
