"""The cluster's routing policy and metrics merge (pure Python: no Ray)."""
from __future__ import annotations

import json

from fluxion_lite.cluster.metrics import ingress_metrics, merge_replicas, with_label
from fluxion_lite.cluster.routing import PROMPT_KEY_CHARS, Router, affinity_key


def chat(*messages: tuple[str, str]) -> bytes:
    return json.dumps({"messages": [{"role": r, "content": c} for r, c in messages]}).encode()


def test_every_turn_of_a_chat_has_the_key_of_its_first_turn() -> None:
    first = affinity_key("/v1/chat/completions", {}, chat(("system", "be brief"), ("user", "hi")))
    later = affinity_key("/v1/chat/completions", {}, chat(("system", "be brief"), ("user", "hi"), ("assistant", "hello"),
                                                           ("user", "and then?")))
    other = affinity_key("/v1/chat/completions", {}, chat(("system", "be brief"), ("user", "bye")))
    assert first is not None and first == later and first != other


def test_session_header_wins_and_keyless_requests_route_by_load() -> None:
    body = chat(("user", "hi"))
    assert affinity_key("/v1/chat/completions", {"x-session-id": "abc"}, body) == "session:abc"
    assert affinity_key("/v1/models", {}, b"") is None
    assert affinity_key("/v1/chat/completions", {}, b"{not json") is None
    assert affinity_key("/v1/chat/completions", {}, b"[1, 2]") is None
    long = "x" * (PROMPT_KEY_CHARS + 50)
    assert affinity_key("/v1/completions", {}, json.dumps({"prompt": long}).encode()) == \
        affinity_key("/v1/completions", {}, json.dumps({"prompt": long + " more"}).encode())


def ready_router(n: int, capacity: int = 2) -> Router:
    router = Router.of(n, capacity)
    for r in router.replicas:
        r.ready = True
    return router


def test_a_key_stays_home_and_only_a_lost_replicas_keys_move() -> None:
    router = ready_router(4, capacity=100)
    keys = [f"k{i}" for i in range(200)]
    home = {k: router.pick(k).index for k in keys}
    assert len(set(home.values())) == 4  # spread over every replica
    assert all(router.pick(k).index == home[k] for k in keys)  # stable
    router.mark_failed(router.replicas[2], hold_s=60)
    moved = {k for k in keys if router.pick(k).index != home[k]}
    assert moved == {k for k in keys if home[k] == 2}


def test_full_home_falls_back_to_least_loaded_then_503() -> None:
    router = ready_router(2, capacity=2)
    home = router.pick("conv")
    home.in_flight = 2
    other = router.pick("conv")
    assert other.index != home.index
    other.in_flight = 2
    assert router.pick("conv") is None and router.rejected_full == 1
    for r in router.replicas:
        r.ready = False
    assert router.pick(None) is None and router.rejected_down == 1


def test_keyless_requests_go_to_the_least_loaded() -> None:
    router = ready_router(3, capacity=10)
    router.replicas[0].in_flight, router.replicas[1].in_flight, router.replicas[2].in_flight = 3, 1, 2
    assert router.pick(None).index == 1


def test_metrics_merge_groups_families_and_labels_replicas() -> None:
    a = "# HELP fx_x Things.\n# TYPE fx_x counter\nfx_x 3\n# HELP fx_h Hist.\n# TYPE fx_h histogram\n" \
        'fx_h_bucket{le="1"} 2\nfx_h_sum 1.5\nfx_h_count 2\n'
    b = a.replace("fx_x 3", "fx_x 4")
    merged = merge_replicas([(0, a), (1, b)]).splitlines()
    assert merged.count("# TYPE fx_x counter") == 1
    x = merged.index("# TYPE fx_x counter")
    assert merged[x + 1 : x + 3] == ['fx_x{replica="0"} 3', 'fx_x{replica="1"} 4']  # one group per family
    assert 'fx_h_bucket{replica="1",le="1"} 2' in merged
    assert with_label("# comment", "replica", "0") == "# comment"
    text = ingress_metrics(ready_router(2))
    assert 'fluxion_cluster_replica_up{replica="1"} 1' in text and 'reason="full"' in text


def test_the_config_file_builds_the_application_it_documents() -> None:
    """deploy/ray-serve.yaml names build_app with arguments it accepts: the ingress over that many replicas, each a
    GPU on CUDA (building the application starts nothing)."""
    from pathlib import Path

    import pytest

    pytest.importorskip("ray.serve")
    yaml = pytest.importorskip("yaml")
    from fluxion_lite.cluster.launch import build_app, replica_resources

    config = yaml.safe_load((Path(__file__).resolve().parents[2] / "deploy" / "ray-serve.yaml").read_text())
    (app_config,) = config["applications"]
    assert app_config["import_path"] == "fluxion_lite.cluster.launch:build_app"
    app = build_app(app_config["args"])
    ingress = app._bound_deployment
    replicas, options = ingress.init_args
    assert ingress.name == "ingress" and len(replicas) == app_config["args"]["replicas"]
    first = replicas[0]._bound_deployment
    assert first.ray_actor_options["num_gpus"] == 1 and options["api_key"] == "CHANGE-ME"
    assert first.init_args[0]["model"] == "qwen2.5-coder-1.5b" and first.init_args[0]["settings_flags"]["threads"]
    assert replica_resources("cpu", 2, None, 16) == ({"num_cpus": 8}, 8)
    assert replica_resources("cpu", 4, None, 2) == ({"num_cpus": 1}, 1)
