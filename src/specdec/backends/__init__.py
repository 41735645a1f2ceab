"""Model backends behind one protocol (base.py): a cache-carrying forward, the KV caches, and each runtime's own package."""
