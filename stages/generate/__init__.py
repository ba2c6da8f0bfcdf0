"""The generative engine core (continuous batching, paged KV cache): pure logic, tested without processes.
Work in progress for the generative-engine issue: only the block manager is here so far."""
