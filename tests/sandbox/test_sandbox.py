"""The sandbox contains hostile programs: each is stopped or refused, and the test process keeps running."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gspo_lightning.sandbox import Sandbox, SandboxLimits, SandboxUnavailableError, isolation_unavailable_reason
from gspo_lightning.sandbox import sandbox as sandbox_module
from gspo_lightning.sandbox.launcher import ISOLATION_FAILED

pytestmark = pytest.mark.skipif(
    isolation_unavailable_reason() is not None, reason=f"no namespaces here: {isolation_unavailable_reason()}"
)
LIMITS = SandboxLimits(wall_time_s=3.0, cpu_time_s=2, memory_mb=256)


@pytest.fixture(scope="module")
def sandbox():
    return Sandbox(LIMITS)


def run(sandbox: Sandbox, code: str, stdin: str = ""):
    return sandbox.run({"main.py": code}, "main.py", stdin=stdin)


def sandbox_processes() -> list[int]:
    """Processes still running in a sandbox working directory (deleted or not)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and "gspo-sandbox-" in os.readlink(entry / "cwd"):
                found.append(int(entry.name))
        except OSError:  # gone, or not ours to inspect
            continue
    return found


def test_a_plain_program_runs_with_stdin_and_its_output_comes_back(sandbox):
    result = run(sandbox, "import sys\nprint(sys.stdin.read().upper())\nprint('err', file=sys.stderr)", "hi")
    assert result.ok and result.isolated
    assert result.stdout == "HI\n" and result.stderr == "err\n"


def test_infinite_loop_is_killed_at_the_wall_clock_limit(sandbox):
    start = time.monotonic()
    result = run(sandbox, "while True:\n    pass")
    assert not result.ok
    # the CPU limit (2 s) or the wall limit (3 s) stops it, whichever comes first
    assert time.monotonic() - start < LIMITS.wall_time_s + 2


def test_sleeping_program_is_killed_at_the_wall_clock_limit(sandbox):
    result = run(sandbox, "import time\ntime.sleep(60)")
    assert result.timed_out and not result.ok
    assert result.wall_s < LIMITS.wall_time_s + 2


def test_fork_bomb_is_contained_and_leaves_no_process_behind(sandbox):
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    result = run(sandbox, bomb)
    assert not result.ok
    time.sleep(0.2)
    assert sandbox_processes() == []
    assert run(sandbox, "print('after')").stdout == "after\n"  # the machine still forks


def test_daemonised_child_does_not_outlive_the_run(sandbox):
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('parent done')"
    result = run(sandbox, code)
    assert result.ok
    time.sleep(0.2)
    assert sandbox_processes() == []


def test_memory_bomb_fails_inside_the_sandbox(sandbox):
    result = run(sandbox, "blocks = []\nwhile True:\n    blocks.append(bytearray(50 * 2**20))")
    assert not result.ok and "MemoryError" in result.stderr


def test_writing_outside_the_working_directory_is_refused(sandbox, tmp_path, monkeypatch):
    (tmp_path / "trainer").mkdir()
    monkeypatch.chdir(tmp_path / "trainer")
    targets = [tmp_path / "escape.txt", Path("/tmp") / f"gspo-escape-{os.getpid()}", Path.cwd() / "escape.txt"]
    code = "\n".join(
        f"try:\n    open({str(t)!r}, 'w').write('x')\nexcept OSError as e:\n    print('refused', e.errno)"
        for t in targets
    )
    code += "\nopen('inside.txt', 'w').write('ok')\nprint(open('inside.txt').read())"
    result = run(sandbox, code)
    assert result.ok and result.stdout.count("refused") == 3 and result.stdout.endswith("ok\n")
    assert not any(t.exists() for t in targets)


def test_the_working_directory_is_removed_afterwards(sandbox):
    result = run(sandbox, "import os\nos.makedirs('a/b')\nopen('a/b/f', 'w').write('x')\nos.chmod('a', 0)\nprint(os.getcwd())")
    assert result.ok
    assert not Path(result.stdout.strip()).parent.exists()


def test_the_trainers_environment_is_not_visible(sandbox, monkeypatch):
    monkeypatch.setenv("GSPO_TEST_SECRET", "s3cret")
    # A process started with the secret in its environment: /proc/<pid>/environ would show it.
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        code = (
            "import os\nprint(os.environ.get('GSPO_TEST_SECRET'))\n"
            f"for pid in ({holder.pid}, {os.getpid()}, 1):\n"
            "    try:\n        print(open(f'/proc/{pid}/environ', 'rb').read())\n"
            "    except OSError as e:\n        print('refused', e.errno)\n"
        )
        result = run(sandbox, code)
    finally:
        holder.kill()
    assert "s3cret" not in result.stdout and "s3cret" not in result.stderr
    assert result.stdout.startswith("None\n")


def test_no_socket_reaches_a_server_on_loopback(sandbox):
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    connections = []
    server.settimeout(5)

    def accept() -> None:
        try:
            connections.append(server.accept())
        except OSError:
            pass

    thread = threading.Thread(target=accept)
    thread.start()
    code = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\ns.sendall(b'leak')\nprint('sent')"
    result = run(sandbox, code)
    server.close()
    thread.join()
    assert not result.ok and "sent" not in result.stdout
    assert connections == []


def test_killing_the_parent_or_everyone_does_not_reach_the_trainer(sandbox):
    code = "import os, signal\nfor pid in (os.getppid(), 0, -1):\n    try:\n        os.kill(pid, signal.SIGKILL)\n    except OSError:\n        pass\nprint('alive')"
    run(sandbox, code)
    assert run(sandbox, "print('next')").stdout == "next\n"  # this test process is still here, and works


def test_required_isolation_fails_closed_when_unavailable(monkeypatch):
    monkeypatch.setattr(sandbox_module, "isolation_unavailable_reason", lambda: "no namespaces (simulated)")
    with pytest.raises(SandboxUnavailableError, match="isolation='required'.*best_effort"):
        Sandbox(LIMITS).run({"main.py": "print(1)"}, "main.py")
    with pytest.warns(UserWarning, match="without isolation"):
        result = Sandbox(LIMITS, isolation="best_effort").run({"main.py": "print(1)"}, "main.py")
    assert result.ok and not result.isolated


def test_launcher_runs_nothing_when_isolation_cannot_be_set_up(tmp_path):
    marker = tmp_path / "ran"
    spec = {
        "isolate": True,
        "workdir": str(tmp_path / "missing"),  # binding it fails, after the namespaces exist
        "python_prefix": sys.base_prefix,
        "argv": [sys.executable, "-c", f"open({str(marker)!r}, 'w')"],
        "env": {},
        "run_as": None,
        "limits": {},
    }
    launcher = Path(sandbox_module.__file__).with_name("launcher.py")
    completed = subprocess.run([sys.executable, "-I", "-S", str(launcher), json.dumps(spec)], capture_output=True)
    assert completed.returncode == ISOLATION_FAILED and b"isolation failed" in completed.stderr
    assert not marker.exists()


def test_runs_in_parallel_threads_do_not_interfere(sandbox):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda i: run(sandbox, f"print({i} * {i})"), range(8)))
    assert [r.stdout for r in results] == [f"{i * i}\n" for i in range(8)]


@pytest.mark.parametrize(
    "bad", [dict(wall_time_s=0), dict(memory_mb=16), dict(processes=-1), dict(cpu_time_s=True)], ids=str
)
def test_bad_limits_are_rejected(bad):
    with pytest.raises(ValueError, match="sandbox limit"):
        SandboxLimits(**bad)


def test_bad_isolation_setting_names_the_choices():
    with pytest.raises(ValueError, match=r"isolation must be one of \['required', 'best_effort', 'off'\]"):
        Sandbox(isolation="maybe")
