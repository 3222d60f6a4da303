"""Trace replay over a simulated prefill/decode cluster, for routing experiments on one CPU.

``simulate`` (discrete-event replay of a trace through a router policy; JSON summary) and ``cli``
(``tandem simulate``). The simulated workers and cost profiles they run are sim/'s own, the ones
``tandem serve --engine sim`` serves with.
"""
