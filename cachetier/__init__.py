"""The cache tier (agent memory manager and the Redis compressed tier) arrives with its issue.

Nothing here yet: agents report ``cache_bytes`` through their probes, which is where the
memory manager will plug in.
"""
