"""Calibration text and what is captured from it: the sequences (calibration_sequences), a module's inputs
for AWQ (Calibration: a seeded sample of rows and the block Gram matrices over every row, captured layer by
layer by builder/quant/layerwise.py capture_inputs), and the rotary envelope of int8 KV's K scales.

The default text, builder/data/calibration.txt (~44 KB, ~11k tokens for SmolLM2), is code then prose: the start
of four Python standard library modules (textwrap, heapq, shlex, queue), none of them in data/heldout_files.txt,
then eight topics of the Python documentation (pydoc_data/topics.py: typesmapping to yield, past every window
tools.bench.gguf_perplexity scores); both PSF license. Either half alone suits its own domain and costs the
other: on SmolLM2-135M, GPTQ calibrated on the code alone lost +9.4% perplexity on prose, on the mixture +6.8%,
and on code the mixture beat the code alone (docs/ACCURACY.md, "Calibration text").
`quantization.calibration` names another UTF-8 text file, or is `self`: text the model writes itself
(`self_written_sequences`: in its own domain by construction, a code model's code, a chat model's prose).

Memory of AWQ's capture: one decoder layer's float32 weights at a time, the hidden states of the calibration
text, and for each captured module at most `max_rows` rows of its input (512 x K x 4 bytes: 8 MiB for K = 4096)
with its Gram in blocks (K x block x 8 bytes while summed: 1 MiB for K = 4096 in blocks of 32): ~1.5 GB of
activations for a 7B model, which the whole float32 model (~28 GB) no longer joins; int8 KV's capture
(capture_kv_extremes, there too) holds one layer and its extremes."""
from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import numpy as np

from runtime.manifest.arith import ceil_div

DEFAULT_CALIBRATION = Path(__file__).parent.parent / "data" / "calibration.txt"
SELF = "self"  # quantization.calibration: text the model writes itself
GREEDY_START = 4  # tokens picked by argmax after a self-written sequence's random first token
FULL_SAMPLING = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}  # the model's whole distribution
MAX_ROWS = 512
SEQ_LEN = 256
BATCH = 8


class CalibrationError(ValueError):
    """The calibration text or model cannot provide activations."""


def calibration_sequences(model_dir: Path, text_path: str | Path | None = None,
                          seq_len: int = SEQ_LEN) -> list[list[int]]:
    """The calibration text tokenized with the checkpoint's tokenizer, cut into sequences; with `text_path`
    "self", as many sequences as the default text gives, written by the model itself."""
    from tokenizers import Tokenizer

    if text_path == SELF:
        return self_written_sequences(model_dir, len(calibration_sequences(model_dir, None, seq_len)), seq_len)
    path = Path(text_path) if text_path else DEFAULT_CALIBRATION
    if not path.is_file():
        raise CalibrationError(f"quantization.calibration: {path} is not a file (expected UTF-8 text)")
    ids = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json")).encode(path.read_text()).ids
    if len(ids) < 2:
        raise CalibrationError(f"{path}: too little text to calibrate on ({len(ids)} tokens)")
    full = [ids[i:i + seq_len] for i in range(0, len(ids) - seq_len + 1, seq_len)]
    return full or [ids]  # equal lengths, so they batch; the ragged tail is dropped


def self_written_sequences(model_dir: Path, count: int, seq_len: int = SEQ_LEN, seed: int = 0,
                           batch: int = 16) -> list[list[int]]:
    """`count` sequences of `seq_len` tokens the float model writes itself, data-free as LLM-QAT generates its
    distillation data (Liu et al. 2023): a first token drawn uniformly from the vocabulary (special tokens
    left out), GREEDY_START tokens by argmax, then sampled at temperature 1 without an end-of-sequence token.
    Seeded: the same checkpoint writes the same text. Holds the whole float32 model (transformers' generate)."""
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, local_files_only=True)
    model.eval()
    tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    ordinary = np.array([i for i in range(model.config.vocab_size) if i not in special])
    starts = np.random.default_rng(seed).choice(ordinary, count)
    torch.manual_seed(seed)
    out: list[list[int]] = []
    with torch.no_grad():
        for i in range(0, count, batch):
            ids = torch.tensor(starts[i:i + batch, None], dtype=torch.long)
            for sampling, n in (({}, GREEDY_START), (FULL_SAMPLING, seq_len - 1 - GREEDY_START)):
                ids = model.generate(ids, attention_mask=torch.ones_like(ids), **sampling, max_new_tokens=n,
                                     min_new_tokens=n, pad_token_id=0)  # min_new_tokens: no end-of-sequence
            out += ids.tolist()
    return out


class Calibration(NamedTuple):
    """One module's calibration inputs: a seeded sample of rows (AWQ's scale search) and, over every row, the
    block-diagonal Gram matrix in blocks of `block` columns (AWQ's clipping)."""

    rows: np.ndarray   # float32 [<= max_rows, in_features]
    gram: np.ndarray   # float32 [ceil(in_features / block), block, block]: X_g^T X_g / rows, zero-padded


def block_gram(x: np.ndarray, block: int) -> np.ndarray:
    """sum over rows of x_g^T x_g for each block g of `block` columns (a partial last block zero-padded),
    float64 [blocks, block, block]; divide by the rows for the mean."""
    blocks = ceil_div(x.shape[-1], block)
    xb = np.pad(np.asarray(x, np.float64), ((0, 0), (0, blocks * block - x.shape[-1]))).reshape(len(x), blocks, block)
    return np.einsum("rgi,rgj->gij", xb, xb)


def pair_envelope(k: np.ndarray, rotary_dim: int, interleaved: bool) -> np.ndarray:
    """|k| with each rotary pair's two channels replaced by the pair's norm (k [..., head_dim])."""
    out = np.abs(k)
    if interleaved:
        first, second = np.arange(0, rotary_dim, 2), np.arange(1, rotary_dim, 2)
    else:
        first, second = np.arange(rotary_dim // 2), np.arange(rotary_dim // 2, rotary_dim)
    norm = np.sqrt(k[..., first] ** 2 + k[..., second] ** 2)
    out[..., first], out[..., second] = norm, norm
    return out
