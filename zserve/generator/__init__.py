"""The generative engine library: pure PyTorch logic, no sockets (the engine process around it is
``zserve/workers/generate/runner.py``).

block_manager (paged KV bookkeeping), sequence (request state, sampling params), scheduler (iteration-level
batching with a token budget, chunked prefill, preemption by recompute), attention (paged attention, also
plugged into unchanged Hugging Face models), llama (our model code for the Llama family), native (the CPU
decode-attention kernel), native_linear (the CPU linear kernel), c_build (compiles and caches both), cpu_linear
(linear layers with weights packed once: native_linear's or oneDNN's), sampler (batched sampling options,
logprobs), grammar (structured output), step_core (StepCore: add / abort / step), detokenize (incremental
text, stop strings), generator (Generator: the model, tokeniser and StepCore together; in-process generate),
tensor_parallel (an engine group over torch.distributed).
"""
