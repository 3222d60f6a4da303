"""The engine's scheduling room: what runs in the next step (README.md, "Two rooms"). It never
imports the execution room (models, attention, quant, the runner, graphs, the sampler)."""
