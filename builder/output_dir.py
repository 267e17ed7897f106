"""Where an engine is written, safely.

The build writes into a hidden `.NAME.partial-PID` folder beside the output and renames it into place
only when the engine is complete and verified. The output path may only be replaced when it is absent,
an empty directory, or an engine this project wrote (its manifest.json has our `format_version` and
`builder_version`); anything else (the user's files, a file, the working directory or a parent of it,
the checkpoint or a folder containing it) is refused before any work. The builder never deletes
anything it did not create: the folders it removes are its own partial/old folders, by name."""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from runtime.interrupt import interrupts_deferred


class OutputError(ValueError):
    """The output path cannot be used for an engine; nothing was written or deleted."""


_OWN = re.compile(r"^\.(?P<name>.+)\.(?:partial|old)-(?P<pid>\d+)$")
_building: set[Path] = set()  # partial folders of this process, removed on an interrupt
_created_parents: dict[Path, list[Path]] = {}  # partial folder -> the parents made for it, outermost first


def is_engine_dir(path: Path) -> bool:
    """True when `path` holds a manifest.json written by this project's engine-build and nothing else than
    the files that manifest lists and engines in subfolders (`draft/`): a user's file inside is never replaced."""
    try:
        manifest = json.loads((path / "manifest.json").read_text())
    except (OSError, ValueError):
        return False
    if not (isinstance(manifest, dict) and "format_version" in manifest and "builder_version" in manifest):
        return False
    ours = set(manifest.get("files") or {}) | {"manifest.json"}
    return all(p.name in ours and p.is_file() or p.is_dir() and is_engine_dir(p) for p in path.iterdir())


def _inside(child: Path, parent: Path) -> bool:
    return child == parent or parent in child.parents


def check_output(out: Path, sources: list[Path]) -> None:
    """Refuse an output path the build must not replace. `sources` are the checkpoint directories read."""
    target = out.resolve()
    cwd = Path.cwd().resolve()
    if _inside(cwd, target):
        raise OutputError(f"--out {out}: this is the current directory or a parent of it; give a new or "
                          f"engine directory such as engines/NAME")
    for source in sources:
        src = source.resolve()
        if _inside(target, src) or _inside(src, target):
            raise OutputError(f"--out {out}: the output would replace or sit inside the checkpoint {source}; "
                              f"write the engine elsewhere, e.g. engines/{src.name}")
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise OutputError(f"--out {out}: exists and is a file or a symlink, not an engine directory; nothing was "
                          f"changed: choose another path")
    if out.is_dir() and any(out.iterdir()) and not is_engine_dir(out):
        raise OutputError(f"--out {out}: the directory is not empty and is not an engine (no manifest.json "
                          f"from engine-build, or files the engine does not list); nothing was changed. Choose a "
                          f"new path, or empty it yourself")


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale(out: Path, log=print) -> None:
    """Remove `.NAME.partial-PID` / `.NAME.old-PID` folders of builds of `out` whose process is gone."""
    if not out.parent.is_dir():
        return
    for path in out.parent.iterdir():
        match = _OWN.match(path.name)
        if match and match["name"] == out.name and path.is_dir() and not _alive(int(match["pid"])):
            log(f"removing {path}, left by an interrupted build (process {match['pid']} is gone)")
            shutil.rmtree(path, ignore_errors=True)


def start_partial(out: Path) -> Path:
    """Create this build's own hidden folder beside `out` and register it for interrupt cleanup."""
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)  # our own pid: a folder of an earlier build in this process
    _created_parents[tmp] = [p for p in reversed(tmp.parents) if not p.exists()]
    try:
        tmp.mkdir(parents=True)
    except OSError as err:
        _created_parents.pop(tmp)
        raise OutputError(f"--out {out}: cannot create a folder beside it ({err.strerror}: {err.filename}); "
                          f"choose a writable path") from None
    _building.add(tmp)
    return tmp


def discard_partial(tmp: Path) -> None:
    """Remove the partial folder and the parent folders the build created for it (when still empty)."""
    _building.discard(tmp)
    shutil.rmtree(tmp, ignore_errors=True)
    for parent in reversed(_created_parents.pop(tmp, [])):
        try:
            parent.rmdir()
        except OSError:
            break


def discard_all_partials() -> None:
    """Remove every partial folder of this process (called from the SIGINT handler)."""
    for tmp in list(_building):
        discard_partial(tmp)


def replace(tmp: Path, out: Path) -> None:
    """Move the finished engine into place; an existing engine at `out` is replaced only now.
    `check_output` ran before the build; it is checked again here in case `out` changed meanwhile."""
    if out.is_dir() and any(out.iterdir()) and not is_engine_dir(out):
        raise OutputError(f"--out {out}: files appeared there during the build and it is not an engine; "
                          f"nothing was replaced")
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    with interrupts_deferred():  # a Ctrl-C between the two renames would leave no engine at `out`
        if out.is_dir():
            out.rename(old)
        tmp.rename(out)
        _building.discard(tmp)
        _created_parents.pop(tmp, None)
    shutil.rmtree(old, ignore_errors=True)
