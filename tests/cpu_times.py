"""Each test's CPU seconds (its process's user + system time, and that of the child
processes it waited for), which hold under load where wall-clock durations do not:
`pytest -p cpu_times --cpu-times=FILE` appends a line `seconds<TAB>test id` per test to
FILE (every xdist worker to the same file); `python tests/cpu_times.py FILE` sums it by
file. docs/development.md's tables of where CI's minutes go were made with it."""

from __future__ import annotations

import collections
import resource
import sys

import pytest


def pytest_addoption(parser):
    parser.addoption("--cpu-times", metavar="FILE", help="append each test's CPU seconds to FILE")


def _cpu() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    path = item.config.getoption("cpu_times")
    start = _cpu()
    yield
    if path:
        with open(path, "a") as out:
            out.write(f"{_cpu() - start:.2f}\t{item.nodeid}\n")


def by_file(path: str) -> list[tuple[float, int, str]]:
    """(CPU seconds, tests, file) for each file in a --cpu-times FILE, largest first."""
    seconds, tests = collections.Counter(), collections.Counter()
    with open(path) as lines:
        for line in lines:
            cpu, nodeid = line.rstrip("\n").split("\t", 1)
            name = nodeid.split("::")[0]
            seconds[name] += float(cpu)
            tests[name] += 1
    return sorted(((s, tests[name], name) for name, s in seconds.items()), reverse=True)


if __name__ == "__main__":
    rows = by_file(sys.argv[1])
    total = sum(s for s, _, _ in rows)
    print(f"{total:.0f} s of CPU in {sum(n for _, n, _ in rows)} tests")
    for seconds, tests, name in rows:
        print(f"{seconds:8.1f} s {100 * seconds / total:5.1f}% {tests:4d} {name}")
