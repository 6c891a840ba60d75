"""A trainer that is an ordinary user: its programs run in a user namespace of their own and see none of its home.

The test (as root) starts a trainer process under an unused, unprivileged uid, with a home folder holding the
secrets a trainer typically has (a Hugging Face token, an ssh key). Where the base interpreter lies in a folder
others cannot enter (``/root/.pyenv`` here), the trainer gets a private mount namespace in which only that
interpreter is made reachable, as it would be for a user's own install; nothing else changes for it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.sandbox.conftest import ROOT, needs_root

TRAINER_UID = 4_200_042  # no account, outside the sandbox's own uid range

# Runs as root, then becomes the ordinary user and execs the trainer.
BOOTSTRAP = r"""
import ctypes, os, stat, sys
libc = ctypes.CDLL(None, use_errno=True)
uid, home, prefix, trainer = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
assert libc.unshare(0x00020000) == 0, "unshare(mount)"
assert libc.mount(None, b"/", None, 16384 | (1 << 18), None) == 0, "rprivate"
closed, folder = None, prefix
while folder != "/":  # the outermost folder on the way to the interpreter that others cannot enter
    if not os.stat(folder).st_mode & stat.S_IXOTH:
        closed = folder
    folder = os.path.dirname(folder)
if closed is not None:
    handle = os.open(prefix, os.O_PATH)
    assert libc.mount(b"tmpfs", closed.encode(), b"tmpfs", 0, b"mode=0755") == 0, "tmpfs over " + closed
    os.makedirs(prefix, exist_ok=True)
    assert libc.mount(f"/proc/self/fd/{handle}".encode(), prefix.encode(), None, 4096 | 16384, None) == 0, "bind"
os.setgroups([])
os.setresgid(uid, uid, uid)
os.setresuid(uid, uid, uid)
os.chdir(os.path.dirname(trainer))
env = {"HOME": home, "PATH": "/usr/bin:/bin", "TMPDIR": "/tmp"}
os.execve(sys.executable, [sys.executable, trainer], env)
"""

# The ordinary user's trainer: the sandbox package alone (no torch), one hostile program, its findings as JSON.
TRAINER = r"""
import json, os, sys, types, warnings
package = types.ModuleType("gspo_lightning")
package.__path__ = [os.path.join(ROOT, "gspo_lightning")]
sys.modules["gspo_lightning"] = package
from gspo_lightning.sandbox import Sandbox, SandboxLimits
home = os.environ["HOME"]
program = '''
import ctypes, os
found = {}
for path in HOME_FILES:
    try:
        found[path] = open(path).read()
    except OSError as error:
        found[path] = error.strerror
libc = ctypes.CDLL(None)
renamed = libc.sethostname(b"x", 1) == 0  # needs CAP_SYS_ADMIN in the namespace's own user namespace
import threading
threads = [threading.Thread(target=int) for _ in range(32)]
[t.start() for t in threads]
[t.join() for t in threads]
print(json.dumps({"uid": os.getuid(), "gid": os.getgid(), "privileged": renamed, "found": found,
                  "home_exists": os.path.exists(HOME), "root": sorted(os.listdir("/"))}))
'''
home_files = [f"{home}/.cache/huggingface/token", f"{home}/.ssh/id_rsa", os.path.join(ROOT, "README.md")]
program = "import json\n" + program.replace("HOME_FILES", repr(home_files)).replace("HOME", repr(home))
import subprocess
# More processes of the trainer's own than the program's limit: they must not count against the program's.
busy = [subprocess.Popen(["sleep", "60"]) for _ in range(80)]
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    sandbox = Sandbox(SandboxLimits(wall_time_s=10, processes=64))
    result = sandbox.run({"main.py": program}, "main.py")
for process in busy:
    process.kill()
    process.wait()
report = {"trainer_uid": os.getuid(), "ok": result.ok, "isolated": result.isolated, "stdout": result.stdout,
          "stderr": result.stderr[-2000:], "error": result.error, "warnings": [str(w.message) for w in caught]}
print(json.dumps(report))
"""


def _make_home(uid: int) -> Path:
    home = Path(tempfile.mkdtemp(prefix="gspo-trainer-home-"))
    for relative, text in ((".cache/huggingface/token", "hf_s3cret_token"), (".ssh/id_rsa", "PRIVATE KEY")):
        path = home / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        path.chmod(0o600)
        path.parent.chmod(0o700)
    for path in [home, *home.rglob("*")]:
        os.chown(path, uid, uid)
    home.chmod(0o700)
    return home


@needs_root
def test_an_ordinary_users_programs_run_unprivileged_and_cannot_read_its_home():
    home = _make_home(TRAINER_UID)
    scripts = Path(tempfile.mkdtemp(prefix="gspo-trainer-"))  # pytest's own tmp_path is closed to others
    scripts.chmod(0o755)
    trainer = scripts / "trainer.py"
    trainer.write_text(TRAINER.replace("ROOT", repr(str(ROOT))))
    command = [sys.executable, "-c", BOOTSTRAP, str(TRAINER_UID), str(home), sys.base_prefix, str(trainer)]
    try:
        completed = subprocess.run(command, capture_output=True, text=True, timeout=120)
    finally:
        shutil.rmtree(home)
        shutil.rmtree(scripts)
    assert completed.returncode == 0, completed.stderr[-3000:]
    report = json.loads(completed.stdout.strip().splitlines()[-1])
    if report["error"] and "isolation" in " ".join(report["warnings"]) + report["error"]:
        pytest.skip(f"no unprivileged user namespaces here: {report['error']}")
    assert report["trainer_uid"] == TRAINER_UID
    assert report["ok"] and report["isolated"], report
    seen = json.loads(report["stdout"])
    # The program keeps the trainer's uid (mapped to itself in its user namespace): not root there, no
    # capability, and nothing of the home, the project or the host is in its view. Its 32 threads ran although
    # the trainer had 80 processes of its own: the process limit counts in the run's user namespace.
    assert seen["uid"] == seen["gid"] == TRAINER_UID and not seen["privileged"]
    assert not seen["home_exists"]
    assert all(value == "No such file or directory" for value in seen["found"].values()), seen["found"]
    assert "home" not in seen["root"] and "proc" not in seen["root"]
    # An ordinary user may not make cgroups here: the only warning names that, and the bound instead.
    assert len(report["warnings"]) == 1 and "memory_mb x processes" in report["warnings"][0], report["warnings"]
