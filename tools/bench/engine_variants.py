"""Variants of a built engine made by rewriting its graph, to measure a candidate before building it into the
builder (issue 47: where the int8 rounding goes, and where a batch-1 step goes). The weights file is copied and
new initializers are stored inside model.onnx; the manifest's size and hash of model.onnx are updated so the
runtime loads it.

    python -m tools.bench.engine_variants --engine ENGINE --variant VARIANT --out NEW_ENGINE

Variants (a `:a+b` suffix limits one to the MatMulNBits whose weight name contains `a` or `b`, e.g. `qkv`, `embed`
for a tied head):
- `level1[:kinds]`: accuracy_level 1 (float activations) for those matmuls. Exact weights.
- `block16[:kinds]`: block-32 MatMulNBits re-blocked at 16: codes as they are, each scale written twice (the same
  values exactly), so ONNX Runtime's int8 path rounds the activations per 16 instead of per 32. Not for nodes with
  explicit zero points.
- `joint_terms`: the block-minimum terms of linears on one block sum as one MatMul and a Split (exact).
- `joint_linears`: linears on one input in one layout, each with a block-minimum term, as one MatMulNBits, one
  minimum term, one Add and a Split (exact). The prototype of FuseQKV's fusion through the q/k norms (Qwen3's q, k,
  v in Q4_K), which the builder now does itself: on engines built since, it finds nothing left to join.
- `no_terms`: every block-minimum term dropped (wrong numbers: the bound on any form of the term).
- `int8_terms`: the terms as 8-bit MatMulNBits over the block sums at level 4 (the sums rounded to int8: speed
  only, not exact)."""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import click
import numpy as np
import onnx
from onnx import helper, numpy_helper

VARIANTS = ("level1", "block16", "joint_terms", "joint_linears", "no_terms", "int8_terms")


class Rewrite:
    """One engine's graph, its weights readable by name."""

    def __init__(self, engine: Path):
        self.engine = engine
        self.model = onnx.load(str(engine / "model.onnx"), load_external_data=False)
        self.graph = self.model.graph
        self.nodes = list(self.graph.node)
        self.producer = {o: n for n in self.nodes for o in n.output}
        self.consumers: dict[str, list] = {}
        for n in self.nodes:
            for i in n.input:
                self.consumers.setdefault(i, []).append(n)

    def weight(self, name: str) -> np.ndarray:
        t = next(t for t in self.graph.initializer if t.name == name)
        if not t.external_data:
            return numpy_helper.to_array(t)
        info = {e.key: e.value for e in t.external_data}
        raw = np.fromfile(self.engine / info["location"], np.uint8, int(info["length"]),
                          offset=int(info.get("offset", 0)))
        return raw.view(helper.tensor_dtype_to_np_dtype(t.data_type)).reshape(tuple(t.dims))

    def add(self, name: str, array: np.ndarray) -> str:
        self.graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def set_nodes(self, nodes: list) -> None:
        del self.graph.node[:]
        self.graph.node.extend(nodes)

    def index(self, nodes: list, node) -> int:
        return next(i for i, n in enumerate(nodes) if n is node)


def _attrs(node) -> dict:
    return {a.name: a for a in node.attribute}


def _selected(node, kinds: list[str]) -> bool:
    return node.op_type == "MatMulNBits" and (not kinds or any(k in node.input[1] for k in kinds))


def level1(r: Rewrite, kinds: list[str]) -> None:
    for n in r.nodes:
        if _selected(n, kinds):
            _attrs(n)["accuracy_level"].i = 1


def block16(r: Rewrite, kinds: list[str]) -> None:
    for n in r.nodes:
        attrs = _attrs(n)
        if not _selected(n, kinds) or attrs["block_size"].i != 32 or (len(n.input) > 3 and n.input[3]):
            continue
        q, scales = r.weight(n.input[1]), r.weight(n.input[2])
        rows, blocks, width = q.shape  # [N, K / 32, 32 * bits / 8]: values in order, so halves are blocks of 16
        n.input[1] = r.add(n.input[1] + ".block16", q.reshape(rows, blocks * 2, width // 2))
        n.input[2] = r.add(n.input[2] + ".block16", np.repeat(scales, 2, axis=1))
        attrs["block_size"].i = 16


def _terms(r: Rewrite) -> dict[str, list]:
    """Block sum -> the minimum-term MatMuls reading it."""
    groups: dict[str, list] = {}
    for n in r.nodes:
        if n.op_type == "MatMul" and "minimum_term" in n.output[0]:
            groups.setdefault(n.input[0], []).append(n)
    return groups


def joint_terms(r: Rewrite, kinds: list[str]) -> None:
    nodes = list(r.nodes)
    for sums, terms in _terms(r).items():
        if len(terms) < 2:
            continue
        name = terms[0].input[1] + ".joint"
        mats = [r.weight(t.input[1]) for t in terms]
        made = [helper.make_node("MatMul", [sums, r.add(name, np.concatenate(mats, 1))], [name + ".y"]),
                helper.make_node("Split", [name + ".y", r.add(name + ".sizes", np.array([m.shape[1] for m in mats]))],
                                 [t.output[0] for t in terms], axis=-1)]
        at = r.index(nodes, terms[0])
        for t in terms:
            del nodes[r.index(nodes, t)]
        nodes[at:at] = made
    r.set_nodes(nodes)


def joint_linears(r: Rewrite, kinds: list[str]) -> None:
    by_input: dict[str, list] = {}
    for n in r.nodes:
        if n.op_type == "MatMulNBits" and len(n.input) == 3:
            by_input.setdefault(n.input[0], []).append(n)
    nodes = list(r.nodes)
    for x, linears in by_input.items():
        layouts = {tuple(_attrs(n)[k].i for k in ("bits", "block_size", "K")) for n in linears}
        adds = [(r.consumers.get(n.output[0]) or [None])[0] for n in linears]
        if len(linears) < 2 or len(layouts) != 1 or any(a is None or a.op_type != "Add" for a in adds):
            continue
        terms = [r.producer.get(next(i for i in a.input if i != n.output[0])) for a, n in zip(adds, linears)]
        if any(t is None or t.op_type != "MatMul" or "minimum_term" not in t.output[0] for t in terms):
            continue  # only linears that each end in their block-minimum term (Q4_K, Q4_1, ...)
        name = linears[0].input[1].rsplit(".", 2)[0] + ".joint"
        sizes = [_attrs(n)["N"].i for n in linears]
        attrs = {a.name: a.i for a in linears[0].attribute}
        attrs["N"] = sum(sizes)
        q = r.add(name + ".q", np.concatenate([r.weight(n.input[1]) for n in linears]))
        s = r.add(name + ".scales", np.concatenate([r.weight(n.input[2]) for n in linears]))
        m = r.add(name + ".minimums", np.concatenate([r.weight(t.input[1]) for t in terms], 1))
        made = [helper.make_node("MatMulNBits", [x, q, s], [name + ".partial"], domain="com.microsoft", **attrs),
                helper.make_node("MatMul", [terms[0].input[0], m], [name + ".term"]),
                helper.make_node("Add", [name + ".partial", name + ".term"], [name + ".y"]),
                helper.make_node("Split", [name + ".y", r.add(name + ".sizes", np.array(sizes))],
                                 [a.output[0] for a in adds], axis=-1)]
        for old in linears + adds + terms:
            del nodes[r.index(nodes, old)]
        at = r.index(nodes, r.producer[terms[0].input[0]]) + 1  # after the block sums
        nodes[at:at] = made
    r.set_nodes(nodes)


def no_terms(r: Rewrite, kinds: list[str]) -> None:
    dropped = set()
    for n in r.nodes:
        if n.op_type == "MatMul" and "minimum_term" in n.output[0]:
            add = r.consumers[n.output[0]][0]
            r.producer[next(i for i in add.input if i != n.output[0])].output[0] = add.output[0]
            dropped |= {id(n), id(add)}
        if n.op_type == "ReduceSum" and "block_sums" in n.output[0]:
            dropped |= {id(n), id(r.producer[n.input[0]])}
    r.set_nodes([n for n in r.nodes if id(n) not in dropped])


def int8_terms(r: Rewrite, kinds: list[str]) -> None:
    nodes = []
    for n in r.nodes:
        if n.op_type == "MatMul" and "minimum_term" in n.output[0]:
            m = r.weight(n.input[1]).T.reshape(-1, r.weight(n.input[1]).shape[0] // 16, 16)  # [N, K/32/16, 16]
            scale = np.abs(m).max(-1) / 127 + 1e-12
            codes = (np.clip(np.round(m / scale[..., None]), -127, 127) + 128).astype(np.uint8)
            inputs = [n.input[0], r.add(n.input[1] + ".q8", codes), r.add(n.input[1] + ".s8", scale.astype(np.float32))]
            n = helper.make_node("MatMulNBits", inputs, list(n.output), name=n.name, domain="com.microsoft",
                                 K=m.shape[1] * 16, N=m.shape[0], bits=8, block_size=16, accuracy_level=4)
        nodes.append(n)
    r.set_nodes(nodes)


def write(r: Rewrite, out: Path) -> None:
    """The engine folder at `out`: every file copied, model.onnx rewritten, the manifest's entry for it updated."""
    out.mkdir(parents=True, exist_ok=True)
    for f in r.engine.iterdir():
        if f.name not in ("model.onnx", "manifest.json"):
            shutil.copy(f, out / f.name)
    onnx.save(r.model, str(out / "model.onnx"))
    manifest = json.loads((r.engine / "manifest.json").read_text())
    data = (out / "model.onnx").read_bytes()
    manifest["files"]["model.onnx"] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))


@click.command()
@click.option("--engine", type=click.Path(exists=True, file_okay=False, path_type=Path), required=True)
@click.option("--variant", required=True, help=f"one of {', '.join(VARIANTS)}, optionally :kind+kind")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True)
def main(engine: Path, variant: str, out: Path) -> None:
    name, _, kinds = variant.partition(":")
    if name not in VARIANTS:
        raise click.UsageError(f"--variant {name!r}: allowed {', '.join(VARIANTS)}")
    if out.exists():
        raise click.UsageError(f"--out {out} exists")
    r = Rewrite(engine)
    globals()[name](r, [k for k in kinds.split("+") if k])
    write(r, out)
    click.echo(f"{out}: {len(r.graph.node)} nodes")


if __name__ == "__main__":
    main()
