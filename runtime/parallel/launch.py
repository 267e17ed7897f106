"""Pipeline stages started by torchrun, on one machine or several. Every rank runs the same command (torchrun's
way, and vLLM's or SGLang's for several nodes: one `serve` command, the rank decides the role): `engine-serve`,
`engine-run` or a script that makes `LLM(DIR)`. Rank 0 is the driver: it tokenizes, schedules, samples and serves
(runtime/parallel/pipeline_runner.py); rank s + 1 loads stage s from the engine directory on its own machine
(the same path; a copy of the same build) and runs it until rank 0 stops the engine.

    # node 0 (10.0.0.1): rank 0, the driver, and rank 1, stage 0
    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 2 --master-addr 10.0.0.1 --master-port 29500 \\
        --no-python engine-serve --engine engines/pp3 --host 0.0.0.0
    # node 1: ranks 2 and 3, stages 1 and 2 (the same command; a stage rank reads --engine and nothing else)
    torchrun --nnodes 2 --node-rank 1 --nproc-per-node 2 --master-addr 10.0.0.1 --master-port 29500 \\
        --no-python engine-serve --engine engines/pp3

The ranks meet in torchrun's store (`env://`: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, which a hand-started
process may set too). Rank 0 publishes how to load (the KV spec, its LoadConfig, its manifest's digest) under
PREFIX; each stage rank checks its engine directory against it and answers `ready/RANK` or `failed/RANK` with
its error, which rank 0 raises naming the rank, the machine and the path. A stage rank beats `beat/RANK` every
BEAT_S seconds: when a send or receive fails, the ranks whose beats stopped are the ones named."""
from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

from runtime.config import LoadConfig
from runtime.manifest.kv_spec import KVCacheSpec
from runtime.manifest.load import EngineError, read_manifest
from runtime.parallel.processes import describe

PREFIX = "engine-pp"  # this engine's keys in torchrun's store
BEAT_S = 1.0
LOAD_SILENCE_S = 30.0  # a stage rank loading its sessions may hold the GIL (and so its beats) a while
LOAD_TIMEOUT_S = float(os.environ.get("ENGINE_PP_LOAD_TIMEOUT_S", "600"))  # rank 0 waits this long for the stages


@dataclasses.dataclass(frozen=True)
class Launch:
    """This process's place in a torchrun launch (or one started by hand with the same variables)."""

    rank: int
    world: int
    addr: str
    port: int

    @classmethod
    def from_env(cls) -> Launch | None:
        """The launch from RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; None unless all are set and the world
        has more than one process."""
        names = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        if not all(os.environ.get(n) for n in names) or int(os.environ["WORLD_SIZE"]) < 2:
            return None
        return cls(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), os.environ["MASTER_ADDR"],
                   int(os.environ["MASTER_PORT"]))

    @property
    def who(self) -> str:
        return f"rank {self.rank} on {socket.gethostname()}"

    def store(self):
        """torchrun's store (its agent's, or rank 0's when started by hand), under PREFIX."""
        import torch.distributed as dist  # only for a launch: `from_env` is called on every load

        store, _, _ = next(dist.rendezvous("env://", timeout=datetime.timedelta(seconds=LOAD_TIMEOUT_S)))
        return dist.PrefixStore(PREFIX, store)


def digest(engine_dir: Path) -> str:
    return hashlib.sha256((engine_dir / "manifest.json").read_bytes()).hexdigest()


# -- rank 0 --------------------------------------------------------------------------------------------------

def refuse(launch: Launch, message: str) -> EngineError:
    """Rank 0 cannot drive this launch: tell the stage ranks (they print it and leave) and return the error."""
    launch.store().set("load", json.dumps({"error": message}))
    return EngineError(message)


def start_stages(launch: Launch, section, engine_dir: Path, spec: KVCacheSpec, config: LoadConfig):
    """Rank 0: check the world has a rank per stage process (`section`: the manifest's pipeline_parallel), publish how to load, wait until every stage rank is ready
    (an error naming the rank, its machine and path if one failed or went silent). Returns the store and the
    stage ranks' Beats. `config.threads` unset: each stage rank takes its machine's cores over its processes."""
    if launch.rank != 0:
        raise EngineError(f"rank {launch.rank} reached the driver's load; only rank 0 drives (a stage rank runs "
                          f"runtime.parallel.launch.serve_stage)")
    if launch.world != section.world:
        processes = section.world - 1
        raise refuse(launch, f"torchrun started {launch.world} processes (WORLD_SIZE) for {engine_dir}, which has "
                             f"{section.size} pipeline stages of {section.tensor_parallel} tensor-parallel rank(s): "
                             f"start {section.world} (rank 0 drives, ranks 1..{processes} run the stages), e.g. "
                             f"--nnodes and --nproc-per-node adding up to {section.world}")
    store = launch.store()
    store.set("load", json.dumps({"spec": spec.to_dict(), "config": config.to_json(), "digest": digest(engine_dir)}))
    beats = Beats(store, range(1, launch.world))
    waiting = set(range(1, launch.world))
    deadline = time.monotonic() + LOAD_TIMEOUT_S
    while waiting:
        for rank in sorted(waiting):
            if store.check([f"failed/{rank}"]):
                raise EngineError(store.get(f"failed/{rank}").decode())
            if store.check([f"ready/{rank}"]):
                waiting.discard(rank)
        if stopped := beats.stopped(waiting, LOAD_SILENCE_S):
            raise EngineError(f"{ranks(stopped, section.tensor_parallel)} stopped while loading (its launcher's output has why)")
        if time.monotonic() > deadline:
            raise EngineError(f"{ranks(sorted(waiting), section.tensor_parallel)} did not load within {LOAD_TIMEOUT_S:g} s "
                              f"(ENGINE_PP_LOAD_TIMEOUT_S): is torchrun running on every node, and its output clean?")
        time.sleep(0.05)
    return store, beats


class Beats:
    """Rank 0's view of the stage ranks' heartbeats: a rank whose count has not moved for 3 beats stopped."""

    def __init__(self, store, ranks):
        self.store, self.seen = store, {rank: (-1, time.monotonic()) for rank in ranks}

    def stopped(self, ranks=None, silence: float = 3 * BEAT_S) -> list[int]:
        now, out = time.monotonic(), []
        for rank in self.seen if ranks is None else ranks:
            count = self.store.add(f"beat/{rank}", 0)
            last, since = self.seen[rank]
            if count != last:
                self.seen[rank] = (count, now)
            elif count > 0 and now - since > silence:
                out.append(rank)
        return out

    def wait_stopped_cleanly(self, seconds: float) -> None:
        """Wait until every stage rank has taken rank 0's STOP and finished its sends (`done/RANK`)."""
        self.store.wait([f"done/{rank}" for rank in self.seen], datetime.timedelta(seconds=seconds))

    def wait_stopped(self) -> list[int]:
        """The ranks that stopped, sampled over 3 beats and a half (after a failed send or receive)."""
        end = time.monotonic() + 3.5 * BEAT_S
        while time.monotonic() < end:
            self.stopped()
            time.sleep(BEAT_S / 4)
        return self.stopped()


def ranks(numbers, tp: int) -> str:
    return ", ".join(describe(tp, r) for r in numbers)


# -- stage ranks ---------------------------------------------------------------------------------------------

def serve_stage(engine_dir: str | Path, launch: Launch) -> None:
    """A stage rank: meet rank 0, load stage rank - 1 from `engine_dir` on this machine (or post why not, and
    exit 1), run it until rank 0 stops the engine, then exit 0. Never returns."""
    store = launch.store()
    stop, beating = _beat(store, launch.rank)
    try:
        code = _serve(store, Path(engine_dir), launch)
    finally:
        stop.set()  # and wait for the beat thread: one inside the store at exit aborts the process
        beating.join()
    sys.exit(code)


def _serve(store, directory: Path, launch: Launch) -> int:
    import torch.distributed as dist

    from runtime.parallel.stage import StageEngine, serve, stage_group

    load = json.loads(store.get("load"))
    if "error" in load:
        return _leave(f"engine-pp {launch.who}: rank 0 refused the launch: {load['error']}")
    try:
        config = LoadConfig.from_json(load["config"])
        if config.threads is None:  # this machine's cores over the processes torchrun started here
            local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            config = dataclasses.replace(config, threads=max(1, (os.cpu_count() or 1) // local))
        manifest = read_manifest(directory, config.check_files)
        _check(directory, manifest, launch, load["digest"])
        section = manifest.pipeline_parallel
        who = f"{describe(section.tensor_parallel, launch.rank)} on {socket.gethostname()}"
        engine = StageEngine(directory, manifest, KVCacheSpec.from_dict(load["spec"]), launch.rank - 1, config)
    except Exception as err:  # noqa: BLE001 (any load failure is told to rank 0, then this rank leaves)
        message = f"{launch.who} could not load its stage from {directory.resolve()}: {err}"
        store.set(f"failed/{launch.rank}", message)
        return _leave(f"engine-pp: {message}")
    store.set(f"ready/{launch.rank}", "1")
    try:
        group = dist.ProcessGroupGloo(store, launch.rank, launch.world, datetime.timedelta(seconds=_timeout()))
        if engine.collectives:  # the stage's own tensor-parallel group
            engine.group = stage_group(store, *section.place(launch.rank), section.tensor_parallel)
        serve(engine, group, launch.rank)
    except RuntimeError as err:  # rank 0 or a neighbour died: leave, do not hang
        return _leave(f"engine-pp {who}: stopping: {err}")
    store.set(f"done/{launch.rank}", "1")  # rank 0 keeps the connections open until every stage says so
    return 0


def _check(directory: Path, manifest, launch: Launch, expected: str) -> None:
    section = manifest.pipeline_parallel
    if section is None:
        raise EngineError("not a pipeline-parallel engine (build it with parallel.pipeline_parallel > 1)")
    if section.world != launch.world:
        raise EngineError(f"its {section.size} stages of {section.tensor_parallel} tensor-parallel rank(s) need "
                          f"{section.world} processes; torchrun started {launch.world}")
    if digest(directory) != expected:
        raise EngineError("its manifest.json differs from rank 0's: copy the same engine directory to every node")


def _beat(store, rank: int) -> tuple[threading.Event, threading.Thread]:
    """Add one to `beat/RANK` every BEAT_S seconds on a thread of its own until the event returned is set."""
    stop = threading.Event()

    def beat() -> None:
        try:
            while not stop.is_set():
                store.add(f"beat/{rank}", 1)
                stop.wait(BEAT_S)
        except RuntimeError:  # the store is gone: rank 0's launch ended
            return
    thread = threading.Thread(target=beat, name="engine-pp-beat", daemon=True)
    thread.start()
    return stop, thread


def _timeout() -> float:
    from runtime.parallel.rank import TIMEOUT_S

    return TIMEOUT_S


def _leave(message: str) -> int:
    print(message, file=sys.stderr, flush=True)
    return 1


# -- the commands ----------------------------------------------------------------------------------------------

def stage_rank_runs(argv: list[str], named: bool) -> None:
    """Before a command (engine-run, engine-serve) parses its options: on a stage rank of a launch, serve the
    stage of its `--engine` (engine-serve's `[NAME=]DIR`, `named`: the first one) instead; else return."""
    launch = Launch.from_env()
    if launch is None or launch.rank == 0:
        return
    value = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--engine"), None)
    value = value or next((a.split("=", 1)[1] for a in argv if a.startswith("--engine=")), None)
    if value is None:
        sys.exit(_leave(f"engine-pp {launch.who}: no --engine DIR on the command line; every rank runs the same "
                        f"command"))
    serve_stage(value.rpartition("=")[2] if named else value, launch)
