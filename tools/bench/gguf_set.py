"""GGUF types against llama.cpp on the same files (issue 47): a set of files made here by llama.cpp's own converter
and quantizer, each raced against llama.cpp and scored beside it, in one table.

    LLAMA_CPP_SRC=/path/to/llama.cpp PYTHONPATH=/path/to/llama_cpp_python:$PWD python -m tools.bench.gguf_set \\
        [--models smollm2,gemma3,qwen3] [--types Q4_0,Q4_1,Q4_K_M,Q5_K_M,Q6_K,Q8_0,IQ4_XS] [--rounds 3] \\
        [--ppl-tokens 4096] [--accuracy-level auto] [--cache checkpoints/random/gguf_set] [--out FILE]

The float sources, made once under --cache:
- smollm2: SmolLM2-135M-Instruct's weights, its Q4_1 file (checkpoints/smollm2) dequantized by transformers
  (`gguf_file=`), saved as a Hugging Face checkpoint and converted back by llama.cpp's convert_hf_to_gguf.py to f32
  (its own tokenizer, recognized by the converter). The file's Q4_1 is then re-quantized from the Q4_1 grid.
- gemma3: random weights in Gemma 3 270M's shape (hidden 640, 18 layers, 4 heads and 1 KV head of 256, MLP 2048,
  a tied 262144-token embedding): the issue's "Q4_K_M of a current family" shape.
- qwen3: random weights in a Qwen3 shape (hidden 1024, 8 layers, 16 heads and 8 KV heads of 128, QK norms, MLP
  3072, a tied 32000-token embedding).
Each f32 file is quantized to every type by `llama_model_quantize` (llama-quantize's defaults: Q4_K_M mixes Q4_K,
Q6_K and, where a row is not a multiple of 256, Q5_0 / Q8_0 fallbacks, as llama.cpp does for SmolLM2's 576 and
Gemma's 640; IQ4_XS needs no importance matrix). Our engine is built from that file (engine-build,
`quantization.accuracy_level` as given). `auto`, the default, is the README recipe's (build_recipes/smollm2_cpu.yaml):
the build measures each matmul's kernel choice against transformers within `accuracy_budget` 1%, which needs its
verification on (the smollm2 files take the recipe's verify settings, the random ones the recipe defaults meant for
random weights); an explicit level builds without verification
(tests/builder/test_gguf.py holds the import).

Only the timed races hold `flock /tmp/bench.lock` (the machine is shared); making files, building engines and
scoring run at idle priority (`chrt -i 0 nice -n 19`). Per file: `tools.bench.llama_cpp_peer` (decode batch 1 and 8,
prefill 512, ours and llama.cpp alternated round by round, each in its own process, same threads), one lock hold per
file; and for the smollm2 files `tools.bench.gguf_perplexity --peer` (ours and llama.cpp on the same windows of pydoc
prose, against transformers on the same file, with the paired standard error of the top-1 difference; random
weights' perplexity means nothing, so none for them). Each result is cached as JSON next to the files, so a rerun
(or a run stopped between files) skips what it has (`--fresh` redoes the measurements, `--rebuild` the engines
too)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import click

from tools.bench import env

TYPES = ("Q4_0", "Q4_1", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "IQ4_XS")
MODELS = ("smollm2", "gemma3", "qwen3")
SMOLLM2_Q4_1 = Path("checkpoints/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
SHAPES = {  # make_checkpoint's arguments
    "gemma3": dict(family="gemma3", hidden_size=640, num_layers=18, num_heads=4, num_kv_heads=1, head_dim=256,
                   intermediate_size=2048, vocab_size=262144, tie_word_embeddings=True, max_position_embeddings=2048),
    "qwen3": dict(hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=8, head_dim=128,
                  intermediate_size=3072, vocab_size=32000, tie_word_embeddings=True, max_position_embeddings=2048),
}
LOCK = "/tmp/bench.lock"
IDLE = ["chrt", "-i", "0", "nice", "-n", "19"]  # untimed work takes only a core nobody else wants
SCORE_THREADS = 1  # scoring runs at idle priority: two spinning threads (llama.cpp's OpenMP, ORT's pool) descheduled
#                   in turn wait on each other, 10x slower than one
README_RECIPE = Path("build_recipes/smollm2_cpu.yaml")  # the smollm2 files are checked with its verify settings


def log(message: str) -> None:
    click.echo(f"[{time.strftime('%H:%M:%S')}] {message}", err=True)


# -- the files ---------------------------------------------------------------------------------------------------
def float_checkpoint(model: str, cache: Path) -> Path:
    """The Hugging Face checkpoint of `model`'s float weights under `cache` (made once)."""
    out = cache / f"{model}-hf"
    if (out / "config.json").is_file():
        return out
    log(f"making {out}")
    idle_call("make_float_checkpoint", model, str(out))
    return out


def idle_call(function: str, *args: str) -> None:
    """`function(*args)` of this module in a child process at idle priority (IDLE): the run itself stays at normal
    priority, so the races it starts are timed at normal priority (an unprivileged process cannot return to it)."""
    call = f"import sys; from tools.bench import gguf_set; gguf_set.{function}(*sys.argv[1:])"
    _run([*IDLE, sys.executable, "-c", call, *args])


def make_float_checkpoint(model: str, out: str) -> None:
    out = Path(out)
    if model == "smollm2":
        _dequantized_smollm2(out)
    elif model == "qwen3":
        _random_qwen3(out, **SHAPES["qwen3"])
    else:
        from tools.checkpoints.make_checkpoint import make_checkpoint

        make_checkpoint(out, **SHAPES[model])


def _dequantized_smollm2(out: Path) -> None:
    """transformers' float32 model of the Q4_1 file, saved (its GGUF marking dropped: the weights are plain floats)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = dict(gguf_file=SMOLLM2_Q4_1.name)
    model = AutoModelForCausalLM.from_pretrained(str(SMOLLM2_Q4_1.parent), dtype=torch.float32, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(str(SMOLLM2_Q4_1.parent), **kwargs)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None  # transformers refuses to save a model it loaded from GGUF otherwise
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _random_qwen3(out: Path, num_layers: int, num_heads: int, num_kv_heads: int, **shape) -> None:
    """A random Qwen3 (dense, QK norms) checkpoint with make_checkpoint's tokenizer and generation config."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    from tools.checkpoints.make_checkpoint import BOS_ID, EOS_ID, PAD_ID, _write_generation_config, make_tokenizer

    config = Qwen3Config(num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                         bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, use_sliding_window=False,
                         **shape)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval().save_pretrained(out)
    _write_generation_config(out)
    make_tokenizer(out, shape["vocab_size"])


def float_gguf(model: str, cache: Path, src: Path) -> Path:
    """`model` as an f32 GGUF by llama.cpp's convert_hf_to_gguf.py (made once). SmolLM2's tokenizer is one the
    converter knows; the random checkpoints' tokenizers go through gguf_peer's one patch (their pre-tokenizer
    name), which the benchmark never uses (it feeds token ids)."""
    out = cache / f"{model}-f32.gguf"
    if out.is_file():
        return out
    checkpoint = float_checkpoint(model, cache)
    log(f"converting {checkpoint} -> {out}")
    if model == "smollm2":
        cmd = [*IDLE, sys.executable, str(src / "convert_hf_to_gguf.py"), str(checkpoint), "--outtype", "f32",
               "--outfile", str(out)]
        converter_env = {**os.environ, "PYTHONPATH": str(src / "gguf-py")}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=converter_env)
        if proc.returncode != 0:
            raise RuntimeError(f"convert_hf_to_gguf.py failed on {checkpoint}:\n{proc.stderr[-2000:]}")
    else:
        idle_call("convert_random", str(checkpoint), str(out), str(src))
    return out


def convert_random(checkpoint: str, out: str, src: str) -> None:
    from tools.bench.gguf_peer import convert

    convert(Path(checkpoint), Path(out), Path(src))


def quantized_gguf(model: str, type_name: str, cache: Path, src: Path, threads: int) -> Path:
    """`model` quantized to `type_name` by llama.cpp's llama_model_quantize, llama-quantize's defaults (made once)."""
    out = cache / f"{model}-{type_name}.gguf"
    if out.is_file():
        return out
    source = float_gguf(model, cache, src)
    log(f"quantizing {source} -> {out}")
    partial = out.with_suffix(".partial")
    idle_call("quantize", str(source), str(partial), type_name, str(threads))
    partial.rename(out)
    return out


def quantize(source: str, out: str, type_name: str, threads: str) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{type_name}")
    params.nthread = int(threads)
    with _quiet_stderr():  # llama.cpp prints every tensor
        code = llama_cpp.llama_model_quantize(source.encode(), out.encode(), params)
    if code != 0:
        raise RuntimeError(f"llama_model_quantize({source}, {type_name}) returned {code}")


@contextmanager
def _quiet_stderr():
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def tensor_mix(gguf: Path) -> str:
    """The file's quantized tensor types by count, e.g. "Q4_K 97, Q6_K 19, Q5_0 7"."""
    from gguf import GGUFReader

    counts = Counter(t.tensor_type.name for t in GGUFReader(str(gguf)).tensors if t.tensor_type.name != "F32")
    return ", ".join(f"{name} {n}" for name, n in counts.most_common())


# -- our engines and the measurements ----------------------------------------------------------------------------
def recipe_text(gguf: Path, out: Path, model: str, level: str) -> str:
    """engine-build's recipe for `gguf`: float32 CPU, batch 8 x 1024; `auto` the README recipe's quantization as
    written there (the kernel choice's budget, the re-blocked kinds) with verification on (the README recipe's for
    the SmolLM2 files, the defaults for random weights), an explicit level unverified."""
    quantization, verify = f"{{mode: none, accuracy_level: {level}}}", "{enabled: off}"
    if level == "auto":
        quantization = readme_setting("quantization")
        verify = readme_setting("verify") if model == "smollm2" else "{enabled: on}"
    return (f"model: {gguf.resolve()}\nout: {out.resolve()}\n"
            "target: {backend: onnxruntime, device: cpu, dtype: float32}\n"
            f"limits: {{max_batch_size: 8, max_seq_len: 1024}}\nquantization: {quantization}\nverify: {verify}\n")


def readme_setting(key: str) -> str:
    """The README recipe's top-level `key:` setting, as written there."""
    line = next(x for x in README_RECIPE.read_text().splitlines() if x.startswith(f"{key}:"))
    return line.partition(":")[2].strip()


def engine(gguf: Path, model: str, level: str, rebuild: bool) -> Path:
    """Our engine built from `gguf` (recipe_text), at idle priority, cached by recipe."""
    out = gguf.with_suffix(".engine")
    recipe = recipe_text(gguf, out, model, level)
    recipe_file = gguf.with_suffix(".recipe.yaml")
    if not rebuild and (out / "model.onnx").is_file() and recipe_file.is_file() and recipe_file.read_text() == recipe:
        return out
    recipe_file.write_text(recipe)
    log(f"building {out}")
    _run([*IDLE, sys.executable, "-m", "builder.cli", "--recipe", str(recipe_file)])
    return out


def race(gguf: Path, engine_dir: Path, rounds: int, threads: int, fresh: bool) -> dict:
    """tools.bench.llama_cpp_peer on the file, under the bench lock (cached JSON)."""
    out = gguf.with_suffix(".race.json")
    if fresh or not out.is_file():
        log(f"racing {gguf.name}")
        _run(["flock", LOCK, sys.executable, "-m", "tools.bench.llama_cpp_peer", "--gguf", str(gguf), "--engine",
              str(engine_dir), "--rounds", str(rounds), "--threads", str(threads), "--new-tokens", "32",
              "--out", str(out)])
    return json.loads(out.read_text())


def perplexity(gguf: Path, engine_dir: Path, tokens: int, threads: int, fresh: bool) -> dict:
    """tools.bench.gguf_perplexity --peer on the file: ours and llama.cpp on the same windows (cached JSON)."""
    out = gguf.with_suffix(".ppl.json")
    if fresh or not out.is_file():
        log(f"scoring {gguf.name}")
        _run([*IDLE, sys.executable, "-m", "tools.bench.gguf_perplexity", "--gguf", str(gguf), "--engine",
              f"ours={engine_dir}", "--peer", "--max-tokens", str(tokens), "--threads", str(threads),
              "--out", str(out)])
    return json.loads(out.read_text())


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


# -- the table ---------------------------------------------------------------------------------------------------
def row(model: str, type_name: str, gguf: Path, raced: dict, scored: dict | None) -> dict:
    results = raced["results"]
    ratio = {k: results["ours"][k]["median"] / results["llama.cpp"][k]["median"] for k in results["ours"]}
    entry = {"model": model, "type": type_name, "tensors": tensor_mix(gguf), "ratio": ratio, "results": results,
             "load_average": raced["environment"]["load_average"],
             "load_average_before": raced.get("load_average_before"),
             "greedy_16": raced["greedy_check_identical_of_16"]}
    if scored:
        r = scored["results"]
        entry["perplexity"] = {n: r[n]["perplexity"] for n in ("transformers", "ours", "llama.cpp")}
        entry["top1"] = {n: r[n]["top1_agreement"] for n in ("ours", "llama.cpp")}
        entry["vs_llama_cpp"], entry["vs_llama_cpp_95"] = r["ours"]["vs_llama_cpp"], r["ours"]["vs_llama_cpp_95"]
        entry["top1_vs_llama_cpp"], entry["top1_vs_llama_cpp_se"] = (r["ours"]["top1_vs_llama_cpp"],
                                                                     r["ours"]["top1_vs_llama_cpp_se"])
        entry["scored_tokens"] = scored["scored_tokens"]
    return entry


def markdown(rows: list[dict]) -> str:
    """One table: tok/s ours / llama.cpp (ratio) per measurement, greedy tokens identical, perplexity ours against
    llama.cpp's and top-1 agreement with transformers (ours - llama.cpp's ± one paired standard error)."""
    lines = ["| file | quantized tensors | decode batch 1 | decode batch 8 | prefill 512 | greedy 16 | perplexity: "
             "ours / llama.cpp's | top-1 vs transformers: ours / llama.cpp's | load (1 min) before / after race |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = []
        for key in ("decode_b1", "decode_b8", "prefill_512"):
            o, p = r["results"]["ours"][key]["median"], r["results"]["llama.cpp"][key]["median"]
            cells.append(f"{o:.1f} / {p:.1f} = **{o / p:.2f}x**")
        ppl = top1 = "-"
        if "perplexity" in r:
            ppl = (f"{r['perplexity']['ours']:.3f} / {r['perplexity']['llama.cpp']:.3f}: **{r['vs_llama_cpp']:+.2%}** "
                   f"± {r['vs_llama_cpp_95']:.2%} ({r.get('scored_tokens', '?')} tokens)")
            top1 = (f"{r['top1']['ours']:.4f} / {r['top1']['llama.cpp']:.4f}: **{r['top1_vs_llama_cpp']:+.4f}** "
                    f"± {r['top1_vs_llama_cpp_se']:.4f}")
        before = "?" if r.get("load_average_before") is None else f"{r['load_average_before'][0]:.1f}"
        lines.append(f"| {r['model']} {r['type']} | {r['tensors']} | {' | '.join(cells)} | {r['greedy_16']}/16 | "
                     f"{ppl} | {top1} | {before} / {r['load_average'][0]:.1f} |")
    return "\n".join(lines)


def _names(text: str, allowed: tuple[str, ...], what: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [n for n in names if n not in allowed]
    if unknown or not names:
        raise click.BadParameter(f"{what} {unknown or text!r}: choose from {', '.join(allowed)}")
    return names


@click.command()
@click.option("--models", default=",".join(MODELS), show_default=True)
@click.option("--types", "types", default=",".join(TYPES), show_default=True)
@click.option("--cache", type=click.Path(file_okay=False, path_type=Path), default=Path("checkpoints/random/gguf_set"),
              show_default=True, help="Where the checkpoints, GGUF files, engines and results live.")
@click.option("--rounds", default=3, show_default=True)
@click.option("--threads", default=2, show_default=True)
@click.option("--ppl-tokens", default=4096, show_default=True,
              help="Tokens of prose scored per SmolLM2 file; 0: race only, score none (a later run scores them).")
@click.option("--accuracy-level", default="auto", show_default=True,
              help="The engines' quantization.accuracy_level: auto (the README recipe's), a level, or a YAML map "
                   "per layer kind.")
@click.option("--fresh", is_flag=True, help="Measure again even where a result is cached.")
@click.option("--rebuild", is_flag=True, help="Rebuild our engines too (implies --fresh).")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None, help="All rows as JSON.")
def main(models: str, types: str, cache: Path, rounds: int, threads: int, ppl_tokens: int, accuracy_level: str,
         fresh: bool, rebuild: bool, out: Path | None) -> None:
    """Make the files, build our engines, race and score each; print one markdown table."""
    from tools.bench.gguf_peer import find_source, llama_cpp_version

    model_names, type_names = _names(models, MODELS, "model"), _names(types, TYPES, "type")
    if (version := llama_cpp_version()) is None:
        raise click.UsageError("llama-cpp-python is not importable: put its build on PYTHONPATH (the `peer` extra)")
    src = find_source(version)
    cache.mkdir(parents=True, exist_ok=True)
    rows = []
    for model in model_names:
        for type_name in type_names:
            gguf = quantized_gguf(model, type_name, cache, src, threads)
            built = engine(gguf, model, accuracy_level, rebuild)
            raced = race(gguf, built, rounds, threads, fresh or rebuild)
            score = model == "smollm2" and ppl_tokens > 0
            scored = perplexity(gguf, built, ppl_tokens, SCORE_THREADS, fresh or rebuild) if score else None
            rows.append(row(model, type_name, gguf, raced, scored))
            log(markdown(rows[-1:]).splitlines()[-1])
    click.echo(f"{env.machine()}; llama.cpp {version}; accuracy_level {accuracy_level}; {rounds} rounds")
    click.echo(markdown(rows))
    if out:
        out.write_text(json.dumps({"environment": env.environment(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
