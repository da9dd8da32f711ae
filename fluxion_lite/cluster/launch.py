"""`fluxion-lite serve --replicas N` and the Ray Serve application behind it.

build_app(options) is a Ray Serve application builder: N engine replicas (replica.py), each a deployment of its own
with one replica, so the ingress (ingress.py) can send a conversation to the one that holds it, and Ray restarts a
replica that dies. A config file for a real cluster names it as its import path (docs/cluster.md):

    applications:
      - name: fluxion
        route_prefix: /
        import_path: fluxion_lite.cluster.launch:build_app
        args: {model: qwen2.5-coder-1.5b, replicas: 8, device: cuda}

serve_cluster(args) is the command on one host: a local Ray instance, each replica an application of its own, and
the same ingress served by uvicorn in the command's process (it answers 503 while the replicas start, where Ray's
own HTTP proxy would answer 404 until the application exists). Ctrl-C or SIGTERM stops everything it started.
"""
from __future__ import annotations

import logging
import threading
from typing import Any

from fluxion_lite.cluster.ingress import ClusterIngress
from fluxion_lite.cluster.replica import EngineReplica
from fluxion_lite.errors import FluxionError

log = logging.getLogger("fluxion_lite.cluster")

ENGINE_OPTIONS = ("model", "device", "dtype", "attention", "max_batch", "max_queue", "max_context", "prefill_chunk",
                  "default_max_tokens")
HEALTH_CHECK_PERIOD_S = 2.0  # Ray Serve's check of each replica: a dead one is replaced within a few seconds


def cpu_cores() -> int:
    from fluxion_lite.hostkv.native import physical_cores

    return physical_cores()


def replica_resources(device: str, replicas: int, threads: int | None, cores: int) -> tuple[dict[str, Any], int]:
    """(Ray actor options, native threads) of one replica: a GPU each on CUDA; on the CPU an equal share of the
    cores (at least one), reserved with Ray so that replicas never share a core."""
    if device.startswith("cuda"):
        return {"num_gpus": 1, "num_cpus": 1}, threads or max(1, cores // replicas)
    share = threads or max(1, cores // replicas)
    return {"num_cpus": share}, share


def _replica_deployment(options: dict[str, Any]) -> tuple[Any, dict[str, Any], int]:
    """(the EngineReplica deployment with its resources, the replica's options, its capacity) from build_app's
    options."""
    from ray import serve

    replicas = int(options.get("replicas") or 2)
    if replicas < 1:
        raise FluxionError(f"replicas {replicas}: must be >= 1")
    device = str(options.get("device") or "cpu")
    cores = int(options.get("cores") or cpu_cores())
    actor, threads = replica_resources(device, replicas, options.get("threads"), cores)
    engine = {k: options[k] for k in ENGINE_OPTIONS if options.get(k) is not None}
    engine.setdefault("model", "smollm2-135m")
    engine["threads"] = threads  # torch's intra-op threads in the replica (server/app.py), as many as its pool's
    flags = dict(options.get("settings") or {})
    flags.setdefault("threads", str(threads))
    capacity = int(engine.get("max_batch") or 16) + int(engine.get("max_queue") or 64)
    deployment = serve.deployment(EngineReplica).options(
        num_replicas=1, ray_actor_options=actor, max_ongoing_requests=capacity + 32,
        health_check_period_s=HEALTH_CHECK_PERIOD_S, health_check_timeout_s=10, graceful_shutdown_timeout_s=5)
    return deployment, {**engine, "settings_flags": flags}, capacity


def build_app(options: dict[str, Any]) -> Any:
    """The Ray Serve application, ingress included (a config file's import path). options: `replicas` (default
    2), `threads` (per replica; default: the cores shared out), `api_key`, `settings` (setting name -> value, over
    each replica's environment), and serve's engine options (ENGINE_OPTIONS)."""
    from ray import serve

    deployment, replica_options, capacity = _replica_deployment(options)
    nodes = [deployment.options(name=f"replica{i}").bind(replica_options)
             for i in range(int(options.get("replicas") or 2))]
    ingress = serve.deployment(serve.ingress()(ClusterIngress)).options(
        name="ingress", num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=100_000)
    return ingress.bind(nodes, {"api_key": options.get("api_key"), "capacity": capacity,
                                "max_body_bytes": options.get("max_body_bytes")})


class LazyHandle:
    """A replica application's DeploymentHandle, looked up when first used: the command serves (503s) before its
    replicas are deployed, and a lookup that fails counts as the replica not being up yet."""

    def __init__(self, app_name: str, deployment: str = "EngineReplica") -> None:
        self.app_name, self.deployment = app_name, deployment
        self._handle: Any = None

    def __getattr__(self, name: str) -> Any:
        if self._handle is None:
            from ray import serve

            self._handle = serve.get_deployment_handle(self.deployment, app_name=self.app_name)
        return getattr(self._handle, name)


def serve_cluster(args: Any, settings_flags: dict[str, Any]) -> int:
    """`fluxion-lite serve --replicas N`: Ray on this host with each replica an application of its own, and the
    ingress served by uvicorn in this process on args.host:args.port (answering 503 until a replica is ready)."""
    try:
        import ray
        import uvicorn
        from ray import serve

        from fluxion_lite.server.app import is_loopback
    except ModuleNotFoundError as exc:
        raise FluxionError("--replicas needs Ray Serve: pip install 'fluxion-lite[cluster]'") from exc

    host, port = args.host or "127.0.0.1", int(args.port or 8080)
    replicas = int(args.replicas)
    cores = cpu_cores()
    device = args.device or "cpu"
    _, threads = replica_resources(device, replicas, getattr(args, "threads", None), cores)
    if device.startswith("cuda"):
        import torch

        if torch.cuda.device_count() < replicas:
            raise FluxionError(f"--replicas {replicas} on {device}: each replica needs a GPU of its own, and this host "
                               f"has {torch.cuda.device_count()} (for more, run Ray on several hosts: docs/cluster.md)")
    if device == "cpu" and replicas * threads > cores:
        log.warning("%d replicas x %d threads is more than the %d cores here: replicas will share cores",
                    replicas, threads, cores)
    options = {k: getattr(args, k, None) for k in ENGINE_OPTIONS}
    api_key = settings_flags.pop("api_key", None)
    options.update(replicas=replicas, threads=threads, settings=settings_flags, cores=cores)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not is_loopback(host) and not api_key:
        log.warning("binding to %s without --api-key: anyone who can reach this address can use the model", host)
    log.info("starting Ray and %d replicas of %s (%s, %d threads each)", replicas, options["model"], device, threads)
    ray.init(num_cpus=max(cores, replicas * threads), include_dashboard=False, logging_level=logging.WARNING,
             object_store_memory=256 << 20, log_to_driver=args.log_level in ("info", "debug"))
    deployment, replica_options, capacity = _replica_deployment(options)
    apps = [f"fluxion-replica{i}" for i in range(replicas)]
    ingress = ClusterIngress([LazyHandle(a) for a in apps], {"api_key": api_key, "capacity": capacity})

    def deploy() -> None:
        serve.start(proxy_location="Disabled", logging_config={"log_level": "WARNING"})
        for app in apps:
            serve.run(deployment.bind(replica_options), name=app, route_prefix=None, blocking=False)

    deployer = threading.Thread(target=deploy, name="deploy-replicas", daemon=True)
    deployer.start()
    log.info("serving on http://%s:%d (replicas load in the background; /health says when one is ready)", host,
             port)
    try:
        uvicorn.run(ingress.asgi, host=host, port=port, log_level=args.log_level or "info",
                    timeout_graceful_shutdown=5)
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    return 0
