"""engine-run: generate text with a prebuilt engine directory."""
from __future__ import annotations

import dataclasses
import sys

import click

from runtime.interrupt import exit_on_interrupt
from runtime.request.params import SamplingParams

USAGE_ERROR, FAILED = 2, 1  # exit codes: a request or engine this run cannot use; generation that failed


def sampling_options(command):
    """One click option per SamplingParams field, typed from the field's default."""
    for f in reversed(dataclasses.fields(SamplingParams)):
        flag = "--" + f.name.replace("_", "-")
        if f.name == "stop":
            command = click.option(flag, multiple=True, help="Stop string (repeatable).")(command)
        elif isinstance(f.default, bool):
            command = click.option(flag, is_flag=True, default=f.default)(command)
        else:
            kind = int if f.name == "seed" else type(f.default)
            command = click.option(flag, type=kind, default=f.default, show_default=True)(command)
    return command


def kv_memory_options(command):
    """--kv-memory-mb, --block-size and --prefix-caching/--no-prefix-caching: how KV memory is charged (LLM's
    kv_memory_mb, block_size, prefix_caching; engine-run, engine-serve)."""
    command = click.option("--prefix-caching/--no-prefix-caching", default=True, show_default=True,
                           help="Keep finished sequences' full KV blocks and reuse them for prompts that start "
                                "the same.")(command)
    command = click.option("--block-size", type=click.IntRange(1), default=16, show_default=True,
                           help="Tokens per KV block, the unit the KV memory budget is charged in.")(command)
    return click.option("--kv-memory-mb", type=click.FloatRange(0, min_open=True), default=None,
                        help="KV memory budget in MB (default: the engine's built budget, else every row's "
                             "max_seq_len).")(command)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--engine", "engine_dir", type=click.Path(exists=True, file_okay=False), required=True,
              help="Engine directory written by engine-build.")
@click.option("--prompt", default=None, help="Prompt text (default: read from stdin).")
@click.option("--stream", is_flag=True, help="Print text as it is generated.")
@click.option("--chat", is_flag=True, help="Wrap the prompt in the checkpoint's chat template.")
@click.option("--max-seq-len", type=int, default=None, help="KV length per sequence (default: the engine's).")
@click.option("--threads", type=int, default=None, help="ONNX Runtime intra-op threads.")
@click.option("--speculate", type=click.Choice(["none", "ngram", "draft"]), default="none", show_default=True,
              help="Speculative decoding: prompt lookup (ngram) or the draft engine (draft).")
@click.option("--num-draft", type=int, default=4, show_default=True, help="Initial draft length (adapts).")
@click.option("--draft", "draft_dir", type=click.Path(exists=True, file_okay=False), default=None,
              help="Draft engine directory (default: the engine's own draft/ when it has one).")
@click.option("--process-thread-pool", is_flag=True,
              help="Run the engine and its draft on one ONNX Runtime thread pool for the process (faster with a "
                   "draft: the two take turns on the same cores).")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default=None,
              help="Where to run (default: the device the engine was built for).")
@click.option("--stats", is_flag=True, help="Print timing, tokens/s and speculation statistics to stderr.")
@kv_memory_options
@sampling_options
def main(engine_dir: str, prompt: str | None, stream: bool, chat: bool, max_seq_len: int | None,
         threads: int | None, speculate: str, num_draft: int, draft_dir: str | None, process_thread_pool: bool,
         device: str | None, stats: bool, kv_memory_mb: float | None, block_size: int, prefix_caching: bool,
         **sampling) -> None:
    """Generate a completion (greedy when --temperature is 0). Exit 0 on success, 1 when generation failed,
    2 for unusable input (engine, prompt, options), 130 when interrupted (the output so far is printed)."""
    with exit_on_interrupt("engine-run") as on_interrupt:
        from runtime.request.chat import ChatTemplateError  # imported here: a Ctrl-C during imports exits cleanly too
        from runtime.engine import LLM, RequestError
        from runtime.manifest.load import EngineError
        from runtime.speculation.speculator import Speculation

        try:
            text = prompt if prompt is not None else _read_stdin()
            params = SamplingParams(**sampling)
            speculation = None if speculate == "none" else Speculation(speculate, num_draft=num_draft,
                                                                        max_draft=max(8, num_draft))
            llm = LLM(engine_dir, max_batch_size=1, max_seq_len=max_seq_len, threads=threads, draft=draft_dir,
                      process_thread_pool=process_thread_pool, device=device, kv_memory_mb=kv_memory_mb,
                      block_size=block_size, prefix_caching=prefix_caching)
            if chat:
                text = llm.apply_chat_template([{"role": "user", "content": text}])
            handle = llm.submit(text, params, speculation)
        except (EngineError, RequestError, ChatTemplateError, ValueError) as err:
            _fail(err, USAGE_ERROR)
        if not stream:
            on_interrupt.append(lambda: click.echo(handle.seq.text))  # the partial completion
        for delta in handle.text_stream() if stream else ():
            click.echo(delta, nl=False)
        result = handle.result()
        click.echo("" if stream else result.text)
        if stats:
            _print_stats(result.metrics)
        llm.close()
        if result.finish_reason == "error":
            _fail(f"generation failed after {len(result.token_ids)} tokens: {result.error}", FAILED)


def _read_stdin() -> str:
    data = sys.stdin.buffer.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"the prompt on stdin is not UTF-8 text (byte {err.start}: {data[err.start:err.start + 1]!r}); "
                         f"give UTF-8 text or --prompt") from None


def _fail(err: object, code: int) -> None:
    click.echo(f"engine-run: error: {err}", err=True)
    sys.exit(code)


def _print_stats(m: dict) -> None:
    decode = (m["output_tokens"] - 1) / (m["latency_s"] - m["ttft_s"]) if m["output_tokens"] > 1 else 0.0
    line = (f"prompt {m['prompt_tokens']} tokens, generated {m['output_tokens']}, time to first token "
            f"{m['ttft_s'] * 1e3:.1f} ms, decode {decode:.1f} tokens/s")
    spec = m.get("speculation")
    if spec:
        line += (f", speculation {spec['method']}: drafted {spec['drafted']}, accepted {spec['accepted']} "
                 f"({spec['acceptance_rate']:.0%})")
    click.echo(line, err=True)


if __name__ == "__main__":
    main()
