"""Compile a C++ source into a shared library with the machine's compiler, once per (source hash, command), and
cache it: the ONNX Runtime op (export/native) and the CPU prefill op (kernels/native) both build this way.

Why compile here instead of shipping binaries: the sources need only a C++ compiler (and, for the prefill op,
the headers inside the installed torch wheel), and a library built on the machine can use its vector units
(-march=native). Nothing is downloaded. The cache lives in ``$H2O_COMPILE_CACHE`` (default
``~/.cache/h2o_compile``); a library is written to a temporary name and renamed, so concurrent first uses (test
workers, serving processes) never load a half-written file.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Iterable


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


def digest(directory: Path, files: Iterable[str], command: Iterable[str]) -> str:
    """16 hex digits of the command and the named sources' bytes: a new source or flag is a new library."""
    h = hashlib.sha256(" ".join(command).encode())
    for name in files:
        h.update(name.encode() + b"\0" + (directory / name).read_bytes())
    return h.hexdigest()[:16]


def compile_cached(target: Path, command: list[str], source: Path, what: str, *, rebuild: bool = False,
                   link: Iterable[str] = ()) -> Path:
    """``target`` (built now with ``command -o target source link...`` unless it exists). NativeBuildError
    naming ``what`` and the full command when the compiler cannot run or fails."""
    if target.is_file() and not rebuild:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    full = [*command, "-o", tmp, str(source), *link]
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
