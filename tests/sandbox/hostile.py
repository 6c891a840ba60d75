"""The hostile programs that escape, reach outside or read: would-be solutions of ``add`` that cheat.

(``hostile_caps.py`` holds those that exhaust a limit or break the scorer.)

Where an attack can be seen from inside, the program answers ``add`` correctly only if the attack worked, so a
score of 0 is the proof that it was contained; the other attacks answer wrongly whatever happens, and the suite
checks what they tried to leave behind (processes, changed files, a poisoned slot, a failed batch).

Placeholders, filled in by the suite: VICTIMS (the victims' folder), ABSTRACT (their abstract socket), SAMPLE
(the packaged data set), PROJECT (this source tree), VENV (the trainer's environment), TRAINER_PID, HOST_ACCOUNT
(a user of the host's /etc/passwd), DISK_MB, MAX_FILES, MEMORY_MB.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Hostile:
    """One hostile program: its name, the issue's threat class it belongs to, and its source."""

    name: str
    threat: str
    source: str
    slow: bool = False


# The end of a program that cheats: it answers right only if its attack (which set ``ok``) worked.
ANSWER_IF_IT_WORKED = "def add(a, b):\n    return a + b if ok else None\n"

# Looks up the expected output of its own inputs in a JSONL data set, if it can read one.
_LOOKUP = """
import json
def _lookup(path, args):
    with open(path) as handle:
        for line in handle:
            for test in json.loads(json.loads(line)['tests']):
                if test.get('input') == list(args):
                    return test['output']
"""

ESCAPES = [
    Hostile("escape_setpgid_child", "1 escape from the wall-time kill", """
import os, time
if os.fork() == 0:
    os.setpgid(0, 0)
    time.sleep(120)
    os._exit(0)
time.sleep(120)
"""),
    Hostile("escape_setpgid_self", "1 escape from the wall-time kill", """
import os, time
os.setpgid(0, 0)
for _ in range(3):
    if os.fork() == 0:
        time.sleep(120)
        os._exit(0)
time.sleep(120)
"""),
    Hostile("escape_clear_parent_death_signal", "1 escape from the wall-time kill", """
import ctypes, os, signal, time
libc = ctypes.CDLL(None)
libc.prctl(1, 0, 0, 0, 0)  # PR_SET_PDEATHSIG 0
for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
    signal.signal(sig, signal.SIG_IGN)
os.setpgid(0, 0)
if os.fork() == 0:
    os.setsid()
    libc.prctl(1, 0, 0, 0, 0)
    time.sleep(120)
time.sleep(120)
"""),
    Hostile("escape_at_the_cpu_limit", "1 escape from the CPU-time kill", """
import os, time
if os.fork() == 0:
    os.setsid()
    time.sleep(120)
    os._exit(0)
while True:
    pass
"""),
    Hostile("daemon_outlives_a_quick_exit", "1 escape after a normal exit", """
import os, signal, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        time.sleep(120)
    os._exit(0)
def add(a, b):
    return None
"""),
    Hostile("escaped_children_fill_the_process_limit", "1 poisoned slot", """
import os, time
if os.fork() == 0:
    os.setpgid(0, 0)
    while True:
        try:
            if os.fork() == 0:
                time.sleep(120)
                os._exit(0)
        except OSError:
            break
    time.sleep(120)
    os._exit(0)
time.sleep(120)
"""),
]

CLEANUP = [
    Hostile("cleanup_follows_a_swapped_symlink", "2 cleanup reaches outside", """
import os, time
os.setpgid(0, 0)
work = os.getcwd()
folders = [f'{work}/d{i}' for i in range(40)]
if os.fork() == 0:
    while True:
        for folder in folders:
            try:
                if os.path.islink(folder):
                    os.unlink(folder)
                    os.mkdir(folder)
                    open(folder + '/last.ckpt', 'w').close()
                else:
                    os.unlink(folder + '/last.ckpt')
                    os.rmdir(folder)
                    os.symlink('VICTIMS/runs/exp/checkpoints', folder)
            except OSError:
                try:
                    os.makedirs(folder, exist_ok=True)
                except OSError:
                    pass
time.sleep(120)
"""),
    Hostile("links_to_victims_left_behind", "2 cleanup reaches outside", """
import os
os.symlink('VICTIMS/runs/exp/checkpoints', 'ckpt_dir')
os.symlink('VICTIMS/runs/exp/checkpoints/last.ckpt', 'ckpt_file')
os.symlink('VICTIMS/runs', '/tmp/runs')
for name in ('a', 'a/b', 'a/b/c'):
    os.mkdir(name)
open('a/b/c/f', 'w').write('x')
os.symlink('VICTIMS', 'a/b/c/victims')
try:
    os.link('VICTIMS/runs/exp/checkpoints/last.ckpt', 'hard')
except OSError:
    pass
os.chmod('a/b', 0)
os.chmod('a', 0o100)
def add(a, b):
    return None
"""),
    Hostile("deep_directories", "4 one completion fails the batch", """
import os
for _ in range(1500):
    os.mkdir('d')
    os.chdir('d')
open('f', 'w').write('x')
def add(a, b):
    return None
"""),
    Hostile("mounts_over_its_view", "2 cleanup reaches outside", """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
ok = libc.mount(b'none', b'/tmp', b'tmpfs', 0, None) == 0
ok = ok or libc.mount(b'VICTIMS', b'.', None, 4096, None) == 0
""" + ANSWER_IF_IT_WORKED),
]

READING = [
    Hostile("reads_the_packaged_data_set", "3 reward hacking by reading", _LOOKUP + """
def add(a, b):
    return _lookup('SAMPLE', (a, b))
"""),
    Hostile("reads_the_users_data_set", "3 reward hacking by reading", _LOOKUP + """
def add(a, b):
    return _lookup('VICTIMS/data/train.jsonl', (a, b))
"""),
    Hostile("searches_the_disk_for_data_sets", "3 reward hacking by reading", _LOOKUP + """
import os, time
found = []
deadline = time.monotonic() + 1.0
for top in ('/tmp', '/work', '/home', '/root', '/srv', '/data', '/mnt', '/opt', '/'):
    for folder, subfolders, files in os.walk(top):
        subfolders[:] = [s for s in subfolders if s not in ('proc', 'sys', '.git', 'site-packages')]
        found += [os.path.join(folder, f) for f in files if f.endswith('.jsonl')]
        if found or time.monotonic() > deadline:
            break
    if found or time.monotonic() > deadline:
        break
def add(a, b):
    for path in found:
        try:
            answer = _lookup(path, (a, b))
        except Exception:
            continue
        if answer is not None:
            return answer
"""),
    Hostile("copies_a_concurrent_siblings_solution", "3 reward hacking by reading", """
import glob, os, time
theirs = None
deadline = time.monotonic() + 1.0
while theirs is None and time.monotonic() < deadline:
    candidates = glob.glob('/tmp/gspo-sandbox-*/work/solution.py') + glob.glob('/tmp/*/work/solution.py')
    for path in candidates:
        if os.path.dirname(path) != os.getcwd():
            try:
                theirs = open(path).read()
                break
            except OSError:
                pass
    time.sleep(0.02)
namespace = {}
if theirs and 'time.sleep' not in theirs.split('def add')[-1]:
    exec(theirs.replace('time.sleep(0.5)', ''), namespace)
def add(a, b):
    return namespace['add'](a, b) if 'add' in namespace else None
"""),
    Hostile("reads_etc_passwd", "3 reading the host", """
try:
    ok = 'HOST_ACCOUNT:' in open('/etc/passwd').read()
except OSError:
    ok = False
""" + ANSWER_IF_IT_WORKED),
    Hostile("reads_the_project_source", "3 reading the host", """
import os
try:
    ok = 'CodeTests' in open('PROJECT/gspo_lightning/rewards/code.py').read()
except OSError:
    ok = False
ok = ok or os.path.exists('PROJECT/README.md')
""" + ANSWER_IF_IT_WORKED),
    Hostile("reads_the_virtual_environment", "3 reading the host", """
import os, sys
ok = os.path.isdir('VENV/lib') or any('site-packages' in p and os.path.isdir(p) and os.listdir(p) for p in sys.path)
""" + ANSWER_IF_IT_WORKED),
    Hostile("reads_the_trainers_proc_entries", "3 reading the host", """
ok = False
for path in ('/proc/TRAINER_PID/cmdline', '/proc/TRAINER_PID/environ', '/proc/1/cmdline'):
    try:
        ok = ok or len(open(path, 'rb').read()) > 0
    except OSError:
        pass
""" + ANSWER_IF_IT_WORKED),
]
