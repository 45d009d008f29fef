"""Compile a C++ source into a shared library with the machine's compiler, once per (source hash, command), and
cache it: the ONNX Runtime op (export/native) and the CPU prefill and decode ops (kernels/native) build this way.

Why compile here instead of shipping binaries: the sources need only a C++ compiler (and, for the prefill op,
the headers inside the installed torch wheel), and a library built on the machine can use its vector units
(-march=native). Nothing is downloaded. The cache lives in ``$H2O_COMPILE_CACHE`` (default
``~/.cache/h2o_compile``); a library is written to a temporary name and renamed, so concurrent first uses (test
workers, serving processes) never load a half-written file.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Iterable

try:
    import fcntl
except ImportError:  # not POSIX: concurrent first builds then each compile (the rename still keeps them safe)
    fcntl = None


class NativeBuildError(RuntimeError):
    """The compiler is missing or failed; the message names the command that was run."""


def cache_root() -> Path:
    return Path(os.environ.get("H2O_COMPILE_CACHE") or Path.home() / ".cache" / "h2o_compile")


def compiler(purpose: str) -> str:
    """The C++ compiler ($CXX, else g++ / c++ / clang++); NativeBuildError naming ``purpose`` when none."""
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if not cxx:
        raise NativeBuildError(f"no C++ compiler found (set CXX, or install g++): {purpose}")
    return cxx


def _machine() -> str:
    """The architecture and, on Linux, the CPU's feature flags: a library built with -march=native for one CPU
    must not be loaded on another that shares the cache (a network home, a baked image) and lacks some."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as info:
            flags = next((line for line in info if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return platform.machine() + "\0" + flags


def digest(directory: Path, files: Iterable[str], command: Iterable[str]) -> str:
    """16 hex digits of the command, the machine and the named sources' bytes: a new source, flag or CPU is a
    new library."""
    h = hashlib.sha256(" ".join(command).encode() + b"\0" + _machine().encode())
    for name in files:
        h.update(name.encode() + b"\0" + (directory / name).read_bytes())
    return h.hexdigest()[:16]


def compile_cached(target: Path, command: list[str], source: Path | list[Path], what: str, *, rebuild: bool = False,
                   link: Iterable[str] = ()) -> Path:
    """``target`` (built now with ``command -o target sources... link...`` unless it exists). NativeBuildError
    naming ``what`` and the full command when the compiler cannot run or fails."""
    if target.is_file() and not rebuild:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # One build at a time per library (test workers, serving processes starting together): the others wait
    # for it and then find the library built.
    with open(target.parent / ".lock", "w") as lock:
        if fcntl is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_file() and not rebuild:
            return target
        return _compile(target, command, source, what, link)


def _compile(target: Path, command: list[str], source: Path | list[Path], what: str, link: Iterable[str]) -> Path:
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    sources = [source] if isinstance(source, Path) else source
    full = [*command, "-o", tmp, *map(str, sources), *link]
    try:
        result = subprocess.run(full, capture_output=True, text=True)
    except OSError as exc:
        os.unlink(tmp)
        raise NativeBuildError(f"could not run the C++ compiler: {shlex.join(full)}\n{exc}") from exc
    if result.returncode != 0:
        os.unlink(tmp)
        raise NativeBuildError(f"compiling {what} failed (exit {result.returncode}):\n"
                               f"  {shlex.join(full)}\n{result.stderr.strip()}")
    os.replace(tmp, target)
    return target
