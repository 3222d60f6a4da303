"""A simulated prefill/decode cluster for routing experiments on one CPU.

``cost_model`` (how long things take on a named GPU + model), ``engine`` (prefill and decode
workers: queues, batching, one real ``UnifiedRadixCache`` in simulated mode per prefill worker),
``simulate`` (discrete-event replay of a trace through a router policy; JSON summary),
``cli`` (``tandem simulate``).
"""
