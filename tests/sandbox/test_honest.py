"""Honest programs still work in the hardened sandbox, with its default limits."""

from __future__ import annotations

import pytest

from gspo_lightning.sandbox import Sandbox, SandboxLimits
from tests.sandbox.conftest import needs_isolation

pytestmark = needs_isolation


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    return Sandbox(SandboxLimits(wall_time_s=20.0))  # the default limits otherwise


def run(sandbox: Sandbox, code: str, stdin: str = ""):
    result = sandbox.run({"main.py": code}, "main.py", stdin=stdin)
    assert result.ok and result.isolated, result.stderr[-3000:]
    return result.stdout


HONEST = {
    "32 threads at once": (
        "import threading\nbarrier = threading.Barrier(33)\n"
        "threads = [threading.Thread(target=barrier.wait) for _ in range(32)]\n"
        "[t.start() for t in threads]\nbarrier.wait()\n[t.join() for t in threads]\nprint('ok')\n",
        "ok\n",
    ),
    "recursion to the default limit": (
        "import sys\ndef depth(n):\n    return 0 if n == 0 else 1 + depth(n - 1)\n"
        "print(depth(sys.getrecursionlimit() - 20))\n",
        "980\n",
    ),
    "floating point": ("import math\nprint(repr(0.1 + 0.2), math.sqrt(2), math.fsum([0.1] * 10), 1e308 * 10)\n",
                       "0.30000000000000004 1.4142135623730951 1.0 inf\n"),  # fmt: skip
    "the standard library": (
        "import bisect, collections, datetime, decimal, fractions, functools, hashlib, heapq, itertools, json, re\n"
        "import random, sqlite3, statistics, string, zlib, ssl, ctypes, uuid, zoneinfo\n"
        "print(json.dumps(collections.Counter('abca').most_common(1)), fractions.Fraction(1, 3) * 3,\n"
        "      decimal.Decimal('1.10') + decimal.Decimal('2.20'), hashlib.sha256(b'x').hexdigest()[:8],\n"
        "      sqlite3.connect(':memory:').execute('select 6 * 7').fetchone()[0], statistics.median([3, 1, 2]),\n"
        "      len(zlib.compress(b'a' * 1000)) < 100, re.sub(r'\\d', '#', 'a1b2'), heapq.nsmallest(2, [5, 1, 4]))\n",
        '[["a", 2]] 1 3.30 2d711642 42 2 True a#b# [1, 4]\n',
    ),
    "subprocesses and a process pool": (
        "import multiprocessing, subprocess, sys\ndef square(x):\n    return x * x\n"
        "if __name__ == '__main__':\n"
        "    with multiprocessing.Pool(2) as pool:\n        print(pool.map(square, range(4)))\n"
        "    child = subprocess.run([sys.executable, '-c', 'print(7)'], capture_output=True, text=True)\n"
        "    print(child.stdout.strip())\n",
        "[0, 1, 4, 9]\n7\n",
    ),
    "files in its folder and in /tmp, and exit()": (
        "import os, tempfile\nopen('out.txt', 'w').write('a' * 10**6)\n"
        "with tempfile.NamedTemporaryFile(dir='/tmp') as handle:\n    handle.write(b'b' * 10**6)\n"
        "print(os.path.getsize('out.txt'), sorted(os.listdir('.')))\nexit()\n",
        "1000000 ['main.py', 'out.txt']\n",
    ),
}


@pytest.mark.parametrize("name", sorted(HONEST))
def test_an_honest_program_works(sandbox, name):
    code, expected = HONEST[name]
    assert run(sandbox, code) == expected


def test_a_megabyte_of_stdin_is_read_whole(sandbox):
    text = "x" * 2**20 + "\n"
    assert run(sandbox, "import sys\nprint(len(sys.stdin.read()))", stdin=text) == f"{len(text)}\n"
