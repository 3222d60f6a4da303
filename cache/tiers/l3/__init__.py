"""The shared L3 KV tier: pages in a cluster-wide Mooncake Store, keyed by page hash."""
