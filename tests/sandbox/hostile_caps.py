"""The hostile programs that exhaust a limit, talk to the host, or break the scorer (see ``hostile.py``)."""

from __future__ import annotations

from tests.sandbox.hostile import ANSWER_IF_IT_WORKED, Hostile

OUTPUTS = [
    Hostile("reports_a_5000_digit_integer", "4 hostile output", """
import os
os.write(1, ('{"test": 0, "result": ' + '9' * 5000 + '}\\n').encode())
os._exit(0)
"""),
    Hostile("reports_100k_nested_brackets", "4 hostile output", """
import os
os.write(1, b'{"test": 0, "result": ' + b'[' * 100000 + b'}\\n')
os._exit(0)
"""),
    Hostile("reports_invalid_utf8", "4 hostile output", """
import os
os.write(1, b'\\xff\\xfe{"test": 0, "result": "\\xc3\\x28"}\\n\\x80\\x80\\n')
os._exit(0)
"""),
    Hostile("writes_binary_garbage", "4 hostile output", """
import os, random
random.seed(0)
os.write(1, bytes(random.getrandbits(8) for _ in range(300000)))
os._exit(0)
"""),
    Hostile("writes_megabytes", "4 hostile output", """
import os
line = b'{"test": 0, "result": ' + b'1' * 1000 + b'}\\n'
for _ in range(40000):
    os.write(1, line)
"""),
    Hostile("reports_nan_and_infinity", "4 hostile output", """
import os
os.write(1, b'{"test": 0, "result": NaN}\\n{"test": 1, "result": Infinity}\\n{"test": 2, "result": 1e999}\\n')
os._exit(0)
"""),
    Hostile("returns_a_deeply_nested_value", "4 hostile output", """
def add(a, b):
    value = []
    for _ in range(100000):
        value = [value]
    return value
"""),
]

MEMORY = [
    Hostile("children_each_below_the_memory_limit", "5 memory per run", """
import os, time
children, pipes = [], []
for _ in range(6):
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        block = bytearray(200 * 2**20)
        for i in range(0, len(block), 4096):
            block[i] = 1
        os.write(write, b'1')
        time.sleep(30)
        os._exit(0)
    children.append(pid)
    pipes.append(read)
held = sum(len(os.read(fd, 1)) for fd in pipes)
ok = held * 200 > MEMORY_MB
def add(a, b):
    return a + b if ok else None
""", slow=True),
    Hostile("memfds_hoard_memory_outside_the_address_space", "5 memory per run", """
import os
chunk = b'x' * 2**20
held = []
try:
    for i in range(30):
        fd = os.memfd_create(f'hoard{i}', 0)
        for _ in range(15):
            os.write(fd, chunk)
        held.append(fd)
except OSError:
    pass
ok = len(held) * 15 > MEMORY_MB
def add(a, b):
    return a + b if ok else None
""", slow=True),
    Hostile("nested_user_namespace", "5 nested user namespaces", """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
ok = libc.unshare(0x10000000) == 0  # CLONE_NEWUSER
""" + ANSWER_IF_IT_WORKED),
    Hostile("tmpfs_in_a_nested_user_namespace", "5 memory per run", """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
written = 0
uid, gid = os.getuid(), os.getgid()
if libc.unshare(0x10000000 | 0x00020000) == 0:  # CLONE_NEWUSER | CLONE_NEWNS
    for name, text in (('setgroups', 'deny'), ('uid_map', f'0 {uid} 1'), ('gid_map', f'0 {gid} 1')):
        try:
            with open(f'/proc/self/{name}', 'w') as handle:
                handle.write(text)
        except OSError:
            pass
    os.makedirs('m', exist_ok=True)
    if libc.mount(b'none', b'm', b'tmpfs', 0, b'size=2g') == 0:
        chunk = b'x' * 2**20
        for i in range(MEMORY_MB // 8 + 8):
            with open(f'm/f{i}', 'wb') as handle:
                for _ in range(8):
                    handle.write(chunk)
                    written += 1
ok = written > MEMORY_MB
""" + ANSWER_IF_IT_WORKED),
]


def _unix_client(address: str) -> str:
    """Connects to a unix socket the test serves (it answers ``pong``)."""
    return f"""
import socket
try:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(1)
    s.connect('{address}')
    ok = s.recv(4) == b'pong'
except OSError:
    ok = False
""" + ANSWER_IF_IT_WORKED


def _filler(folder: str) -> str:
    """Writes 8 MiB files (each under the file-size limit) into ``folder`` until 3 x DISK_MB or an error."""
    return f"""
chunk = b'x' * 2**20
written = 0
try:
    for i in range(3 * DISK_MB // 8 + 1):
        with open(f'{folder}f{{i}}', 'wb') as handle:
            for _ in range(8):
                handle.write(chunk)
                written += 1
except OSError:
    pass
ok = written > DISK_MB
""" + ANSWER_IF_IT_WORKED


NETWORK = [
    Hostile("talks_to_a_host_unix_socket", "6 host sockets", _unix_client("VICTIMS/victim.sock")),
    Hostile("talks_to_an_abstract_unix_socket", "6 host sockets", _unix_client("\\0ABSTRACT")),
    Hostile("talks_to_loopback_tcp", "6 network", """
import socket
try:
    socket.create_connection(('127.0.0.1', 22), timeout=1)
    ok = True
except OSError:
    ok = False
""" + ANSWER_IF_IT_WORKED),
]

DISK = [
    Hostile("fills_the_disk_below_the_file_size_limit", "7 disk bytes", _filler("")),
    Hostile("fills_tmp", "7 disk bytes", _filler("/tmp/")),
    Hostile("creates_too_many_files", "7 file count", """
import os
made = 0
try:
    for i in range(MAX_FILES + 500):
        open(f'f{i}', 'w').close()
        made += 1
except OSError:
    pass
ok = made > MAX_FILES
""" + ANSWER_IF_IT_WORKED),
]

MORE = [
    Hostile("inherited_descriptors", "more: leaks into the program", """
import os, sys
ok = False
own = os.fstat(sys.stdout.fileno())  # the harness's /dev/null for the solution's prints
for fd in range(3, 256):
    try:
        found = os.fstat(fd)
    except OSError:
        continue
    ok = ok or (found.st_dev, found.st_ino) != (own.st_dev, own.st_ino)
""" + ANSWER_IF_IT_WORKED),
    Hostile("keyring_outlives_the_run", "more: state shared between runs", """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
KEY_SPEC_USER_KEYRING = -4
ok = libc.syscall(248, b'user', b'gspo-note', b'x', 1, KEY_SPEC_USER_KEYRING) > 0  # add_key
""" + ANSWER_IF_IT_WORKED),
    Hostile("ptraces_its_init", "more: privilege", """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
ok = libc.ptrace(16, os.getppid(), None, None) == 0 or libc.ptrace(16, 1, None, None) == 0  # PTRACE_ATTACH
""" + ANSWER_IF_IT_WORKED),
    Hostile("becomes_root", "more: privilege", """
import os
try:
    os.setuid(0)
    ok = True
except OSError:
    ok = False
""" + ANSWER_IF_IT_WORKED),
    Hostile("raises_its_limits", "more: privilege", """
import resource
ok = False
for limit in (resource.RLIMIT_NPROC, resource.RLIMIT_AS, resource.RLIMIT_CPU, resource.RLIMIT_FSIZE):
    soft, hard = resource.getrlimit(limit)
    try:
        resource.setrlimit(limit, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        ok = ok or hard != resource.RLIM_INFINITY
    except (ValueError, OSError):
        pass
""" + ANSWER_IF_IT_WORKED),
    Hostile("signals_everyone", "more: the trainer", """
import os, signal
for pid in (os.getppid(), 1, 0, -1, TRAINER_PID):
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
def add(a, b):
    return None
"""),
    Hostile("writes_outside_its_folder", "more: files", """
ok = False
for path in ('VICTIMS/drop/escaped', 'PROJECT/escaped', 'VICTIMS/runs/exp/checkpoints/last.ckpt', '/etc/passwd-'):
    try:
        open(path, 'a').write('x')
        ok = True
    except OSError:
        pass
""" + ANSWER_IF_IT_WORKED),
    Hostile("joins_another_cgroup", "more: caps", """
import glob, os
ok = False
for path in glob.glob('/sys/fs/cgroup/**/cgroup.procs', recursive=True)[:50]:
    try:
        open(path, 'w').write(str(os.getpid()))
        ok = True
    except OSError:
        pass
""" + ANSWER_IF_IT_WORKED),
    Hostile("fork_bomb", "more: processes", """
import os
while True:
    try:
        os.fork()
    except OSError:
        pass
"""),
    Hostile("memory_bomb", "more: memory", """
blocks = []
while True:
    blocks.append(bytearray(50 * 2**20))
"""),
]
