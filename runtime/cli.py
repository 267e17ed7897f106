"""engine-run: generate text with a prebuilt engine directory."""
from __future__ import annotations

import dataclasses
import io
import os
import re
import sys
import typing
from pathlib import Path

import click

from runtime.config import LoadConfig
from runtime.interrupt import exit_on_interrupt
from runtime.request.params import SamplingParams

USAGE_ERROR, FAILED = 2, 1  # exit codes: a request or engine this run cannot use; generation that failed


_SAMPLING_HELP = {"logprobs": "Print each generated token's log-probability and this many alternatives (0-20) to stderr.",
                  "prompt_logprobs": "Print each prompt token's log-probability and this many alternatives (0-20) to stderr."}


def sampling_options(command):
    """One click option per SamplingParams field, typed from the field's default."""
    for f in reversed(dataclasses.fields(SamplingParams)):
        flag = "--" + f.name.replace("_", "-")
        if f.name == "structured":  # an object: --json-schema FILE makes one
            command = click.option("--json-schema", "structured", default=None, callback=_json_schema,
                                   type=click.Path(exists=True, dir_okay=False, path_type=Path),
                                   help="Constrain the output to this JSON schema (a file), see docs/SERVING.md.")(command)
        elif f.name == "adapter":  # a name: --adapter NAME=PATH loads it, --use-adapter NAME runs on it
            command = click.option("--use-adapter", "adapter", default=None, metavar="NAME",
                                   help="Run the request on this LoRA adapter (loaded with --adapter NAME=PATH); "
                                        "default: the base model.")(command)
        elif f.name == "stop":
            command = click.option(flag, multiple=True, callback=_unescape,
                                   help=r"Stop string (repeatable); \n, \t and \\ are escapes, so --stop '\n\n' "
                                        "stops at a blank line.")(command)
        elif isinstance(f.default, bool):
            command = click.option(flag, is_flag=True, default=f.default)(command)
        else:
            kind = int if f.default is None else type(f.default)  # seed, logprobs, prompt_logprobs: None or an int
            command = click.option(flag, type=kind, default=f.default, show_default=True,
                                   help=_SAMPLING_HELP.get(f.name))(command)
    return command


def _json_schema(ctx: click.Context, param: click.Parameter, path: Path | None):
    from runtime.request.structured import StructuredOutput

    return None if path is None else StructuredOutput.json(path.read_text())


def _unescape(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> tuple[str, ...]:
    """A shell passes "\\n" as a backslash and an n: read \\n, \\t and \\\\ as the characters they name."""
    table = {"n": "\n", "t": "\t", "\\": "\\"}
    return tuple(re.sub(r"\\([nt\\])", lambda m: table[m.group(1)], v) for v in values)


def option_spec(config: type, name: str) -> tuple[str, dict]:
    """The click flag and option arguments for one field of a frozen config (LoadConfig, ExecutorConfig):
    the flag from the name (`--x/--no-x` for a bool that is on or unset by default), the type from the
    annotation and the field's hints (`choices`, `directory`, `minimum`), default and help from the field."""
    f = next(f for f in dataclasses.fields(config) if f.name == name)
    hint = typing.get_type_hints(config)[name]
    kind = next((a for a in typing.get_args(hint) if a is not type(None)), hint)
    flag, meta = "--" + name.replace("_", "-"), f.metadata
    spec = {"default": f.default, "help": meta.get("help", ""), "show_default": f.default is not None}
    if kind is bool:
        return (flag, {**spec, "is_flag": True}) if f.default is False else (f"{flag}/--no-{flag[2:]}", spec)
    if "choices" in meta:
        return flag, {**spec, "type": click.Choice(meta["choices"])}
    if meta.get("directory"):
        return flag, {**spec, "type": click.Path(exists=True, file_okay=False, path_type=Path)}
    return flag, {**spec, "type": click.IntRange(meta["minimum"]) if "minimum" in meta else kind}


def config_options(config: type, names: typing.Iterable[str], help: dict[str, str] | None = None):
    """One click option per named field of `config` (option_spec); `help` replaces a field's help text."""
    def decorate(command):
        for name in reversed(list(names)):
            flag, spec = option_spec(config, name)
            command = click.option(flag, name, **{**spec, "help": (help or {}).get(name, spec["help"])})(command)
        return command
    return decorate


def pick(config: type, options: dict):
    """`config` made from the entries of `options` that are its fields (removed from `options`)."""
    return config(**{f.name: options.pop(f.name) for f in dataclasses.fields(config) if f.name in options})


KV_MEMORY_OPTIONS = ["kv_memory_mb", "block_size", "prefix_caching"]  # how KV memory is charged (engine-serve too)
# engine-run serves one request: one KV slot
RUN_LOAD_OPTIONS = [f.name for f in dataclasses.fields(LoadConfig) if f.name != "max_batch_size"]


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--engine", "engine_dir", type=click.Path(exists=True, file_okay=False), required=True,
              help="Engine directory written by engine-build.")
@click.option("--prompt", default=None, help="Prompt text (default: read from stdin).")
@click.option("--stream", is_flag=True, help="Print text as it is generated.")
@click.option("--chat", is_flag=True, help="Wrap the prompt in the checkpoint's chat template.")
@click.option("--speculate", type=click.Choice(["none", "ngram", "draft", "eagle"]), default="none", show_default=True,
              help="Speculative decoding: prompt lookup (ngram), the draft engine (draft) or the engine's EAGLE head "
                   "(eagle). Greedy output is plain decoding's until a draft is accepted; after one, a near-tie may "
                   "go the other way (a verify call rounds unlike a one-token step; docs/ACCURACY.md).")
@click.option("--num-draft", type=int, default=4, show_default=True, help="Initial draft length (adapts).")
@click.option("--stats", is_flag=True, help="Print timing, tokens/s and speculation statistics to stderr.")
@click.option("--echo/--no-echo", default=True, show_default=True,
              help="Print the prompt to stderr before the completion (not with --chat): the terminal shows the "
                   "whole text, stdout carries only what was generated.")
@click.option("--adapter", "adapters", multiple=True, metavar="NAME=PATH",
              help="Load a LoRA adapter (a PEFT directory) as NAME (repeatable); --use-adapter NAME runs on it.")
@config_options(LoadConfig, RUN_LOAD_OPTIONS)
@sampling_options
def main(engine_dir: str, prompt: str | None, stream: bool, chat: bool, speculate: str, num_draft: int, stats: bool,
         echo: bool, adapters: tuple[str, ...], **options) -> None:
    """Generate a completion (greedy when --temperature is 0). Exit 0 on success, 1 when generation failed,
    2 for unusable input (engine, prompt, options), 130 when interrupted (the output so far is printed)."""
    with exit_on_interrupt("engine-run") as on_interrupt:
        from jinja2 import TemplateError  # imported here: a Ctrl-C during imports exits cleanly too
        from runtime.request.chat import ChatTemplateError
        from runtime.engine import LLM, RequestError
        from runtime.manifest.load import EngineError
        from runtime.speculation.speculator import Speculation

        try:
            text = prompt if prompt is not None else _read_stdin()
            load = pick(LoadConfig, options)
            params = SamplingParams(**options)  # what is left: the sampling options
            speculation = None if speculate == "none" else Speculation(speculate, num_draft=num_draft,
                                                                        max_draft=max(8, num_draft))
            llm = LLM(engine_dir, dataclasses.replace(load, max_batch_size=1), adapters=_adapter_paths(adapters))
            if chat:
                text = llm.chat_prompt_ids([{"role": "user", "content": text}])
            handle = llm.submit(text, params, speculation)
        except (EngineError, RequestError, ChatTemplateError, TemplateError, ValueError) as err:
            _fail(err, USAGE_ERROR)
        if echo and not chat:
            click.echo(text, err=True, nl=False)
        if not stream:
            on_interrupt.append(lambda: click.echo(handle.seq.text))  # the partial completion
        for delta in handle.text_stream() if stream else ():
            click.echo(delta, nl=False)
        result = handle.result()
        click.echo("" if stream else result.text)
        more = stats or result.logprobs is not None or result.prompt_logprobs is not None or result.finish_reason == "error"
        if echo and not chat and not text.endswith("\n") and more:
            _end_echo_line()
        for title, ids, entries in (("prompt", handle.seq.prompt_ids, result.prompt_logprobs),
                                    ("generated", result.token_ids, result.logprobs)):
            if entries is not None:
                _print_logprobs(llm.tokenizer, title, ids, entries)
        if stats:
            _print_stats(result.metrics)
        llm.close()
        if result.finish_reason == "error":
            _fail(f"generation failed after {len(result.token_ids)} tokens: {result.error}", FAILED)


def _end_echo_line() -> None:
    """End the prompt echo's line on stderr where stdout went elsewhere (`> out.txt`): the completion's newline
    ended it on a terminal that shows both, not there, and the stats line would run onto the prompt."""
    try:
        same = os.path.samestat(os.fstat(sys.stdout.fileno()), os.fstat(sys.stderr.fileno()))
    except (OSError, ValueError, io.UnsupportedOperation):  # not files (a test's captured streams)
        same = False
    if not same:
        click.echo("", err=True)


def _adapter_paths(values: tuple[str, ...]) -> dict[str, str]:
    """--adapter NAME=PATH values as LLM's `adapters`; a value without `=`, or a name given twice, is refused."""
    adapters: dict[str, str] = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--adapter {value!r}: expected NAME=PATH (a PEFT LoRA directory)")
        if name in adapters:
            raise ValueError(f"--adapter {name}: given twice")
        adapters[name] = path
    return adapters


def _read_stdin() -> str:
    if sys.stdin.isatty():  # a terminal would otherwise wait with no sign of why
        click.echo("engine-run: no --prompt given: reading the prompt from stdin (end it with Ctrl-D)", err=True)
    data = sys.stdin.buffer.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"the prompt on stdin is not UTF-8 text (byte {err.start}: {data[err.start:err.start + 1]!r}); "
                         f"give UTF-8 text or --prompt") from None


def _fail(err: object, code: int) -> None:
    click.echo(f"engine-run: error: {cli_voice(str(err))}", err=True)
    sys.exit(code)


# The runtime's errors name Python arguments (LLM(draft=...), SamplingParams(max_new_tokens=...)); engine-run's
# user sets them as flags, so its errors say the flag (#23: each surface speaks its own language).
_PHRASES = {"load with draft=DIR or serve with --draft DIR": "pass --draft DIR", "device='cpu'": "--device cpu",
            "load the engine with a larger max_seq_len": "pass a larger --max-seq-len",
            "set overlap=True, or lookahead=1": "pass --overlap, or --lookahead 1"}
_ARGUMENTS = re.compile(r"(?<![.\w-])(" + "|".join(  # names with an underscore: words like "draft" stay words
    f.name for c in (SamplingParams, LoadConfig) for f in dataclasses.fields(c) if "_" in f.name) + r")\b")


def cli_voice(message: str) -> str:
    """`message` with Python argument names and advice rewritten as engine-run's flags."""
    for python, flag in _PHRASES.items():
        message = message.replace(python, flag)
    return _ARGUMENTS.sub(lambda m: "--" + m.group(1).replace("_", "-"), message)


def _print_logprobs(tokenizer, title: str, ids: list[int], entries: list) -> None:
    """One stderr line per token: its text, log-probability and the alternatives asked for."""
    click.echo(f"{title} tokens: token, logprob, most likely alternatives", err=True)
    text = lambda t: repr(tokenizer.decode([t], skip_special_tokens=False))  # noqa: E731
    for token, entry in zip(ids, entries):
        if entry is None:
            click.echo(f"  {text(token)}	-", err=True)
            continue
        top = " ".join(f"{text(t)}={lp:.4f}" for t, lp in entry.top)
        click.echo(f"  {text(token)}	{entry.logprob:.4f}	{top}", err=True)


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
    from runtime.parallel.launch import stage_rank_runs

    stage_rank_runs(sys.argv[1:], named=False)  # under torchrun, a stage rank serves its stage instead
    main()
