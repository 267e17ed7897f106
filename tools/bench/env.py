"""The environment a benchmark ran in: CPU model and vector extensions, cores, load, library versions.

Every figure in docs/BENCHMARKS.md names the CPU (AVX2 or AVX-512) and the load the machine was under;
every harness in tools/bench/ takes that description from here."""
from __future__ import annotations

import importlib
import os
import platform
import re
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (the platform's processor name elsewhere)."""
    model = platform.processor() or platform.machine()
    try:
        found = re.search(r"model name\s*:\s*(.+)", Path("/proc/cpuinfo").read_text())
    except OSError:
        return model
    return found.group(1).strip() if found else model


def cpu_vector_flags() -> str:
    """The widest x86 vector extension family the CPU has: "AVX-512", "AVX2" or "" (none found / not x86)."""
    try:
        flags = set(re.findall(r"\b(avx512\w*|avx2)\b", Path("/proc/cpuinfo").read_text()))
    except OSError:
        return ""
    return "AVX-512" if any(f.startswith("avx512") for f in flags) else "AVX2" if "avx2" in flags else ""


def machine() -> str:
    """One line: CPU model and vector extensions, usable cores, operating system."""
    vector = cpu_vector_flags()
    return (f"{cpu_model()}{f' ({vector})' if vector else ''}, {len(os.sched_getaffinity(0))} cores usable, "
            f"{platform.system()} {platform.release()}")


def load_average() -> list[float]:
    return list(os.getloadavg())


def package_versions(packages: tuple[str, ...] = ("llm-engine-builder", "onnxruntime", "numpy", "torch",
                                                  "transformers")) -> dict[str, str | None]:
    """Installed distribution versions by package name (None where it is not installed), with Python's."""
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for pkg in packages:
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    return versions


def module_versions(modules: list[str]) -> dict[str, str]:
    """`__version__` of each importable module, "not installed" for the others."""
    versions = {}
    for name in modules:
        try:
            versions[name] = importlib.import_module(name).__version__
        except ImportError:
            versions[name] = "not installed"
    return versions


def environment() -> dict:
    """{date, machine, versions, load_average}: what engine-bench records at the start of a run."""
    return {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "machine": machine(),
            "versions": package_versions(), "load_average": load_average()}
