"""Loading manifest.json and checking it: format, files' hashes, the graph it describes, the version rule.
The manifest says what an engine is, what it was built from, and the hash of every file in it (its typed
sections: runtime/manifest/types.py); loading explains any mismatch instead of failing later in a kernel."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from runtime.manifest.types import FORMAT_VERSION, EngineError, FileEntry, Manifest
from runtime.manifest.version import __version__

__all__ = ["FORMAT_VERSION", "MANIFEST", "EngineError", "Manifest", "draft_mismatch", "check_graph", "check_versions",
           "file_entries", "load_manifest", "read_manifest", "sha256_file", "with_files"]

MANIFEST = "manifest.json"
SECTIONS = ("model", "target", "limits", "kv_cache", "rope", "io", "files")


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def file_entries(directory: Path) -> dict[str, dict]:
    """sha256 and size of every file in the engine directory except the manifest itself."""
    return {p.name: {"sha256": sha256_file(p), "bytes": p.stat().st_size}
            for p in sorted(directory.iterdir()) if p.is_file() and p.name != MANIFEST}


def with_files(manifest: Manifest, directory: Path) -> Manifest:
    """`manifest` listing every file now in `directory` (the builder calls this as it writes the manifest)."""
    return manifest.replace(files={name: FileEntry(**entry) for name, entry in file_entries(directory).items()})


def read_manifest(engine_dir: str | Path, check_files: bool = True) -> Manifest:
    """The engine's typed, checked manifest: load_manifest's checks, every field's type, the version rule."""
    document = load_manifest(engine_dir, check_files)
    try:
        manifest = Manifest.from_dict(document)
    except EngineError:
        refuse_newer_major(document.get("builder_version"))  # a newer builder's format: say so, not which field
        raise
    check_versions(manifest)
    return manifest


def load_manifest(engine_dir: str | Path, check_files: bool = True) -> dict:
    """manifest.json as its JSON document, with its format version and sections checked and, with
    `check_files`, each file's size and sha256 (for scripts that read the file; the runtime reads the typed
    `read_manifest`)."""
    directory = Path(engine_dir)
    path = directory / MANIFEST
    if not directory.exists():
        raise EngineError(f"{directory}: no such directory; give the directory engine-build wrote (its --out)")
    if not path.is_file():
        raise EngineError(f"{directory}: no {MANIFEST}; not an engine directory (build one with engine-build)")
    try:
        manifest = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise EngineError(f"{path}: not valid JSON ({err}); the manifest is damaged, rebuild the engine") from err
    if not isinstance(manifest, dict):
        raise EngineError(f"{path}: a manifest is a JSON object, got {type(manifest).__name__}; rebuild the engine")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise EngineError(f"{path}: engine format version {version!r}, this runtime reads version "
                          f"{FORMAT_VERSION}; rebuild the engine with this version's engine-build")
    for key in SECTIONS:
        if key not in manifest:
            raise EngineError(f"{path}: manifest lacks the {key!r} section; the engine is incomplete")
    if check_files:
        _check_files(directory, manifest["files"])
    return manifest


def _check_files(directory: Path, files: dict[str, dict]) -> None:
    for name, entry in files.items():
        if Path(name).name != name or not isinstance(entry, dict) or not {"bytes", "sha256"} <= set(entry):
            raise EngineError(f"{directory}: manifest file entry {name!r}: {entry!r} is malformed "
                              f"(expected a plain file name with 'bytes' and 'sha256')")
        path = directory / name
        if not path.is_file():
            raise EngineError(f"{directory}: file {name} listed in the manifest is missing")
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise EngineError(f"{path}: {size} bytes, the manifest says {entry['bytes']}; the file is "
                              f"truncated or replaced")
        if sha256_file(path) != entry["sha256"]:
            raise EngineError(f"{path}: sha256 differs from the manifest; the file was modified after the build")


def _ints(shape) -> list:
    return [d if isinstance(d, int) else None for d in shape]


def check_graph(manifest: Manifest, inputs: list, outputs: list) -> None:
    """Refuse a manifest that contradicts the graph it describes. `inputs` / `outputs` are the ONNX Runtime
    session's get_inputs() / get_outputs() (objects with .name and .shape), so no onnx import is needed."""
    kv = manifest.kv_cache
    ins, outs = {a.name: _ints(a.shape) for a in inputs}, {a.name: _ints(a.shape) for a in outputs}
    problems = []
    listed = (set(manifest.io.inputs), set(manifest.io.outputs))
    if listed != (set(ins), set(outs)):
        problems.append(f"io lists inputs {sorted(listed[0] ^ set(ins))} / outputs {sorted(listed[1] ^ set(outs))} "
                        f"that the graph does not have, or misses ones it has")
    layers = sum(1 for name in ins if name.startswith("past_key_"))
    if layers != kv.num_layers:
        problems.append(f"kv_cache.num_layers is {kv.num_layers}, the graph has {layers} past_key inputs")
    axes = ((1, "kv_heads"), (3, "head_dim")) if kv.block_size is None else ((1, "block_size"), (2, "kv_heads"), (3, "head_dim"))
    for name, shape in ins.items():
        if name.startswith("past_") and len(shape) == 4:
            for axis, key in axes:
                if shape[axis] is not None and shape[axis] != getattr(kv, key):
                    problems.append(f"kv_cache.{key} is {getattr(kv, key)}, graph input {name} has {shape[axis]}")
                    break
    vocab = (outs.get("logits") or [None])[-1]
    if vocab is not None and vocab != manifest.vocab_size:
        problems.append(f"model.hyperparameters.vocab_size is {manifest.vocab_size}, the graph's logits have {vocab}")
    rope_width = (ins.get("cos_cache") or [None, None])[1]
    inv_freq = len(manifest.rope.inv_freq)
    if (rope_width is not None and inv_freq != rope_width) or 2 * inv_freq > kv.head_dim:
        problems.append(f"rope.inv_freq has {inv_freq} frequencies, the graph's cos_cache is {rope_width} wide "
                        f"(at most head_dim/2 = {kv.head_dim // 2})")
    problems += _token_and_limit_problems(manifest)
    if problems:
        raise EngineError(f"manifest.json contradicts the engine graph: {'; '.join(problems[:4])}; the manifest "
                          f"was edited or belongs to another engine, rebuild the engine")


def _token_and_limit_problems(manifest: Manifest) -> list[str]:
    tokens, limits, vocab = manifest.model.tokens, manifest.limits, manifest.vocab_size
    problems = []
    ids = list(tokens.eos_token_ids) + [tokens.bos_token_id, tokens.pad_token_id]
    bad = [t for t in ids if t is not None and not 0 <= t < vocab]
    if bad:
        problems.append(f"model.tokens ids {bad} are outside the vocabulary 0..{vocab - 1}")
    # a sliding window is honoured by the attention, so it does not bound the length; longrope's short factors do
    positions = [v for v in (manifest.model.max_position_embeddings, manifest.rope.exact_up_to) if v is not None]
    cap = limits.max_seq_len_cap
    if positions and cap > min(positions):
        problems.append(f"limits.max_seq_len_cap {cap} exceeds the model's position limit {min(positions)}")
    for value, key in ((limits.max_seq_len, "limits.max_seq_len"), (manifest.kv_cache.max_seq_len,
                                                                    "kv_cache.max_seq_len")):
        if value > cap:
            problems.append(f"{key} {value} exceeds limits.max_seq_len_cap {cap}")
    return problems


def draft_mismatch(target: Manifest, draft: Manifest) -> str | None:
    """Why `draft` cannot draft for `target`, or None when it can: the one check that engine-build (a
    `speculative:` recipe) and LLM(draft=...) both make."""
    if draft.vocab_size != target.vocab_size:
        return (f"the draft's vocabulary ({draft.vocab_size}) differs from the target's ({target.vocab_size}); "
                f"a draft must share the target's tokenizer")
    return None


def _version(text: object, what: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in str(text).split("+")[0].split(".")[:3])
    except ValueError:
        raise EngineError(f"manifest.json: {what} {text!r} is not a version like 1.2.3; rebuild the engine") from None


def refuse_newer_major(built: object) -> tuple[int, ...]:
    """The version of the builder that built the engine (None: this one), or an EngineError when its major
    version is newer than this runtime's."""
    ours = __version__

    theirs = _version(built or ours, "builder_version")
    if theirs[:1] > _version(ours, "this builder version")[:1]:
        raise EngineError(f"the engine was built by builder {built}, newer in major version than this runtime's "
                          f"{ours}; upgrade this package or rebuild the engine with it")
    return theirs


def check_versions(manifest: Manifest, warn=None) -> None:
    """The compatibility rule (docs/FAILURES.md, "Engine compatibility"): an engine from a builder of a newer major
    version is refused; a newer minor/patch builder, or an onnxruntime older than the one the engine was
    built with, loads with a warning naming both versions."""
    import warnings

    import onnxruntime

    ours = __version__

    warn = warn or (lambda text: warnings.warn(text, RuntimeWarning, stacklevel=3))
    built = manifest.builder_version
    theirs, mine = refuse_newer_major(built), _version(ours, "this builder version")
    if theirs > mine:
        warn(f"the engine was built by builder {built}, newer than this runtime's {ours}; it should load, "
             f"upgrade if anything fails")
    ort_built = manifest.target.built_with.get("onnxruntime")
    if ort_built and _version(onnxruntime.__version__, "onnxruntime") < _version(ort_built, "built_with.onnxruntime"):
        warn(f"the engine was built with onnxruntime {ort_built}; this runtime has the older "
             f"{onnxruntime.__version__}, which may lack operators it uses: upgrade onnxruntime if loading fails")
