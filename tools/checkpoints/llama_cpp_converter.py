"""llama.cpp's own Hugging Face -> GGUF converter, for tests that need a file made the way users' files are.

    python -m tools.checkpoints.llama_cpp_converter [--sdist PATH] [--dest checkpoints]

The converter (convert_hf_to_gguf.py, its conversion/ package and the gguf-py it was written against) is pure
Python over torch and transformers; it ships in the llama-cpp-python sdist, not in any wheel. pip downloads that
sdist alone (`--no-deps --no-binary :all:`, 76 MB, nothing is built), its sha256 is checked before anything is
read from it, and only those files are extracted, to <dest>/llama.cpp/<version>/ (~2 MB), reused afterwards.

`convert` runs it as a subprocess with the extracted gguf-py first on that process's path only (the installed
`gguf` stays what the builder reads files with) and one patch: the converter names a BPE tokenizer's
pre-tokenizer by hashing how it splits a test string, and our random checkpoints' tokenizers (trained by
make_checkpoint) are in no list, so it is named "default" (llama.cpp's GPT-2 regex). Every tensor and every
hyperparameter is still written by llama.cpp's code."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import click

from tools.checkpoints.fetch import FetchError

VERSION = "0.3.36"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
MEMBERS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")  # under vendor/llama.cpp/ in the sdist
ROOT = Path(__file__).resolve().parents[2]

CONVERT_SCRIPT = """  # llama.cpp's converter with one patch (tools/bench/gguf_peer.py says why)
import runpy, sys
src = sys.argv.pop(1)
sys.path[:0] = [src, src + "/gguf-py"]
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
sys.argv[0] = src + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def converter(root: Path = ROOT / "checkpoints", sdist: Path | None = None, log=print) -> Path:
    """The directory holding llama.cpp's convert_hf_to_gguf.py of llama-cpp-python VERSION (extracted once)."""
    dest = root / "llama.cpp" / VERSION
    marker = dest / "extracted.json"
    if marker.is_file() and json.loads(marker.read_text()).get("sdist_sha256") == SDIST_SHA256:
        log(f"{dest}: llama.cpp's converter present")
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".extracting-") as tmp:
        sdist = sdist or _download(Path(tmp), log)
        actual = _sha256(sdist)
        if actual != SDIST_SHA256:
            raise FetchError(f"{sdist.name}: sha256 {actual} does not match the expected {SDIST_SHA256}; not the "
                             f"llama-cpp-python {VERSION} sdist")
        tree = Path(tmp) / "tree"
        _extract(sdist, tree)
        (tree / marker.name).write_text(json.dumps({"version": VERSION, "sdist_sha256": SDIST_SHA256,
                                                    "members": MEMBERS}))
        shutil.rmtree(dest, ignore_errors=True)
        tree.rename(dest)  # whole or not at all: a half-extracted tree is never reused
    log(f"{dest}: llama.cpp's converter extracted from llama-cpp-python {VERSION}, sha256 ok")
    return dest


def convert(checkpoint: Path, out: Path, outtype: str = "f32", root: Path = ROOT / "checkpoints") -> Path:
    """HF checkpoint directory -> GGUF file `out` of `outtype` (f32, f16, bf16, q8_0) by llama.cpp's converter."""
    src = converter(root, log=lambda _: None)
    cmd = [sys.executable, "-c", CONVERT_SCRIPT, str(src), str(checkpoint), "--outtype", outtype, "--outfile", str(out)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src / "gguf-py"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0 or not out.is_file():
        tail = "\n".join(proc.stderr.strip().splitlines()[-8:])
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {checkpoint} (exit {proc.returncode}):\n{tail}")
    return out


def _download(tmp: Path, log) -> Path:
    requirement = f"llama-cpp-python=={VERSION}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--dest", str(tmp),
           requirement]
    log(f"downloading the {requirement} sdist (pip download --no-deps --no-binary :all:, 76 MB)")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(tmp.glob("llama_cpp_python-*.tar.gz"))
    if proc.returncode != 0 or not found:
        tail = "\n".join(proc.stderr.strip().splitlines()[-3:])
        raise FetchError(f"pip could not download the {requirement} sdist: {tail or 'no sdist'}\n"
                         f"(a copy on disk: python -m tools.checkpoints.llama_cpp_converter --sdist PATH)")
    return found[0]


def _extract(sdist: Path, dest: Path) -> None:
    with tarfile.open(sdist) as tar:
        prefix = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
        members = []
        for m in tar.getmembers():
            name = m.name[len(prefix):] if m.name.startswith(prefix) else ""
            if (m.isfile() or m.isdir()) and name and any(name == k or name.startswith(k) for k in MEMBERS):
                m.name = name
                members.append(m)
        if not any(m.name == MEMBERS[0] for m in members):
            raise FetchError(f"{sdist.name} holds no vendor/llama.cpp/{MEMBERS[0]}")
        dest.mkdir(parents=True, exist_ok=True)
        tar.extractall(dest, members=members, filter="data")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


@click.command()
@click.option("--sdist", type=click.Path(exists=True, path_type=Path), help="a copy of the sdist instead of pip")
@click.option("--dest", type=click.Path(path_type=Path), default=ROOT / "checkpoints", show_default=True)
def main(sdist: Path | None, dest: Path) -> None:
    """Extract llama.cpp's converter from the llama-cpp-python sdist."""
    converter(dest, sdist, log=click.echo)


if __name__ == "__main__":
    main()
