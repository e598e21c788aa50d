"""The CPU run's router (recipes/local/cpu/router.py) against verl 0.9.1's own, on the same
requests, and what it is for: a router process that imports no verl."""

import random
import subprocess
import sys

import pytest

from recipes.local.cpu import router
from recipes.local.cpu.router import LightRequestLoadBalancer
from tests.support.run_specs import spec_of

pytestmark = pytest.mark.no_mcore


def _script(balancer) -> list:
    """Every answer and the state after each call, over sticky repeats, ties, releases, a
    removed server (its sticky requests move), an added one, a cleared cache and an LRU
    eviction (max 3 sticky entries)."""
    random.seed(0)
    seen = []

    def note(answer):
        seen.append((answer, balancer.get_status(), balancer.get_total_inflight()))

    for request in ["a", "b", "c", "a", "d", "b", "e"]:
        note(balancer.acquire_server(request))
    note(balancer.release_server("s1"))
    note(balancer.release_server("s0", request_id="a"))
    note(balancer.release_server("gone"))
    note(balancer.remove_servers(["s1"]))
    for request in ["b", "a", "f"]:
        note(balancer.acquire_server(request))
    note(balancer.add_servers({"s2": "h2"}))
    for request in ["g", "h", "a"]:
        note(balancer.acquire_server(request))
    note(balancer.clear_sticky_cache())
    for request in ["a", "b"]:
        note(balancer.acquire_server(request))
    note((balancer.get_all_servers(), balancer.get_inflight_count("s0")))
    note((balancer.require_acquire_fields(), balancer.require_release_fields()))
    balancer.remove_servers(["s0", "s2"])
    with pytest.raises(RuntimeError, match="No available servers in load balancer"):
        balancer.acquire_server("z")
    return seen


def test_routes_as_verls_router_does():
    """Bug caught: a router that balances, sticks or counts otherwise than verl's (a rollout
    skewed to one of two engines at world 2, multi-turn requests losing their server)."""
    from verl.workers.rollout.router import GlobalRequestLoadBalancer

    servers = {"s0": "h0", "s1": "h1"}
    verls = GlobalRequestLoadBalancer(servers, max_cache_size=3)
    ours = LightRequestLoadBalancer(servers, {"max_cache_size": 3})
    assert _script(ours) == _script(verls)


def test_a_verl_whose_router_grew_a_method_is_refused(monkeypatch):
    """The protocol check passes on the installed verl; a method verl's router gains (one a
    trainer may call) is named in one line."""
    from verl.workers.rollout.router import GlobalRequestLoadBalancer

    router.check_protocol()
    monkeypatch.setattr(GlobalRequestLoadBalancer, "drain", lambda self: None, raising=False)
    with pytest.raises(router.RouterProtocolMoved, match=r"has drain, which .*router\.py lacks"):
        router.check_protocol()


def test_its_process_imports_no_verl_and_the_cpu_run_selects_it(tmp_path):
    """The point of the class: loading it (as Ray's router process does) imports neither verl
    nor torch; and the CPU run's composed config names the YAML that verl's own loader
    resolves to it."""
    from verl.workers.rollout.router import _load_router_yaml, _resolve_router_class

    from recipes.dapo.job import overrides
    from recipes.launcher import resolution
    from recipes.launcher.verl_schema import compose
    from recipes.local.cpu_overrides import ROUTER_YAML

    probe = "import sys, recipes.local.cpu.router as r; "
    probe += "print(sorted({m.split('.')[0] for m in sys.modules} & {'verl', 'torch', 'ray'}))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
    spec = spec_of(["--ckpt-dir", str(tmp_path), "--dry-run"])
    cli = overrides.to_cli(resolution.resolve_local(spec).groups)
    path = compose([item for item in cli if "<" not in item]).actor_rollout_ref.rollout
    assert path.router_config_path == str(ROUTER_YAML)
    loaded = _resolve_router_class(_load_router_yaml(path.router_config_path)["router_class"])
    assert loaded is LightRequestLoadBalancer
