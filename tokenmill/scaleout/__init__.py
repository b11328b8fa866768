"""Scale-out: a model's replicas on Ray Serve behind one OpenAI-compatible endpoint.

``tokenmill serve MODEL --replicas N`` (deploy.py): the front (tokenmill's HTTP server: auth,
quotas, budgets, metrics) hands engine requests to RemoteEngine (remote.py), which sends them to
EngineReplica deployments (replica.py) through Ray Serve, routed by PrefixRequestRouter
(ray_router.py) running the prefix-aware policy (policy.py) on the replicas' reported block hashes.
simulate.py replays workloads through the same policy at any replica count. docs/scale-out.md
has the design.
"""
