"""Shared NATS plumbing: the connection and its options, authentication, JetStream KV buckets,
the leader lease, the request/reply client with retries and the replicated-service base.

Bus, group schedulers and coordinator all use it; it imports none of them.
"""
