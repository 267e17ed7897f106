"""The builder's shape: no import cycle among its modules (imports inside functions count), its
subpackages (passes/, quant/) import only the IR and the pieces below them, never the modules that drive
them (pipeline, build, lowering), and no pass imports another pass."""
from __future__ import annotations

from pathlib import Path

from import_graph import find_cycle, import_graph

BUILDER = Path(__file__).resolve().parents[2] / "builder"
# what the subpackages stand on: the IR, lazy weights, the op table, the verifier, the Pass base, weight slices
FOUNDATION = {"ir", "weights", "ops", "verifier", "pass_manager", "shard_weights"}
ALLOWED = {"quant": FOUNDATION, "passes": FOUNDATION | {"quant"}}  # a pass may use the quantization registry


def _package(name: str) -> str:
    return name.split(".")[0]


def test_builder_has_no_import_cycle():
    graph = import_graph(BUILDER)
    assert "segments" in graph["build"] and "build" not in graph["segments"]  # the graph is read; the old cycle is gone
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle in builder/: " + " -> ".join(cycle)


def test_builder_subpackages_import_nothing_above_them():
    graph = import_graph(BUILDER)
    upward = [f"{module} -> {dep}" for module, deps in graph.items() if _package(module) in ALLOWED
              for dep in deps if _package(dep) != _package(module) and _package(dep) not in ALLOWED[_package(module)]]
    assert not upward, f"builder subpackages importing modules above them: {upward}"


def test_no_pass_imports_another_pass():
    graph = import_graph(BUILDER)
    borrowed = [f"{module} -> {dep}" for module, deps in graph.items() if module.startswith("passes.")
                for dep in deps if dep.startswith("passes.")]
    assert not borrowed, f"passes sharing helpers by importing each other (move them to the IR): {borrowed}"


def test_one_build_path_and_one_engine_interface():
    """One build path for one rank and N (no second build module), and a tensor-parallel segment declares
    its interface through Lowering's (its own layers' KV, its boundary values' dtypes), never a copy of it:
    the copy had drifted (cos/sin sized head_dim / 2, wrong with partial rotary)."""
    from builder.lower_onnx import Lowering
    from builder.segments import SegmentLowering

    assert not (BUILDER / "build_tp.py").exists()
    overridden = set(vars(SegmentLowering)) & {name for name in vars(Lowering) if name.startswith("_declare")}
    assert not overridden, f"SegmentLowering copies Lowering's interface: {sorted(overridden)}"
    declaring = [path.name for path in BUILDER.rglob("*.py") if '_input("cos_cache"' in path.read_text()]
    assert declaring == ["lower_onnx.py"], f"the rotary inputs declared outside Lowering: {declaring}"
