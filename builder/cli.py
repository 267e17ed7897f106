"""engine-build: build an engine directory from a recipe."""
from __future__ import annotations

import sys

import click

from builder.build import BuildError, build_engine
from builder.pass_manager import PassError
from builder.recipe import RecipeError, load_recipe
from builder.spec import SpecError, families_table
from builder.weights import CheckpointError


def _list_families(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if value:
        click.echo(families_table())
        ctx.exit()


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--list-families", is_flag=True, expose_value=False, is_eager=True, callback=_list_families,
              help="Print the supported model families (model_specs/) with their features, and exit.")
@click.option("--recipe", "recipe_path", type=click.Path(exists=True, dir_okay=False), required=True,
              help="YAML build recipe (see build_recipes/).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a recipe field, e.g. --set limits.max_seq_len=1024 (repeatable).")
@click.option("--out", type=click.Path(file_okay=False), default=None, help="Engine directory (default: recipe.out).")
@click.option("--dump-ir", type=click.Path(file_okay=False), default=None,
              help="Write the IR text before and after each phase into this directory.")
@click.option("--verify/--no-verify", default=None,
              help="Compare with transformers (default: recipe.verify.enabled, auto = small models).")
def main(recipe_path: str, overrides: tuple[str, ...], out: str | None, dump_ir: str | None,
         verify: bool | None) -> None:
    """Build an ONNX engine from a local Hugging Face checkpoint, as the recipe describes."""
    extra = list(overrides) + ([] if verify is None else [f"verify.enabled={'on' if verify else 'off'}"])
    try:
        recipe = load_recipe(recipe_path, extra)
        path = build_engine(recipe, out, dump_ir, log=click.echo)
    except (RecipeError, SpecError, CheckpointError, BuildError, PassError) as err:
        click.echo(f"engine-build: error: {err}", err=True)
        sys.exit(2)
    click.echo(f"engine written to {path}")


if __name__ == "__main__":
    main()
