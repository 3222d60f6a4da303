"""The cache's tiers beyond the device: one :class:`~tandem.cache.tiers.base.KVTier` port (base.py),
the host tier (host.py, its tree bookkeeping host_nodes.py), the shared L3 tier (l3/), and the
factory that builds them from config (factory.py). See cache/README.md."""
