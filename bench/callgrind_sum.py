#!/usr/bin/env python3
"""Sums the instructions of callgrind profiles (bench/callgrind.sh).

Adds every function's own cost (a cost line not following `calls=`; those carry the callee's
inclusive cost) over every profile named, and prints `<profiles> <instructions>`. The files'
`summary:` lines are not used: in a process forked under callgrind it can still hold cost counted
before the fork, after callgrind zeroed the process.
"""
import sys


def own_cost(path):
    total = 0
    after_calls = False
    with open(path, errors="replace") as profile:
        for line in profile:
            if line.startswith("calls="):
                after_calls = True
                continue
            if line[:1].isdigit() or line[:1] in "+-*":
                if after_calls:
                    after_calls = False
                    continue
                fields = line.split()
                if len(fields) >= 2:
                    total += int(fields[-1])
    return total


def main(paths):
    if not paths:
        sys.exit("callgrind_sum.py: no profile given")
    print(len(paths), sum(own_cost(path) for path in paths))


if __name__ == "__main__":
    main(sys.argv[1:])
