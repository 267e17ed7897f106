"""Build a tensor-parallel engine: for each rank, trace, run the pipeline with that rank's
`shard_tensor_parallel`, and write the rank's segments (builder.segments), streaming its share of each
weight. One manifest lists the ranks, their segments and the collectives between them."""
from __future__ import annotations

import time
from pathlib import Path

from builder.engine_dir import BuildError, build_manifest, copy_tokenizer, weight_progress, write_manifest
from builder.pass_manager import PassManager
from builder.pipeline import pipeline
from builder.recipe import Recipe
from builder.segments import write_rank
from builder.trace import trace
from runtime.manifest.types import IO, TensorParallel, TensorParallelRank


def build_tensor_parallel(tmp: Path, recipe: Recipe, model_dir: Path, dump_ir, log) -> None:
    """Write a `recipe.parallel.tensor_parallel`-way engine into `tmp` (builder/build.py calls it)."""
    tp = recipe.parallel.tensor_parallel
    if recipe.speculative.enabled:
        raise BuildError("speculative: a draft engine inside a tensor_parallel > 1 engine is not supported; "
                         "build the draft on its own and load it with LLM(engine, draft=DIR)")
    if recipe.verify.enabled == "on":
        raise BuildError("verify.enabled on is not supported with tensor_parallel > 1 (the build-time check "
                         "runs one whole engine); use auto or off and check the engine with its tests")
    start = time.perf_counter()
    ranks, first = [], None
    for rank in range(tp):
        graph = trace(model_dir)
        params = graph.num_parameters()
        manager = PassManager(pipeline(recipe, rank), Path(dump_ir) / f"rank{rank}" if dump_ir else None)
        graph = manager.run(graph)
        log(f"rank {rank}/{tp}: {len(graph.nodes)} nodes after the pipeline")
        segments, collectives = write_rank(graph, tmp, rank, recipe.target.dtype, weight_progress(graph, log))
        ranks.append(TensorParallelRank(rank=rank, segments=tuple(segments)))
        first = first or (graph, params, manager, collectives)
    graph, params, manager, collectives = first
    copy_tokenizer(model_dir, tmp)
    io = IO({v.name: {"dtype": v.dtype, "shape": list(v.shape)} for v in graph.inputs},
            {v.name: {"dtype": "float32", "shape": list(v.shape)} for v in graph.outputs})
    manifest = build_manifest(graph, params, recipe, model_dir, io, manager, time.perf_counter() - start)
    section = TensorParallel(size=tp, ranks=tuple(ranks), collectives=tuple(collectives),
                             replicated=("embedding", "lm_head (run by rank 0 only)"))
    write_manifest(tmp, manifest.replace(tensor_parallel=section, verification={
        "skipped": "tensor_parallel > 1: the build-time check is not run on sharded engines"}))
    log(f"verify: skipped for a tensor_parallel {tp} engine (tests compare sharded engines with transformers)")
    log(f"built {tp} ranks in {time.perf_counter() - start:.1f} s")
