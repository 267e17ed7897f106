"""Multi-LoRA: PEFT adapters read and checked against an engine's LoRA inputs (`adapters.py`), and the pool
of device slots the engine's A/B inputs hold (`pool.py`)."""
