"""The sandbox runs programs contained: each limit stops its program, and the test process keeps running.

The hostile programs of the issue are in ``test_hostile.py``; this file checks the sandbox's own behaviour.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gspo_lightning.sandbox import Sandbox, SandboxLimits
from gspo_lightning.sandbox.cgroups import cgroup_unavailable_reason
from gspo_lightning.sandbox.launcher.wire import ISOLATION_FAILED
from gspo_lightning.sandbox.root_plan import base_interpreter, minimal_root_plan
from gspo_lightning.sandbox.spec import LaunchSpec, RootPlan
from tests.sandbox.conftest import needs_isolation, processes_of, run_launcher

pytestmark = needs_isolation
LIMITS = SandboxLimits(wall_time_s=3.0, cpu_time_s=2, memory_mb=256)


@pytest.fixture(scope="module")
def sandbox():
    return Sandbox(LIMITS)


def run(sandbox: Sandbox, code: str, stdin: str = ""):
    return sandbox.run({"main.py": code}, "main.py", stdin=stdin)


def leftovers(sandbox: Sandbox) -> list[int]:
    return processes_of(set(sandbox.uids_used))


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
    assert leftovers(sandbox) == []  # no waiting: the run ends once its last process is gone
    assert run(sandbox, "print('after')").stdout == "after\n"  # the machine still forks


def test_daemonised_child_does_not_outlive_the_run(sandbox):
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('parent done')"
    result = run(sandbox, code)
    assert result.ok
    assert leftovers(sandbox) == []


def test_memory_bomb_is_stopped_at_the_memory_cap(sandbox):
    result = run(sandbox, "blocks = []\nwhile True:\n    blocks.append(bytearray(50 * 2**20))")
    assert not result.ok
    if cgroup_unavailable_reason() is None:  # the run's cgroup kills it
        assert result.memory_exceeded and result.exit_code == 128 + 9
    else:  # the address-space limit refuses the allocation
        assert "MemoryError" in result.stderr


def test_writing_outside_the_working_directory_never_reaches_the_host(sandbox, tmp_path, monkeypatch):
    (tmp_path / "trainer").mkdir()
    monkeypatch.chdir(tmp_path / "trainer")
    targets = [tmp_path / "escape.txt", Path.cwd() / "escape.txt", Path("/usr/lib/gspo-escape")]
    code = "\n".join(
        f"try:\n    open({str(t)!r}, 'w').write('x')\nexcept OSError as e:\n    print('refused', e.errno)"
        for t in targets
    )
    host_tmp = Path("/tmp") / f"gspo-escape-{os.getpid()}"  # the program's /tmp is its own
    code += f"\nopen({str(host_tmp)!r}, 'w').write('x')\n"
    code += "open('inside.txt', 'w').write('ok')\nprint(open('inside.txt').read())"
    result = run(sandbox, code)
    assert result.ok and result.stdout.count("refused") == 3 and result.stdout.endswith("ok\n")
    assert not any(t.exists() for t in targets) and not host_tmp.exists()


def test_a_run_leaves_nothing_on_the_host_and_the_next_run_starts_clean(sandbox):
    before = set(Path("/tmp").iterdir())
    writer = "import os\nos.makedirs('a/b')\nopen('a/b/f', 'w').write('x')\nos.chmod('a', 0)\n"
    writer += "open('/tmp/t', 'w').write('y')"
    assert run(sandbox, writer).ok
    reader = "import os\nprint(sorted(os.listdir('.')), os.listdir('/tmp'), os.getcwd())"
    assert run(sandbox, reader).stdout == "['main.py'] [] /work\n"
    assert {path for path in set(Path("/tmp").iterdir()) - before if path.name.startswith("gspo-sandbox")} == set()


def test_a_run_is_capped_in_disk_bytes_and_files_and_its_output(sandbox):
    capped = Sandbox(SandboxLimits(wall_time_s=5.0, disk_mb=4, max_files=50, file_size_mb=2, output_bytes=1000))
    until_full = "\nexcept OSError as e:\n    print('full at', i, e.errno)"
    fill = "try:\n    for i in range(10):\n        open(f'f{i}', 'wb').write(b'x' * 2**20)" + until_full
    assert capped.run({"main.py": fill}, "main.py").stdout == "full at 4 28\n"  # ENOSPC after 4 MiB
    files = "import os\ntry:\n    for i in range(100):\n        os.mkdir(f'd{i}')" + until_full
    assert capped.run({"main.py": files}, "main.py").stdout == "full at 50 28\n"
    flood = capped.run({"main.py": "import sys\nsys.stdout.write('y' * 3 * 2**20)"}, "main.py")
    assert not flood.ok and flood.output_truncated and len(flood.stdout) == 1000  # killed at 2 MiB (SIGXFSZ)


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
    server.settimeout(1)  # the program fails at once; this only bounds the wait

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


def test_the_launcher_runs_nothing_when_the_minimal_root_cannot_be_built(tmp_path):
    marker = tmp_path / "ran"
    plan = minimal_root_plan()
    broken = RootPlan(str(tmp_path / "missing"), plan.binds, plan.symlinks, plan.masks)  # no mount point
    spec = LaunchSpec(
        isolate=True, seccomp=True, workdir="/work", files={"main.py": ""},
        argv=[base_interpreter(), "-c", f"open({str(marker)!r}, 'w')"], env={}, run_as=None, limits=LIMITS, root=broken,
    )  # fmt: skip
    completed, outcome = run_launcher(spec)
    assert completed.returncode == 0 and outcome.exit_code == ISOLATION_FAILED, completed.stderr
    assert outcome.stage == "isolation" and "sandbox isolation failed: mount" in outcome.error
    assert not marker.exists()


def test_a_killed_launcher_takes_its_whole_run_with_it(sandbox):
    """Init's parent-death signal: even if the launcher dies (not just at the wall limit), the run dies."""
    killed: list[int] = []

    def kill_the_launcher() -> None:
        time.sleep(1.0)
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and entry.name != str(os.getpid()):
                try:
                    status = (entry / "status").read_text()
                    command = (entry / "cmdline").read_bytes()
                except OSError:
                    continue
                if f"PPid:\t{os.getpid()}\n" in status and b"sandbox/launcher" in command:
                    os.kill(int(entry.name), 9)
                    killed.append(int(entry.name))

    killer = threading.Thread(target=kill_the_launcher)
    killer.start()
    result = run(sandbox, "import os, time\nos.setpgid(0, 0)\nos.fork()\ntime.sleep(30)")
    killer.join()
    assert killed and result.error is not None and "launcher failed" in result.error
    assert leftovers(sandbox) == []


def test_runs_in_parallel_threads_do_not_interfere(sandbox):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda i: run(sandbox, f"print({i} * {i})"), range(8)))
    assert [r.stdout for r in results] == [f"{i * i}\n" for i in range(8)]


@pytest.mark.parametrize(
    "bad",
    [dict(wall_time_s=0), dict(memory_mb=16), dict(processes=-1), dict(cpu_time_s=True), dict(disk_mb=1.5)],
    ids=str,
)
def test_bad_limits_are_rejected(bad):
    with pytest.raises(ValueError, match="sandbox limit"):
        SandboxLimits(**bad)


def test_bad_isolation_setting_names_the_choices():
    with pytest.raises(ValueError, match=r"isolation must be one of \['required', 'best_effort', 'off'\]"):
        Sandbox(isolation="maybe")


@pytest.mark.parametrize("name", ["../up.py", "/etc/x.py", "a//b.py", "./a.py"])
def test_a_file_name_that_leaves_the_working_directory_is_refused(sandbox, name):
    with pytest.raises(ValueError, match="leaves the working directory"):
        sandbox.run({name: "print(1)", "main.py": "print(1)"}, "main.py")


@pytest.mark.skipif(cgroup_unavailable_reason() is not None, reason=f"no per-run cgroup: {cgroup_unavailable_reason()}")
def test_the_cgroups_a_killed_trainer_left_are_removed_by_the_next_one():
    from gspo_lightning.sandbox import cgroups

    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid no process has now, as a SIGKILLed trainer's
    hierarchies, _ = cgroups.find_hierarchies()
    left = [hierarchy.parent / cgroups.cgroup_name(gone.pid, 0) for hierarchy in hierarchies]
    for folder in left:
        folder.mkdir()
    cgroups.find_hierarchies.__wrapped__()  # what a new trainer process does once
    assert not any(folder.exists() for folder in left)
