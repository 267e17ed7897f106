"""Runs the pipeline: times each pass, verifies the graph after it, dumps the IR between phases and
re-raises a failure with the failing pass's name and the passes that ran before it."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from builder.ir import Graph
from builder.verifier import verify
from runtime.manifest.types import PassTiming


class Pass:
    """A graph-to-graph transformation. Subclasses set `name` and implement `run`; `requires` names the
    passes that must run (not disabled) before this one, which the PassManager checks before running any."""

    name = "pass"
    requires: tuple[str, ...] = ()

    def run(self, graph: Graph) -> Graph:
        raise NotImplementedError


class Disabled(Pass):
    """A pass switched off by the recipe: still listed in the pipeline, does nothing."""

    def __init__(self, name: str, why: str = "disabled by the recipe"):
        self.name, self.why = name, why

    def run(self, graph: Graph) -> Graph:
        return graph


@dataclass
class Phase:
    name: str
    passes: list[Pass]


class PassError(RuntimeError):
    """A pass failed or left an invalid graph."""


@dataclass(frozen=True)
class PassRun(PassTiming):
    """One pass as the manager ran it: the manifest's PassTiming, and the node count it left."""

    nodes_after: int = 0


@dataclass
class PassManager:
    """Runs phases in order. `dump_dir` receives `NN-before-<phase>.ir` / `NN-after-<phase>.ir`."""

    phases: list[Phase]
    dump_dir: Path | None = None
    timings: list[PassRun] = field(default_factory=list)

    def run(self, graph: Graph) -> Graph:
        self.timings = []
        self.check_requirements()
        verify(graph)
        for number, phase in enumerate(self.phases):
            self._dump(graph, f"{number:02d}-before-{phase.name}")
            for p in phase.passes:
                graph = self._run_pass(p, phase, graph)
            self._dump(graph, f"{number:02d}-after-{phase.name}")
        return graph

    def check_requirements(self) -> None:
        """Every enabled pass's `requires` run, enabled, earlier in the list; else a PassError naming both."""
        earlier: dict[str, Pass] = {}
        for phase in self.phases:
            for p in phase.passes:
                for need in () if isinstance(p, Disabled) else p.requires:
                    if need not in earlier:
                        raise PassError(f"pass {p.name!r} (phase {phase.name}) requires {need!r}, which does not "
                                        f"run before it")
                    if isinstance(earlier[need], Disabled):
                        raise PassError(f"pass {p.name!r} (phase {phase.name}) requires {need!r}, which is "
                                        f"disabled ({earlier[need].why})")
                earlier[p.name] = p

    def _run_pass(self, p: Pass, phase: Phase, graph: Graph) -> Graph:
        start = time.perf_counter()
        try:
            graph = p.run(graph)
            verify(graph)
        except Exception as err:
            ran = [t.name for t in self.timings]
            raise PassError(f"pass {p.name!r} (phase {phase.name}) failed: {err}; passes run before it: "
                            f"{ran or 'none'}") from err
        self.timings.append(PassRun(phase.name, p.name, time.perf_counter() - start, isinstance(p, Disabled),
                                    len(graph.nodes)))
        return graph

    def _dump(self, graph: Graph, stem: str) -> None:
        if self.dump_dir is not None:
            self.dump_dir.mkdir(parents=True, exist_ok=True)
            (self.dump_dir / f"{stem}.ir").write_text(graph.text())
