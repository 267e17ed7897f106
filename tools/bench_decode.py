"""Moved to tools/bench/decode.py (every benchmark lives in tools/bench/); `python -m tools.bench_decode`
still runs it, the same as `python -m tools.bench.decode`."""
from tools.bench.decode import main

if __name__ == "__main__":
    main()
