"""GPU hosts: their rows and GPUs, joining (tokens, credentials and the
database and Redis grants a host gets), the channel's authority and
certificates, and the outbox that carries tasks to a host's queues. Below
deployments (a replica is placed on a host), above core
(tests/unit/test_layers.py)."""
