"""The shared L3 KV tier (issue 26): pages in a cluster-wide Mooncake Store, keyed by page hash."""
