"""engine-build: build an engine directory from a recipe."""
from __future__ import annotations

import sys

import click

from runtime.interrupt import exit_on_interrupt

USAGE_ERROR, FAILED = 2, 1  # input that cannot be used / a build that failed; nothing was written or deleted


def _list_families(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if value:
        from builder.spec import families_table

        click.echo(families_table())
        ctx.exit()


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--list-families", is_flag=True, expose_value=False, is_eager=True, callback=_list_families,
              help="Print the supported model families (model_specs/) with their features, and exit.")
@click.option("--recipe", "recipe_path", type=click.Path(exists=True, dir_okay=False), required=True,
              help="YAML build recipe (see build_recipes/).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a recipe field, e.g. --set limits.max_seq_len=1024 (repeatable).")
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="Engine directory (default: recipe.out); must be new, empty or an engine built before.")
@click.option("--dump-ir", type=click.Path(file_okay=False), default=None,
              help="Write the IR text before and after each phase into this directory.")
@click.option("--verify/--no-verify", default=None,
              help="Compare with transformers (default: recipe.verify.enabled, auto = small models).")
def main(recipe_path: str, overrides: tuple[str, ...], out: str | None, dump_ir: str | None,
         verify: bool | None) -> None:
    """Build an ONNX engine from a local Hugging Face checkpoint, as the recipe describes.
    Exit 0 when the engine is written, 1 when the build failed, 2 for unusable input, 130 when interrupted
    (the partial folder is removed; an engine already at the output path is left as it was)."""
    with exit_on_interrupt("engine-build") as on_interrupt:
        from builder.output_dir import discard_all_partials  # heavy imports after the handler is in place

        on_interrupt.append(discard_all_partials)
        _build(recipe_path, overrides, out, dump_ir, verify)


def _build(recipe_path, overrides, out, dump_ir, verify) -> None:
    from builder.build import BuildError, VerificationFailed, build_engine
    from builder.output_dir import OutputError
    from builder.pass_manager import PassError
    from builder.recipe import RecipeError, load_recipe
    from builder.spec import SpecError
    from builder.weights import CheckpointError

    extra = list(overrides) + ([] if verify is None else [f"verify.enabled={'on' if verify else 'off'}"])
    try:
        recipe = load_recipe(recipe_path, extra)
        path = build_engine(recipe, out, dump_ir, log=_log)
    except VerificationFailed as err:
        click.echo(f"engine-build: error: {err}", err=True)
        sys.exit(FAILED)
    except (RecipeError, SpecError, CheckpointError, BuildError, PassError, OutputError) as err:
        click.echo(f"engine-build: error: {err}", err=True)
        sys.exit(USAGE_ERROR)
    click.echo(f"engine written to {path}", err=True)  # stdout stays empty: a chained engine-run's text alone


def _log(line: str) -> None:
    """The build's progress (trace, passes, verification) and its result line on stderr, so a chained
    `engine-run`'s generated text is all of stdout."""
    click.echo(line, err=True)


if __name__ == "__main__":
    main()
