"""Moves KV bytes between workers: NIXL agent, page descriptors, handshake messages, side channel.

Knows memory regions and page ids, never requests or trees. The only package that imports NIXL
(lazily, inside :class:`~tandem.transfer.agent.KVTransferAgent`), so importing this package is cheap.
See README.md.
"""
