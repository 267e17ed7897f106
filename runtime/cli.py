"""engine-run: generate text with a prebuilt engine directory."""
from __future__ import annotations

import dataclasses
import sys

import click

from runtime.chat import ChatTemplateError
from runtime.engine import LLM, RequestError
from runtime.manifest import EngineError
from runtime.params import SamplingParams


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


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--engine", "engine_dir", type=click.Path(exists=True, file_okay=False), required=True,
              help="Engine directory written by engine-build.")
@click.option("--prompt", default=None, help="Prompt text (default: read from stdin).")
@click.option("--stream", is_flag=True, help="Print text as it is generated.")
@click.option("--chat", is_flag=True, help="Wrap the prompt in the checkpoint's chat template.")
@click.option("--max-seq-len", type=int, default=None, help="KV length per sequence (default: the engine's).")
@click.option("--threads", type=int, default=None, help="ONNX Runtime intra-op threads.")
@sampling_options
def main(engine_dir: str, prompt: str | None, stream: bool, chat: bool, max_seq_len: int | None,
         threads: int | None, **sampling) -> None:
    """Generate a completion (greedy when --temperature is 0)."""
    text = prompt if prompt is not None else sys.stdin.read()
    try:
        params = SamplingParams(**sampling)
        llm = LLM(engine_dir, max_batch_size=1, max_seq_len=max_seq_len, threads=threads)
        if chat:
            text = llm.apply_chat_template([{"role": "user", "content": text}])
        if stream:
            for delta in llm.stream(text, params):
                click.echo(delta, nl=False)
            click.echo()
        else:
            click.echo(llm.generate([text], params)[0].text)
    except (EngineError, RequestError, ChatTemplateError, ValueError) as err:
        click.echo(f"engine-run: error: {err}", err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
