"""The generative engine process: ``runner.py`` takes sequences from the broker and answers one StepOutput
per step, around the engine library in ``zserve/generator/`` (no sockets there)."""
