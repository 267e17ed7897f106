"""Run on every rank by torchrun (tests/runtime/test_pipeline_launch.py): `LLM(ENGINE)` on every rank, as a user's
script would; a stage rank serves its stage inside it and exits. Rank 0 generates greedily and writes the tokens
(or the load error, or the error a request ended with) as JSON to OUT.

    python pp_launch_script.py ENGINE OUT PROMPTS_JSON NEW_TOKENS [--started FILE]

With --started, rank 0 touches FILE once loaded and waits for FILE.killed (the test kills a stage meanwhile),
then runs one request and another, recording the error each ends with."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from runtime.engine import LLM
from runtime.manifest.load import EngineError
from runtime.parallel.pipeline_runner import PipelineParallelError
from runtime.request.params import SamplingParams


def main(engine: str, out: str, prompts: str, new: str, *started: str) -> None:
    try:
        llm = LLM(engine, threads=1)
    except EngineError as err:
        Path(out).write_text(json.dumps({"load_error": str(err)}))
        sys.exit(1)
    params = SamplingParams(max_new_tokens=int(new), ignore_eos=True)
    try:
        if started:  # the test kills a stage once this rank has loaded, then lets it generate
            Path(started[1]).touch()
            killed = Path(started[1] + ".killed")
            while not killed.exists():
                time.sleep(0.05)
            result = llm.generate(json.loads(prompts)[:1], params)[0]
            try:  # the engine is stopped: a later call raises, or its request ends with the error
                later = llm.generate(json.loads(prompts)[:1], params)[0].error or "no error"
            except (PipelineParallelError, RuntimeError) as err:
                later = str(err)
            Path(out).write_text(json.dumps({"finish_reason": result.finish_reason, "error": result.error,
                                             "later": later}))
        else:
            results = llm.generate(json.loads(prompts), params)
            Path(out).write_text(json.dumps({"tokens": [r.token_ids for r in results],
                                             "virtual_engines": llm.executor.stats()["virtual_engines"]}))
    finally:
        llm.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
