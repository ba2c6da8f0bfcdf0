"""The generative engine core (generative-engine issue, in progress): pure PyTorch logic, no sockets.

block_manager (paged KV bookkeeping), sequence (request state, sampling params), scheduler (iteration-level
batching with a token budget, chunked prefill, preemption by recompute), attention (paged attention plugged
into unchanged Hugging Face models), engine_core (add / abort / step). Not built yet: the engine process
shell, detokenisation and stop strings, the broker's admission of sequences, the OpenAI/MII APIs.
"""
