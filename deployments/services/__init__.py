"""Every write Gantry makes goes through a function here, one module per
entity: hosts, registered models, placements, deployments, builds, telemetry.

Views, API views, consumers and worker tasks are thin doors into these
services (``<entity>_<action>``, keyword-only arguments). Status fields change
only in deployments.states; work for a host is enqueued only through
core.queues.
"""
