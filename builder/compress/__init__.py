"""engine-compress: structured pruning (depth and width, Minitron-style importance) and knowledge distillation of a
Hugging Face Llama-family checkpoint, or of a speculative-decoding draft for a target; the result is a checkpoint
that engine-build takes as is. cli.py is the front door; one concern per module."""
