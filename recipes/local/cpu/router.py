"""The CPU run's request router: verl's sticky + least-in-flight routing, without verl's imports.

verl 0.9.1 routes every rollout request through one Ray actor (`GlobalRequestLoadBalancer`,
verl/workers/rollout/router.py), made after the vLLM servers are up. Its process imports verl
(torch, transformers, tensordict) to load that class: ~8 CPU seconds on the 2-core machine,
spent beside the agent-loop worker's own start-up during the first validation. verl's plugin
point for routers (`rollout.router_config_path`: a YAML naming `router_class`, built as
`router_class(servers, yaml_config)`; recipes/local/cpu/router.yaml) selects this class, whose
module imports nothing beyond the standard library: the same routing, a process that starts
in a moment. The cluster keeps verl's router.

`check_protocol` compares the methods with verl's class, so a verl release that adds one to the
protocol is refused in one line (tests/recipes/test_cpu_router.py runs it, and both classes on
the same requests).
"""

import random
from collections import OrderedDict

STICKY_ENTRIES = 10_000  # verl's DEFAULT_ROUTING_CACHE_SIZE
YAML = "router.yaml"  # beside this module


class LightRequestLoadBalancer:
    """A request's server: the one its request id last used while that server is in the pool
    (multi-turn requests keep their prefix cache), else one of the fewest in-flight requests."""

    def __init__(self, servers: dict, yaml_config: dict | None = None):
        self._servers = dict(servers)
        self._inflight = dict.fromkeys(servers, 0)
        self._sticky: OrderedDict[str, str] = OrderedDict()  # request id -> server, LRU
        self._max_sticky = int((yaml_config or {}).get("max_cache_size", STICKY_ENTRIES))

    def acquire_server(self, request_id: str) -> tuple:
        server_id = self._sticky.get(request_id)
        if server_id not in self._inflight:
            if not self._inflight:
                raise RuntimeError("No available servers in load balancer")
            fewest = min(self._inflight.values())
            server_id = random.choice([s for s, n in self._inflight.items() if n == fewest])
        self._sticky[request_id] = server_id
        self._sticky.move_to_end(request_id)
        if len(self._sticky) > self._max_sticky:
            self._sticky.popitem(last=False)
        self._inflight[server_id] += 1
        return server_id, self._servers[server_id]

    def release_server(self, server_id: str, request_id: str | None = None) -> None:
        if self._inflight.get(server_id, 0) > 0:
            self._inflight[server_id] -= 1

    def require_acquire_fields(self) -> list[str]:
        return []

    def require_release_fields(self) -> list[str]:
        return []

    def add_servers(self, servers: dict) -> None:
        for server_id, handle in servers.items():
            self._inflight[server_id], self._servers[server_id] = 0, handle

    def remove_servers(self, server_ids: list[str]) -> None:
        for server_id in server_ids:
            self._inflight.pop(server_id, None)
            self._servers.pop(server_id, None)

    def get_inflight_count(self, server_id: str) -> int:
        return self._inflight.get(server_id, 0)

    def get_all_servers(self) -> list[str]:
        return list(self._inflight)

    def get_status(self) -> dict:
        return {
            "servers": dict(self._inflight),
            "total_inflight": sum(self._inflight.values()),
            "active_servers": len(self._inflight),
            "registered_handles": list(self._servers),
        }

    def clear_sticky_cache(self) -> dict:
        cleared = len(self._sticky)
        self._sticky.clear()
        return {"cleared_entries": cleared, "server_loads": dict(self._inflight)}

    def get_total_inflight(self) -> int:
        return sum(self._inflight.values())


class RouterProtocolMoved(RuntimeError):
    """verl's router has methods this one lacks."""


def check_protocol() -> None:
    """Raise RouterProtocolMoved naming the public methods of verl's router that this class
    lacks (the ones verl's trainers may call on whichever router the config selects)."""
    from verl.workers.rollout.router import GlobalRequestLoadBalancer

    def public(cls) -> set[str]:
        return {n for n in vars(cls) if not n.startswith("_") and callable(getattr(cls, n))}

    missing = sorted(public(GlobalRequestLoadBalancer) - public(LightRequestLoadBalancer))
    if missing:
        raise RouterProtocolMoved(
            f"verl's GlobalRequestLoadBalancer has {', '.join(missing)}, which "
            "recipes/local/cpu/router.py lacks: port it, or drop the CPU run's "
            "rollout.router_config_path (recipes/local/cpu_overrides.py)"
        )
