"""llama.cpp as a peer in the decode benchmarks: the same random checkpoint converted to GGUF by
llama.cpp's own converter, quantized to q4_0 by llama.cpp's own quantizer, run through llama-cpp-python.

llama-cpp-python is a bench-only dependency (a source build, minutes on a small CPU; never in CI):

    pip install llama-cpp-python==0.3.36 --no-binary llama-cpp-python   # CMAKE_ARGS="-DGGML_NATIVE=ON"
    pip install sentencepiece gguf                                       # llama.cpp's converter needs them
    python -m tools.bench.gguf_peer fetch-source                         # its convert_hf_to_gguf.py

The wheel does not ship llama.cpp's convert_hf_to_gguf.py, so `fetch-source` unpacks the sdist of the
installed version (downloaded with pip, or given with --sdist) into SOURCE_CACHE; $LLAMA_CPP_SRC points
elsewhere. Conversion: HF checkpoint -> GGUF f32 (convert_hf_to_gguf.py, run as a subprocess) -> q4_0
(llama_model_quantize). The GGUFs are cached next to the checkpoint and reused while the checkpoint's
config and the llama.cpp version are unchanged; the f32 intermediate is deleted once quantized.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import click
import numpy as np

from tools.checkpoints.llama_cpp_converter import CONVERT_SCRIPT

INSTALL_HINT = "not installed: pip install llama-cpp-python (source build)"
SOURCE_ENV = "LLAMA_CPP_SRC"
SOURCE_CACHE = Path.home() / ".cache" / "llm-engine-builder" / "llama.cpp"

# The converter, run as a script after one patch: it names a BPE tokenizer's pre-tokenizer by hashing how
# the tokenizer splits a test string, and our random checkpoints' tokenizers (trained by make_checkpoint)
# are in no list. The benchmark and the test feed token ids, so the name ("default", llama.cpp's GPT-2
# regex) is never used; every tensor and hyperparameter is still written by llama.cpp's own code. The same
# script (CONVERT_SCRIPT) runs the converter for the GGUF rope tests (tools/checkpoints/llama_cpp_converter.py).


@dataclass(frozen=True)
class Variant:
    """One llama.cpp form of the checkpoint: `ftype` f32 (the converter's own output, unquantized), q8_0 or
    q4_0. `pure` quantizes every 2-D weight to `ftype`; without it llama.cpp's q4_0 mix keeps the output
    matrix (a tied embedding is that matrix) at q6_K."""

    name: str
    label: str
    pure: bool = False
    ftype: str = "q4_0"


FTYPES = {"q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0"}  # llama_cpp's constant names


VARIANTS = (
    Variant("q4_0", "llama.cpp q4_0"),
    Variant("q4_0-pure", "llama.cpp q4_0 --pure", pure=True),
)


@dataclass
class PeerSetup:
    """What a peer adds to tools/bench/decode.py's run_benchmark: backends as (label, factory, args) run
    each in its own process, build stats per label, notes for skipped rows, library versions."""

    backends: list[tuple[str, type, tuple]] = field(default_factory=list)
    builds: dict[str, dict] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    versions: dict[str, str] = field(default_factory=dict)


def llama_cpp_version() -> str | None:
    """The installed llama-cpp-python's version, None when it is not importable."""
    try:
        import llama_cpp
    except ImportError:
        return None
    return llama_cpp.__version__


# -- llama.cpp's converter --------------------------------------------------------------------------
def find_source(version: str) -> Path:
    """llama.cpp's source tree (the dir holding convert_hf_to_gguf.py and gguf-py/) of `version`."""
    src = Path(os.environ[SOURCE_ENV]) if os.environ.get(SOURCE_ENV) else SOURCE_CACHE / version
    if not (src / "convert_hf_to_gguf.py").is_file():
        raise FileNotFoundError(f"llama.cpp's convert_hf_to_gguf.py is not under {src}: run "
                                f"`python -m tools.bench.gguf_peer fetch-source` (or set ${SOURCE_ENV})")
    return src


def unpack_source(sdist: Path, version: str) -> Path:
    """Extract the llama.cpp tree vendored in a llama-cpp-python sdist into SOURCE_CACHE/<version>."""
    dest = SOURCE_CACHE / version
    with tarfile.open(sdist) as tar:
        top = tar.getnames()[0].split("/")[0]
        prefix = f"{top}/vendor/llama.cpp/"
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
        if not members:
            raise ValueError(f"{sdist} holds no vendor/llama.cpp: not a llama-cpp-python sdist")
        for m in members:
            m.name = m.name[len(prefix):]
        dest.mkdir(parents=True, exist_ok=True)
        tar.extractall(dest, members=[m for m in members if m.name], filter="data")
    return dest


def download_sdist(version: str, into: Path) -> Path:
    """pip download the llama-cpp-python sdist of `version` (no build, no dependencies)."""
    cmd = [sys.executable, "-m", "pip", "download", f"llama-cpp-python=={version}", "--no-deps",
           "--no-binary", ":all:", "-d", str(into)]
    subprocess.run(cmd, check=True)
    return next(into.glob("llama_cpp_python-*.tar.gz"))


def convert(checkpoint: Path, out: Path, src: Path, outtype: str = "f32") -> Path:
    """HF checkpoint -> GGUF of `outtype` (f32 or f16) by llama.cpp's convert_hf_to_gguf.py."""
    cmd = [sys.executable, "-c", CONVERT_SCRIPT, str(src), str(checkpoint), "--outtype", outtype, "--outfile", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not out.is_file():
        tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {checkpoint} (exit {proc.returncode}):\n{tail}")
    return out


def quantize(source: Path, out: Path, pure: bool = False, threads: int = 2, ftype: str = "q4_0") -> Path:
    """GGUF f32/f16 -> `ftype` (q4_0, q8_0) by llama.cpp's llama_model_quantize (llama-quantize's defaults,
    or --pure)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, FTYPES[ftype])
    params.nthread = threads
    params.pure = pure
    code = llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), params)
    if code != 0 or not out.is_file():
        raise RuntimeError(f"llama_model_quantize({source} -> {out}, {ftype}) returned {code}")
    return out


def tensor_types(path: Path) -> dict[str, str]:
    """{tensor name: ggml type name} of a GGUF file (needs the `gguf` package)."""
    from gguf import GGUFReader

    return {t.name: t.tensor_type.name for t in GGUFReader(str(path)).tensors}


def prepare(checkpoint: Path, cache: Path, variants=VARIANTS, threads: int = 2, log=print) -> tuple[dict, dict]:
    """The variants' GGUFs under `cache`, made once per checkpoint config, llama.cpp version and variants (in a child
    process, for its time and peak memory). Returns ({variant name: path}, {variant name: build stats})."""
    from tools.bench import isolated

    version = llama_cpp_version()
    stamp = {"config": json.loads((checkpoint / "config.json").read_text()), "llama_cpp": version,
             "variants": [list(dataclasses.astuple(v)) for v in variants]}
    paths = {v.name: cache / f"{checkpoint.name}-{v.name}.gguf" for v in variants}
    marker = cache / f"{checkpoint.name}-gguf.json"
    old = json.loads(marker.read_text()) if marker.is_file() else {}
    if old.get("stamp") == stamp and all(p.is_file() and n in old["builds"] for n, p in paths.items()):
        log(f"reusing GGUF files {', '.join(str(p) for p in paths.values())}")
        return paths, {name: old["builds"][name] for name in paths}
    cache.mkdir(parents=True, exist_ok=True)
    src = find_source(version)
    log(f"converting {checkpoint} -> GGUF f32 -> {', '.join(paths)} under {cache} (llama.cpp {version})")
    builds, _ = isolated.run(_make, checkpoint, paths, variants, threads, src)
    marker.write_text(json.dumps({"stamp": stamp, "builds": builds}))  # last: a half-made set is never reused
    return paths, builds


def _make(checkpoint: Path, paths: dict, variants, threads: int, src: Path) -> dict:
    """Convert once to f32, quantize every variant (an f32 variant is that file, linked), delete the f32
    file. Per variant: seconds (conversion + its quantization), peak RSS of the converter and the quantizer,
    size on disk."""
    import resource

    f32 = next(iter(paths.values())).with_name(f"{checkpoint.name}-converted-f32.gguf")  # not an f32 variant's name
    start = time.perf_counter()
    try:
        convert(checkpoint, f32, src)
        convert_s = time.perf_counter() - start
        seconds = {}
        for v in variants:
            start = time.perf_counter()
            if v.ftype == "f32":
                paths[v.name].unlink(missing_ok=True)
                os.link(f32, paths[v.name])
            else:
                quantize(f32, paths[v.name], v.pure, threads, v.ftype)
            seconds[v.name] = convert_s + time.perf_counter() - start
    finally:
        f32.unlink(missing_ok=True)
    peak = max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)) / 1024
    return {name: {"seconds": s, "peak_rss_mb": peak, "start_rss_mb": None,
                   "engine_mb": paths[name].stat().st_size / 1e6} for name, s in seconds.items()}


# -- running it --------------------------------------------------------------------------------------
def load(path: Path, n_ctx: int, threads: int, **kwargs):
    """A llama_cpp.Llama on `path`, quiet; kwargs go to Llama (e.g. type_k/type_v for the KV cache)."""
    from llama_cpp import Llama

    return Llama(str(path), n_ctx=n_ctx, n_batch=n_ctx, n_threads=threads, n_threads_batch=threads,
                 verbose=False, **kwargs)


def last_logits(llm) -> np.ndarray:
    """The logits llama.cpp computed for the last token it evaluated, copied: [vocab]."""
    import llama_cpp

    row = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return np.ctypeslib.as_array(row, shape=(llm.n_vocab(),)).copy()


def greedy(llm, prompt: list[int], new_tokens: int, stamps: list[float] | None = None,
           logits: list[np.ndarray] | None = None) -> list[int]:
    """Greedy-generate exactly `new_tokens` ids after `prompt` (EOS ignored), from a fresh KV cache.
    Appends the time each token was picked to `stamps` and its logits [vocab] to `logits` when given."""
    llm.reset()
    llm.eval(prompt)
    out: list[int] = []
    for _ in range(new_tokens):
        row = last_logits(llm)
        out.append(int(np.argmax(row)))
        if stamps is not None:
            stamps.append(time.perf_counter())
        if logits is not None:
            logits.append(row)
        if len(out) < new_tokens:
            llm.eval(out[-1:])
    return out


class LlamaCppBackend:
    """A GGUF through llama-cpp-python at batch 1, greedy by argmax over llama.cpp's last logits (the same
    work per token as the other backends' greedy pick; no sampler chain), timed by wall clock like them."""

    def __init__(self, label: str, path: Path, work):
        self.label = label
        self.llm = load(path, work.max_seq_len, work.threads)

    def generate(self, prompts: np.ndarray, new_tokens: int):
        from tools.bench.decode import Timing

        if prompts.shape[0] != 1:
            raise ValueError(f"{self.label} runs batch 1 only (one llama.cpp sequence), got batch {prompts.shape[0]}")
        stamps: list[float] = []
        start = time.perf_counter()
        tokens = greedy(self.llm, prompts[0].tolist(), new_tokens, stamps)
        end = time.perf_counter()
        if len(tokens) != new_tokens:
            raise RuntimeError(f"{self.label}: generated {len(tokens)} tokens, wanted {new_tokens}")
        return Timing(stamps[0] - start, end - start)

    def close(self) -> None:
        self.llm.close()


def peer(checkpoint: Path, workdir: Path, work, log=print, variants=VARIANTS) -> PeerSetup:
    """tools/bench/decode.py's run_benchmark peer: llama.cpp rows for batch 1 (GGUFs cached under
    <workdir>/gguf), or a note saying why there are none."""
    version = llama_cpp_version()
    if version is None:
        return PeerSetup(notes=[f"{v.label}: {INSTALL_HINT}" for v in variants])
    if work.batch_sizes != (1,):
        return PeerSetup(notes=[f"llama.cpp rows run at batch 1 only; batch sizes were {work.batch_sizes}"])
    try:
        paths, builds = prepare(checkpoint, workdir / "gguf", variants, work.threads, log)
    except (FileNotFoundError, RuntimeError) as err:
        return PeerSetup(notes=[f"llama.cpp rows skipped: {err}"], versions={"llama_cpp": version})
    types = {v.label: _weight_types(paths[v.name]) for v in variants}
    return PeerSetup(backends=[(v.label, LlamaCppBackend, (v.label, paths[v.name], work)) for v in variants],
                     builds={v.label: builds[v.name] for v in variants},
                     notes=[f"{label} tensor types: {t}" for label, t in types.items() if t],
                     versions={"llama_cpp": version})


def _weight_types(path: Path) -> str:
    """'token_embd q6_K, output -, blocks q4_0' style summary ('' without the gguf package)."""
    try:
        types = tensor_types(path)
    except ImportError:
        return ""
    blocks = sorted({t for n, t in types.items() if n.startswith("blk.") and not n.endswith("norm.weight")})
    return (f"token_embd.weight {types.get('token_embd.weight', '-')}, output.weight "
            f"{types.get('output.weight', 'none (tied: token_embd)')}, block matrices {'/'.join(blocks)}")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """llama.cpp peer: fetch its converter, convert a checkpoint to GGUF q4_0."""


@main.command("fetch-source")
@click.option("--sdist", type=click.Path(dir_okay=False, exists=True, path_type=Path), default=None,
              help="A local llama-cpp-python sdist (default: pip download the installed version's).")
def fetch_source(sdist: Path | None) -> None:
    """Unpack llama.cpp's source (convert_hf_to_gguf.py, gguf-py) for the installed llama-cpp-python."""
    version = llama_cpp_version()
    if version is None:
        raise click.ClickException(INSTALL_HINT)
    with tempfile.TemporaryDirectory() as tmp:
        dest = unpack_source(sdist or download_sdist(version, Path(tmp)), version)
    click.echo(f"llama.cpp {version} source -> {dest}")


@main.command("convert")
@click.argument("checkpoint", type=click.Path(file_okay=False, exists=True, path_type=Path))
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where the GGUFs go (default: <checkpoint>/../../gguf, as the benchmark caches them).")
def convert_command(checkpoint: Path, out: Path | None) -> None:
    """Convert a HF Llama checkpoint to GGUF q4_0 (default mix and --pure), cached."""
    if llama_cpp_version() is None:
        raise click.ClickException(INSTALL_HINT)
    paths, _ = prepare(checkpoint, out or checkpoint.parent.parent / "gguf", log=click.echo)
    for name, path in paths.items():
        click.echo(f"{name}: {path} ({_weight_types(path)})")


if __name__ == "__main__":
    main()
