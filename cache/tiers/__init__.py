"""The cache's tiers beyond the device: one :class:`~tandem.cache.tiers.base.KVTier` port, the host
tier, the shared L3 tier (l3/), and the factory that builds them from config."""
