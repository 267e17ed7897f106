"""The build-time check of a bfloat16 engine on a machine that cannot run it (ONNX Runtime's CPU
execution provider has no bfloat16 kernels for this graph): the same optimized IR is lowered once more
as a float32 twin whose float weights are rounded to bfloat16, run on the CPU, and compared with
transformers holding the same rounded weights. This checks the lowering and the weight layout of the
engine, not bfloat16 arithmetic; the manifest's verification record says so."""
from __future__ import annotations

import dataclasses
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from builder.ir import Graph
from builder.lower_onnx import lower_to_onnx
from builder.recipe import Verify
from builder.reference_check import check_engine
from builder.weights import CheckpointTensor, Concat, WeightSource
from runtime.manifest.load import Manifest

WHAT_IS_CHECKED = ("a float32 twin of the bfloat16 engine (its IR lowered again with every float weight rounded "
                   "to bfloat16) on the CPU, against transformers with the same rounded weights: checks the "
                   "lowering and the weight layout, not bfloat16 arithmetic")


def round_to_bfloat16(array: np.ndarray) -> np.ndarray:
    import ml_dtypes

    return array.astype(ml_dtypes.bfloat16).astype(np.float32)


@dataclass(eq=False)
class Bfloat16Rounded(WeightSource):
    """`source` rounded to bfloat16 and held as float32."""

    source: WeightSource

    def __post_init__(self) -> None:
        self.shape, self.dtype = tuple(self.source.shape), "float32"

    def materialize(self) -> np.ndarray:
        return round_to_bfloat16(np.asarray(self.source.materialize(), dtype=np.float32))

    def __str__(self) -> str:
        return f"bf16({self.source})"


def twin_graph(graph: Graph) -> Graph:
    """The same IR with every float weight rounded to bfloat16 (quantized uint8 parts unchanged)."""
    twin = graph.copy()
    twin.weights = {name: Bfloat16Rounded(source) if source.dtype.startswith("float")
                    else source for name, source in graph.weights.items()}
    return twin


def check_bfloat16_engine(graph: Graph, manifest: Manifest, model_dir: Path, options: Verify,
                          log: Callable[[str], None] = print) -> dict:
    """Build the float32 twin of the engine `manifest` describes next to nothing (a temporary directory) and
    check it; the report says what was checked. Quantized bfloat16 engines are not covered (their effective
    weights differ)."""
    with tempfile.TemporaryDirectory(prefix="bf16-twin-") as tmp:
        twin = Path(tmp)
        lower_to_onnx(twin_graph(graph), twin / "model.onnx", "float32")
        twin_manifest = manifest.replace(target=dataclasses.replace(manifest.target, device="cpu", dtype="float32"),
                                         kv_cache=dataclasses.replace(manifest.kv_cache, dtype="float32"))
        log("verify: bfloat16 cannot run here; checking its float32 twin with bfloat16-rounded weights")
        report = check_engine(twin, model_dir, options, log, rounded_reference_weights(graph), twin_manifest)
    return dict(report, checked=WHAT_IS_CHECKED)



def rounded_reference_weights(graph: Graph) -> dict[str, np.ndarray]:
    """Checkpoint tensor name -> its bfloat16-rounded value (a saved checkpoint holds parameters only)."""
    checkpoint = next(s.checkpoint for s in _leaves(graph) if isinstance(s, CheckpointTensor))
    return {key: round_to_bfloat16(np.asarray(checkpoint.read(key), dtype=np.float32))
            for key in checkpoint.names()}


def _leaves(graph: Graph):
    stack = list(graph.weights.values())
    while stack:
        source = stack.pop()
        if isinstance(source, Concat):
            stack.extend(source.parts)
        else:
            yield source
