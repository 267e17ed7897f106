"""Figures for engine-compress (docs/ACCURACY.md): distillation against cross-entropy at equal tokens, and which
layers the importance scores choose beside what removing each costs."""
