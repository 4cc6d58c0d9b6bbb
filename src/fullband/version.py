"""The package version, and the versions of the runtimes fullband reaches into that it is tested with (a module of
its own, so any module can read them without importing the package root)."""

from __future__ import annotations

import os
import re

__version__ = "0.1.0"

# Each integration's tested range, [low, high): what pyproject.toml's extras pin. fullband overrides or extends
# internals of these (vLLM's model runner and scheduler, a TRL trainer's hook, llama.cpp's C API), which change
# between their minor releases: another version is refused where fullband starts using it, unless
# FULLBAND_ALLOW_UNTESTED=1.
TESTED = {"vllm": ("0.32", "0.33"), "trl": ("1.16", "1.17"), "llama-cpp-python": ("0.3.36", "0.4")}
ALLOW_UNTESTED = "FULLBAND_ALLOW_UNTESTED"


def release(version: str) -> tuple[int, ...]:
    """'0.32.1.dev3+cpu' -> (0, 32, 1): the release numbers a range compares."""
    found = re.match(r"\d+(?:\.\d+)*", str(version))
    return tuple(int(n) for n in found.group().split(".")) if found else ()


def check_tested(package: str, version: str, what: str) -> str:
    """Refuse `version` of `package` (a TESTED key) outside its tested range, naming the range, the version seen and
    the two ways on (install the range, or FULLBAND_ALLOW_UNTESTED=1). -> the version."""
    from fullband.errors import FullbandError

    low, high = TESTED[package]
    if release(low) <= release(version) < release(high) or os.environ.get(ALLOW_UNTESTED) == "1":
        return version
    raise FullbandError(f"{what} is tested with {package} >={low},<{high}; {version} is installed. Install the "
                        f"tested range (pip install '{package}>={low},<{high}'), or set {ALLOW_UNTESTED}=1 to run "
                        "this untested combination anyway")
