#!/usr/bin/env python3
"""Compiles every translation unit of a CMake build's compile_commands.json with -fsyntax-only.

make tsa uses it: clang's thread-safety analysis runs while the compiler checks a translation
unit, before any code is generated, so checking is all the analysis needs (about half the time of
an -O0 build here, and nothing to link). Each unit's diagnostics are printed; the exit status is 1
when any unit fails (the analysis' findings are errors: -Werror=thread-safety), else 0.

Usage: syntax_only.py COMPILE_COMMANDS_JSON [JOBS]
"""
import json
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor


def syntax_only(entry):
    args = entry["arguments"] if "arguments" in entry else shlex.split(entry["command"])
    out = []
    skip = False
    for arg in args:
        if skip:
            skip = False
        elif arg == "-o":
            skip = True  # and its operand: no object is written
        elif arg == "-c":
            out.append("-fsyntax-only")
        else:
            out.append(arg)
    done = subprocess.run(out, cwd=entry["directory"], capture_output=True, text=True)
    return entry["file"], done.returncode, done.stdout + done.stderr


def main():
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    with open(sys.argv[1]) as f:
        entries = json.load(f)
    jobs = int(sys.argv[2]) if len(sys.argv) == 3 else 2
    failed = 0
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for path, rc, text in pool.map(syntax_only, entries):
            if text.strip():
                print(text, end="" if text.endswith("\n") else "\n")
            if rc != 0:
                failed += 1
                print(f"syntax_only: {path} failed (exit {rc})")
    print(f"syntax_only: {len(entries) - failed} of {len(entries)} translation units checked clean")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
