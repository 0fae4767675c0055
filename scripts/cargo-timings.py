#!/usr/bin/env python3
"""Where CI's compile time goes: the slowest units of each cargo `--timings` report.

CI sets GLANCE_CARGO_TIMINGS=1, so every cargo build and test of setup.sh, test.sh and
build-device.sh writes an HTML report under target/cargo-timings; this prints, per report, its
wall time, the summed unit time and its slowest units (the report's own UNIT_DATA table).

    scripts/cargo-timings.py [--top N] REPORT.html...
"""
import argparse
import json
import re
import sys


def units_of(path):
    text = open(path, encoding="utf-8").read()
    match = re.search(r"const UNIT_DATA = (\[.*?\]);\n", text, re.S)
    if match is None:
        # A summary must not fail CI: a cargo whose report reads otherwise is only reported.
        print(f"cargo-timings: no UNIT_DATA in {path} (a cargo version with another format?)")
        return None
    return json.loads(match.group(1))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("reports", nargs="+")
    args = parser.parse_args()
    for path in args.reports:
        units = units_of(path)
        if units is None:
            continue
        # The report lists fresh units too, at zero seconds.
        units = [u for u in units if u["duration"] > 0]
        if not units:
            print(f"{path}: nothing compiled")
            continue
        wall = max(u["start"] + u["duration"] for u in units)
        summed = sum(u["duration"] for u in units)
        print(f"{path}: {len(units)} units, {wall:.0f} s wall, {summed:.0f} s summed; slowest:")
        for unit in sorted(units, key=lambda u: -u["duration"])[: args.top]:
            target = unit["target"].strip() or "lib"
            print(f"  {unit['duration']:6.1f} s  {unit['name']} {unit['version']} {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
