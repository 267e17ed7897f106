"""One request's life: sampling parameters, input validation, the sequence, its sampler, detokenizer and chat template."""
