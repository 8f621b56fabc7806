"""The ``kvferry`` console command of an installed wheel: runs the CLI binary shipped inside the
package (``kvferry/_bin/kvferry``), replacing this process, so the command line, exit status,
signals and process id are the binary's own."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def binary_path() -> Path:
    """Where the wheel put the kvferry CLI binary."""
    return Path(__file__).resolve().parent / "_bin" / "kvferry"


def main() -> None:
    binary = binary_path()
    if not os.access(binary, os.X_OK):
        sys.exit(f"kvferry: expected the CLI binary at {binary}, found "
                 f"{'a file that is not executable' if binary.exists() else 'nothing'}; this "
                 "install is incomplete: reinstall kvferry (pip install --force-reinstall), or "
                 "use the binary of a CMake build (build/kvferry)")
    # argv[0] as the user typed it; the binary finds itself through /proc/self/exe.
    os.execv(binary, ["kvferry", *sys.argv[1:]])


if __name__ == "__main__":
    main()
