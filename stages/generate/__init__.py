"""The generative engine: pure PyTorch logic (no sockets) plus its process shell.

block_manager (paged KV bookkeeping), sequence (request state, sampling params), scheduler (iteration-level
batching with a token budget, chunked prefill, preemption by recompute), attention (paged attention plugged
into unchanged Hugging Face models), engine_core (add / abort / step), detokenize (incremental text, stop
strings), runner (the engine process: sequences from the broker, one StepOutput per step).
"""
