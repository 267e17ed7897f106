"""llama.cpp's token ids for GGUF tokenizers, the reference builder/gguf/tokenizer.py is tested against.

    tools/checkpoints/llama_cpp_tokenize/build.sh /tmp/llama-cpp       # llama.cpp's tokenizer, from source
    python -m tools.checkpoints.gguf_tokenizer_fixtures --llama-cpp-tokenize /tmp/llama-cpp/llama-cpp-tokenize \
        [--smollm2 checkpoints/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf] [--retrain]

Each kind of tokenizer we accept gets one JSON file in tests/fixtures/gguf_tokenizer/: the texts of `TEXTS`
and llama.cpp's ids for each: `llama_tokenize(text, add_special=true, parse_special=true)` (BOS/EOS as the file
says, special tokens parsed), what llama-server does with a prompt. The small synthetic kinds (one byte-level BPE vocabulary under each `tokenizer.ggml.pre`, and one
SentencePiece-style vocabulary) are trained here with `tokenizers` on Python's own documentation text; their
GGUF metadata is stored in the fixture, so the test never retrains (`--retrain` makes new vocabularies). The
`smollm` fixture is for the real SmolLM2 file (`python -m tools.checkpoints.fetch smollm2`).
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
import tempfile
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "gguf_tokenizer"
BPE_PRE = ("default", "gpt-2", "llama-bpe", "qwen2")
TEXTS = [
    "The quick brown fox jumps over the lazy dog. It's 5 o'clock; we'll see what they've done.",
    "I'M HERE, YOU'LL SEE. DON'T! She'd've Known",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }  // dot\n\treturn sum;",
    "日本語のテキストと中文，한국어 😀👍🏽 café naïve Ωμέγα ÀÉÎÕÜ ß",
    "a  b   c    d\n\n\n\t\tx \n  \n   end   ",
    " leading space, trailing space ",
    "   ",
    "\n",
    "non\u00a0breaking\u3000ideographic\u2009thin\u200bzero-width",
    "1 12 123 1234 12345 3.14159 1,000,000 0x1F 2024-06-01 ١٢٣ ½ ²",
    "Hello!!! ... ??? (a+b)=c; x^2 ~ y|z $100 <tag> &amp; @user #tag 'quoted' \"double\"",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "<s>Hello</s> world <unk> <|endoftext|>text<|im_end|><|im_end|>",
    "[USER] wrote [USER]and left",
    "x" * 300 + " " * 40 + "\u2581 \u2581\u2581x a\u0301b",
]
# random mixes of what pre-tokenizers split on (letters, digits, punctuation, every kind of space, marks)
ALPHABET = "aZ 09\t\n\r  .,'\"!?$+<=>^~|`-_()[]{}éßΩ日本語中文한국😀👍🏽\u00a0\u3000\u2009\u200b\u0301\u2581١½²"
TEXTS += ["".join(random.Random(seed).choices(ALPHABET, k=80)) for seed in range(12)]
CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_DEFINED = ["[USER]"]


def corpus() -> str:
    """Training text: Python's bundled documentation topics plus a few lines outside ASCII."""
    from pydoc_data.topics import topics

    extra = "café naïve façade Ωμέγα élan Straße 東京 日本語 中文 😀 ½\n" * 20
    return "\n".join(list(topics.values())[:120]) + extra


def bpe_metadata(text: str) -> dict[str, Any]:
    """A byte-level BPE vocabulary (gpt2 kind) with control and user-defined tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=1200, special_tokens=CONTROL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([text], trainer)
    model = json.loads(tok.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get) + USER_DEFINED
    types = [3 if t in CONTROL else 4 if t in USER_DEFINED else 1 for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.merges": merges, "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 0}


def spm_metadata(text: str) -> dict[str, Any]:
    """A SentencePiece-style vocabulary (llama kind): <unk> <s> </s>, the 256 byte tokens, then pieces with
    scores that fall with their merge order (base characters lowest), as llama's converter lays them out."""
    from tokenizers import Tokenizer, models, normalizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    trainer = trainers.BpeTrainer(vocab_size=900, limit_alphabet=200, show_progress=False)
    tok.train_from_iterator([text], trainer)
    model = json.loads(tok.to_str())["model"]
    merged = [m.replace(" ", "") if isinstance(m, str) else "".join(m) for m in model["merges"]]
    chars = [t for t in sorted(model["vocab"], key=model["vocab"].get) if t not in set(merged)]
    pieces = list(dict.fromkeys(merged)) + chars
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.add_space_prefix": True}


def write_gguf(metadata: dict[str, Any], path: Path) -> None:
    """A GGUF file with this tokenizer metadata and a tiny llama's hyperparameters (no tensors): enough for
    llama.cpp's vocab-only load."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in (("context_length", 64), ("embedding_length", 64), ("block_count", 1),
                       ("feed_forward_length", 128), ("attention.head_count", 4),
                       ("attention.layer_norm_rms_epsilon", 1e-5)):
        (writer.add_uint32 if isinstance(value, int) else writer.add_float32)(f"llama.{key}", value)
    writer.add_tokenizer_model(metadata["tokenizer.ggml.model"])
    if "tokenizer.ggml.pre" in metadata:
        writer.add_tokenizer_pre(metadata["tokenizer.ggml.pre"])
    writer.add_token_list(metadata["tokenizer.ggml.tokens"])
    writer.add_token_types(metadata["tokenizer.ggml.token_type"])
    if "tokenizer.ggml.scores" in metadata:
        writer.add_token_scores(metadata["tokenizer.ggml.scores"])
    if "tokenizer.ggml.merges" in metadata:
        writer.add_token_merges(metadata["tokenizer.ggml.merges"])
    for key in ("bos_token_id", "eos_token_id", "unknown_token_id"):
        if f"tokenizer.ggml.{key}" in metadata:
            writer.add_uint32(f"tokenizer.ggml.{key}", metadata[f"tokenizer.ggml.{key}"])
    for key in ("add_space_prefix", "add_bos_token", "add_eos_token"):
        if f"tokenizer.ggml.{key}" in metadata:
            writer.add_bool(f"tokenizer.ggml.{key}", metadata[f"tokenizer.ggml.{key}"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def llama_cpp_ids(binary: str, gguf_path: Path, text: str, workdir: Path) -> list[int]:
    """llama.cpp's ids for `text` (written to a file and read back verbatim by the tool)."""
    prompt = workdir / "prompt.txt"
    prompt.write_bytes(text.encode())
    out = subprocess.run([binary, str(gguf_path), str(prompt)], capture_output=True, text=True, check=True,
                         timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def kinds(retrain: bool) -> dict[str, dict[str, Any]]:
    """Each synthetic kind's metadata: the committed fixture's, or new vocabularies with --retrain."""
    stored = {p.stem: json.loads(p.read_text())["metadata"] for p in FIXTURES.glob("*.json")
              if "metadata" in json.loads(p.read_text())}
    if stored and not retrain:
        return stored
    text = corpus()
    bpe = bpe_metadata(text)
    out = {f"bpe-{pre}": {**bpe, "tokenizer.ggml.pre": pre} for pre in BPE_PRE}
    out["spm"] = spm_metadata(text)
    out["spm-no-prefix"] = {**out["spm"], "tokenizer.ggml.add_space_prefix": False,
                            "tokenizer.ggml.add_bos_token": False, "tokenizer.ggml.add_eos_token": True}
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-cpp-tokenize", required=True,
                        help="the binary tools/checkpoints/llama_cpp_tokenize/build.sh makes")
    parser.add_argument("--smollm2", type=Path, help="the SmolLM2 GGUF (python -m tools.checkpoints.fetch smollm2)")
    parser.add_argument("--retrain", action="store_true", help="train new synthetic vocabularies")
    args = parser.parse_args(argv)
    FIXTURES.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for name, metadata in kinds(args.retrain).items():
            write_gguf(metadata, work / f"{name}.gguf")
            cases = [{"text": t, "ids": llama_cpp_ids(args.llama_cpp_tokenize, work / f"{name}.gguf", t, work)}
                     for t in TEXTS]
            _write(FIXTURES / f"{name}.json", {"metadata": metadata, "cases": cases})
        if args.smollm2:
            cases = [{"text": t, "ids": llama_cpp_ids(args.llama_cpp_tokenize, args.smollm2, t, work)} for t in TEXTS]
            _write(FIXTURES / "smollm2.json", {"gguf": args.smollm2.name, "cases": cases})


def _write(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, ensure_ascii=False, indent=None, separators=(",", ":")) + "\n")
    print(f"wrote {path} ({len(data['cases'])} texts)")


if __name__ == "__main__":
    main()
