"""The lent GPU machine: `setup` stages onnxruntime-gpu in parts that fit a call and plans the calls
(.gpu/COMMANDS.txt), `check` runs every CUDA correctness check and benchmark in one call under a deadline, and
`steps` holds the measurements it runs. docs/GPU.md has the sequence."""
