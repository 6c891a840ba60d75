"""Runs inside the sandbox: defines the solution, calls its entry point on each test input, reports results.

Standard library only; it is copied into the sandbox's working directory next to ``solution.py`` and
``inputs.json``. Only the inputs enter the sandbox: the expected outputs stay with the trainer, which compares
them with what this harness reports, so a program cannot pass a test it does not solve by printing claims.
Each result is one line ``{"test": i, "result": ...}`` (or ``"error"``) on file descriptor 1; the solution's own
prints go to /dev/null.
"""

import json
import os
import sys


def _report(line: dict) -> None:
    os.write(1, (json.dumps(line) + "\n").encode())


def main() -> None:
    with open("inputs.json") as handle:
        spec = json.load(handle)
    sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - the solution's prints are not results
    namespace = {"__name__": "solution"}
    with open("solution.py") as handle:
        source = handle.read()
    exec(compile(source, "solution.py", "exec"), namespace)  # noqa: S102 - this is the sandbox
    function = namespace[spec["entry_point"]]
    for index, arguments in enumerate(spec["inputs"]):
        try:
            result = function(*arguments)
            line = {"test": index, "result": json.loads(json.dumps(result))}
        except Exception as error:  # a failing call fails its test only
            line = {"test": index, "error": type(error).__name__}
        _report(line)


if __name__ == "__main__":
    main()
