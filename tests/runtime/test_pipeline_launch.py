"""Pipeline stages started by torchrun (runtime/parallel/launch.py), on this machine as two "nodes": two torchrun
invocations with --nnodes 2 on localhost, every rank running the same script (`LLM(DIR)`; a stage rank serves
inside it). Tokens identical to `LLM(DIR)` starting the stages itself and to pp1; a node whose engine directory
is missing fails with an error naming the rank and the path; a stage that dies is named in the error the request
ends with; a world that does not match the stages is refused with the numbers. And the micro-batch count is a
load option (LoadConfig.micro_batches), validated."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from runtime.config import LoadConfig
from runtime.engine import LLM
from runtime.manifest.load import EngineError
from runtime.request.params import SamplingParams
from tests.runtime.test_pipeline_parallel import build, checkpoint  # noqa: F401  (the pipeline tests' checkpoint)

ROOT = Path(__file__).parents[2]
SCRIPT = Path(__file__).with_name("pp_launch_script.py")
NEW_TOKENS = 10
PROMPTS = [np.random.default_rng(7).integers(4, 512, n).tolist() for n in (11, 3, 17, 6)]


@pytest.fixture(scope="module")
def engines(tmp_path_factory, checkpoint):
    root = tmp_path_factory.mktemp("pp-launch")
    return {1: build(checkpoint, root / "pp1"), 2: build(checkpoint, root / "pp2", "parallel.pipeline_parallel=2")}


def generate(engine, **options) -> tuple[list[list[int]], dict]:
    llm = LLM(engine, threads=1, **options)
    try:
        params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
        return [r.token_ids for r in llm.generate(PROMPTS, params)], llm.executor.stats()
    finally:
        llm.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(node: int, nproc: int, port: int, *args: str, nnodes: int = 2) -> subprocess.Popen:
    """One "node": `torchrun --nnodes N --node-rank NODE --nproc-per-node NPROC` running the script on localhost."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--node-rank", str(node),
               "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1", "--master-port", str(port),
               str(SCRIPT), *args]
    env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(*nodes: subprocess.Popen, timeout: float = 240) -> list[tuple[int, str]]:
    out = []
    for node in nodes:
        try:
            text, _ = node.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            node.kill()
            text, _ = node.communicate()
        out.append((node.returncode, text))
    return out


def test_micro_batches_is_a_load_option(engines):
    with pytest.raises(EngineError, match=r"micro_batches must be an integer >= 1 \(or None: one per pipeline "
                                          r"stage\), got 0"):
        LoadConfig(micro_batches=0)
    one, _ = generate(engines[1])
    three, stats = generate(engines[2], micro_batches=3)
    assert stats["virtual_engines"] == 3 and three == one
    single, stats = generate(engines[2], micro_batches=1)  # one batch through the stages at a time
    assert stats["virtual_engines"] == 1 and single == one


@pytest.mark.e2e
def test_two_nodes_identical_to_llm_and_pp1(engines, tmp_path):
    """Node 0 runs rank 0 (the driver) and rank 1 (stage 0), node 1 rank 2 (stage 1)."""
    port, out = free_port(), tmp_path / "tokens.json"
    args = (str(engines[2]), str(out), json.dumps(PROMPTS), str(NEW_TOKENS))
    results = finish(torchrun(0, 2, port, *args), torchrun(1, 1, port, *args))
    assert [code for code, _ in results] == [0, 0], "\n".join(text for _, text in results)
    launched = json.loads(out.read_text())
    assert launched["virtual_engines"] == 2
    assert launched["tokens"] == generate(engines[2])[0] == generate(engines[1])[0]


@pytest.mark.e2e
def test_two_nodes_pipeline_x_tensor_parallel(engines, checkpoint, tmp_path):
    """pp2 x tp2 (world 5): node 0 runs rank 0 and stage 0's two tp ranks, node 1 stage 1's two; each stage
    all-reduces within its own group."""
    engine = build(checkpoint, tmp_path / "pp2tp2", "parallel.pipeline_parallel=2",
                   "parallel.tensor_parallel=2")
    port, out = free_port(), tmp_path / "tokens.json"
    args = (str(engine), str(out), json.dumps(PROMPTS), str(NEW_TOKENS))
    results = finish(torchrun(0, 3, port, *args), torchrun(1, 2, port, *args))
    assert [code for code, _ in results] == [0, 0], "\n".join(text for _, text in results)
    assert json.loads(out.read_text())["tokens"] == generate(engine)[0] == generate(engines[1])[0]


@pytest.mark.e2e
def test_missing_engine_on_a_node_names_the_rank_and_path(engines, tmp_path):
    port, out, missing = free_port(), tmp_path / "out.json", tmp_path / "not-copied-here"
    rest = (json.dumps(PROMPTS), str(NEW_TOKENS))
    results = finish(torchrun(0, 2, port, str(engines[2]), str(out), *rest),
                     torchrun(1, 1, port, str(missing), str(tmp_path / "unused.json"), *rest))
    assert results[1][0] != 0
    error = json.loads(out.read_text())["load_error"]
    assert "rank 2" in error and str(missing) in error and "no such directory" in error
    assert "rank 2" in results[1][1]  # printed on its own node too


@pytest.mark.e2e
def test_world_that_does_not_match_the_stages_is_refused(engines, tmp_path):
    port, out = free_port(), tmp_path / "out.json"
    results = finish(torchrun(0, 2, port, str(engines[2]), str(out), json.dumps(PROMPTS), "2", nnodes=1))
    assert all(code != 0 for code, _ in results)
    assert "torchrun started 2 processes (WORLD_SIZE)" in json.loads(out.read_text())["load_error"]
    error = json.loads(out.read_text())["load_error"]
    assert "which has 2 pipeline stages" in error and "start 3" in error


@pytest.mark.e2e
def test_stage_that_dies_is_named(engines, tmp_path):
    """Node 0 runs the driver alone, node 1 both stages; stage 1 (rank 2) is killed after loading: the next
    request ends with an error naming it, a later call raises, and every process ends."""
    port, out, started = free_port(), tmp_path / "out.json", tmp_path / "started"
    args = (str(engines[2]), str(out), json.dumps(PROMPTS), "8", "--started", str(started))
    driver, stages = torchrun(0, 1, port, *args), torchrun(1, 2, port, *args)
    deadline = time.monotonic() + 180
    while not started.exists() and time.monotonic() < deadline and driver.poll() is None:
        time.sleep(0.1)
    assert started.exists(), finish(driver, stages)
    os.kill(_stage_pid(stages.pid, 2), signal.SIGKILL)
    Path(f"{started}.killed").touch()
    assert finish(stages, timeout=120)[0][0] != 0  # the stages' torchrun reports the death
    deadline = time.monotonic() + 120
    while _children(driver.pid) and time.monotonic() < deadline:  # rank 0 ends by itself...
        time.sleep(0.2)
    assert not _children(driver.pid)
    driver.kill()  # ...its torchrun would wait out its exit barrier (300 s) for the node that failed
    driver.wait()
    ended = json.loads(out.read_text())
    assert ended["finish_reason"] == "error" and "pipeline stage 1 (rank 2)" in ended["error"], ended
    assert "heartbeat stopped" in ended["error"] and "pipeline stage 1 (rank 2)" in ended["later"]


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _stage_pid(agent: int, rank: int) -> int:
    """The pid of the worker of `rank` under a torchrun agent (its RANK in /proc/PID/environ)."""
    for pid in _children(agent):
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in environ:
            return pid
    raise AssertionError(f"no worker of rank {rank} under torchrun {agent}")
