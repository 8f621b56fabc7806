"""Builds the kvferry wheel: the Python package from python/, and the native parts through CMake.

Metadata, contents and entry points are in setup.cfg. The native parts are the pybind11 module
``kvferry._kvferry`` and the ``kvferry`` CLI binary, which the wheel ships as
``kvferry/_bin/kvferry`` behind the ``kvferry`` console command (kvferry/_cli.py). Everything the
build needs is a Debian package that ``make deps`` installs (setuptools, wheel, cmake, g++,
pybind11-dev, python3-dev and the C++ libraries), so it works offline and without build isolation:

    pip install .                                   # in a venv made with --system-site-packages
    python3 -m build --wheel --no-isolation         # dist/kvferry-<version>-cp311-...whl

(With a pip newer than Debian 12's 23.0, add --no-build-isolation to pip install.)

By default CMake configures an optimised build (-O2, no debug information) of only what the
wheel needs (no tests) outside the source tree (``KVFERRY_WHEEL_BUILD_DIR``, else
``~/.cache/kvferry/wheel-build-<tag of this tree>``: its ``cmake/``, with setuptools' own build
directory and the egg-info beside it; kept, so a second build is incremental) and builds the two
targets; the source tree is left as it was.
``KVFERRY_CMAKE_BUILD_DIR=<dir>`` reuses an existing CMake build directory of this source tree
instead (absolute, or relative to this directory; for example ``build`` after ``make build``):
only the two targets are brought up to date there, nothing else is rebuilt. Debug information is
stripped from the copies that go into the wheel (``KVFERRY_WHEEL_STRIP=0`` keeps it); the build
directory is left as it was.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path


def _require_debian_python() -> None:
    """The build runs in the interpreter that runs this file: it needs setuptools and wheel,
    which Debian's python3 has from `make deps`; another interpreter first on PATH (pyenv, a
    venv without --system-site-packages) may lack them and failed with pip's bare "invalid
    command 'bdist_wheel'"."""
    import importlib.util

    missing = [m for m in ("setuptools", "wheel") if importlib.util.find_spec(m) is None]
    if missing:
        raise SystemExit(
            f"setup.py: this Python ({sys.executable}) has no {' and no '.join(missing)} "
            "package; kvferry's wheel builds with Debian's /usr/bin/python3, whose packages "
            "`make deps` installs (python3-setuptools, python3-wheel): run "
            "`/usr/bin/python3 -m venv --system-site-packages ~/kvferry-venv` and "
            "`~/kvferry-venv/bin/pip install .` (README, Install with pip)")


_require_debian_python()

from setuptools import Extension, setup  # noqa: E402
from setuptools.command.build_ext import build_ext  # noqa: E402

ROOT = Path(__file__).resolve().parent
BUILD_DIR_ENV = "KVFERRY_CMAKE_BUILD_DIR"
WORK_DIR_ENV = "KVFERRY_WHEEL_BUILD_DIR"


def work_dir() -> Path:
    """Where the wheel's build output goes, outside the source tree so that `pip install .` leaves
    it as it was: KVFERRY_WHEEL_BUILD_DIR, else a directory of this source tree under the user's
    cache ($XDG_CACHE_HOME, else ~/.cache), kept between builds so that the next one is
    incremental. It holds the CMake build (cmake/), setuptools' build directory (setuptools/) and
    the egg-info."""
    given = os.environ.get(WORK_DIR_ENV, "")
    if given:
        return Path(given).resolve()
    import hashlib

    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    tag = hashlib.sha256(str(ROOT).encode()).hexdigest()[:12]
    return cache / "kvferry" / f"wheel-build-{tag}"
TARGETS = ("_kvferry", "kvferry_cli")


def project_version() -> str:
    """The version of the CMake project (one home for it: CMakeLists.txt)."""
    text = (ROOT / "CMakeLists.txt").read_text()
    found = re.search(r"project\(kvferry\s+VERSION\s+([0-9][0-9.]*)", text)
    if found is None:
        raise SystemExit("setup.py: expected 'project(kvferry VERSION x.y.z ...)' in "
                         f"{ROOT / 'CMakeLists.txt'}, found none")
    return found.group(1)


def cache_value(cache: Path, key: str) -> str:
    for line in cache.read_text(errors="replace").splitlines():
        if line.startswith(key + ":"):
            return line.split("=", 1)[1]
    return ""


class CMakeBuild(build_ext):
    """build_ext for the one native extension: CMake builds it and the CLI binary."""

    def run(self) -> None:
        if shutil.which("cmake") is None:
            raise SystemExit("setup.py: expected cmake on PATH, found none; run `make deps` "
                             "(Debian packages for the whole build) and try again")
        super().run()

    def build_extension(self, ext: Extension) -> None:
        build_dir = self._build_dir()
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL") or str(self.parallel or os.cpu_count()
                                                                   or 1)
        command = ["cmake", "--build", str(build_dir), "-j", jobs, "--target", *TARGETS]
        print("setup.py: " + " ".join(command), flush=True)
        if subprocess.run(command, check=False).returncode != 0:
            raise SystemExit(f"setup.py: building {', '.join(TARGETS)} in {build_dir} failed (the "
                             "compiler's messages are above); a sanitizer or fuzz build has no "
                             "Python module: point " + BUILD_DIR_ENV + " at a plain build")
        module_name = Path(self.get_ext_filename(ext.name)).name
        module = build_dir / "python" / "kvferry" / module_name
        if not module.is_file():
            found = sorted(p.name for p in (build_dir / "python" / "kvferry").glob("_kvferry*"))
            raise SystemExit(
                f"setup.py: expected the module {module}, built for this Python "
                f"({sys.executable}), found {found or 'nothing'}; that build is for another "
                f"Python: unset {BUILD_DIR_ENV}, or configure it with "
                f"-DPython3_EXECUTABLE={sys.executable}")
        destination = Path(self.get_ext_fullpath(ext.name))
        self._copy(module, destination)
        self._copy(build_dir / "kvferry", self._cli_destination(ext))

    def _cli_destination(self, ext: Extension) -> Path:
        return Path(self.get_ext_fullpath(ext.name)).parent / "_bin" / "kvferry"

    def get_outputs(self) -> list[str]:
        return super().get_outputs() + [str(self._cli_destination(e)) for e in self.extensions]

    def _build_dir(self) -> Path:
        """The CMake build directory: the one KVFERRY_CMAKE_BUILD_DIR names (checked to belong to
        this source tree), or work_dir()/cmake configured here for the wheel."""
        given = os.environ.get(BUILD_DIR_ENV, "")
        if given:
            build_dir = (ROOT / given).resolve()
            cache = build_dir / "CMakeCache.txt"
            if not cache.is_file():
                raise SystemExit(f"setup.py: {BUILD_DIR_ENV}={given}: expected a configured CMake "
                                 f"build directory, found no {cache}; run `make build` first, or "
                                 f"unset {BUILD_DIR_ENV}")
            source = cache_value(cache, "CMAKE_HOME_DIRECTORY")
            if Path(source).resolve() != ROOT:
                raise SystemExit(f"setup.py: {BUILD_DIR_ENV}={given} is a build of {source}, not "
                                 f"of {ROOT}; its binaries would not be this tree's")
            return build_dir
        build_dir = work_dir() / "cmake"
        # The optimisation the project builds and tests with (RelWithDebInfo's -O2; GCC 12's -O3
        # warns falsely under -Werror), without its debug information.
        command = ["cmake", "-S", str(ROOT), "-B", str(build_dir),
                   "-DCMAKE_BUILD_TYPE=RelWithDebInfo",
                   "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O2 -DNDEBUG", "-DKVFERRY_BUILD_TESTS=OFF",
                   f"-DPython3_EXECUTABLE={sys.executable}"]
        print("setup.py: " + " ".join(command), flush=True)
        if subprocess.run(command, check=False).returncode != 0:
            raise SystemExit("setup.py: configuring the CMake build failed (its messages are "
                             "above); `make deps` installs what it needs")
        return build_dir

    @staticmethod
    def _copy(source: Path, destination: Path) -> None:
        """Copies a built binary into the wheel's tree, executable, without its debug
        information unless KVFERRY_WHEEL_STRIP=0."""
        if not source.is_file():
            raise SystemExit(f"setup.py: expected the built file {source}, found none")
        destination.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, destination)
        os.chmod(destination, 0o755)
        strip = shutil.which("strip")
        if os.environ.get("KVFERRY_WHEEL_STRIP", "1") != "0" and strip is not None:
            subprocess.run([strip, "--strip-debug", str(destination)], check=True)


_WORK = work_dir()
(_WORK / "egg-info").mkdir(parents=True, exist_ok=True)
setup(
    version=project_version(),
    ext_modules=[Extension("kvferry._kvferry", sources=[])],
    cmdclass={"build_ext": CMakeBuild},
    # Defaults a config file (DIST_EXTRA_CONFIG, setup.cfg) may override.
    options={"build": {"build_base": str(_WORK / "setuptools")},
             "egg_info": {"egg_base": str(_WORK / "egg-info")}},
)
