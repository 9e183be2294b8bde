"""Deployment on Ray: a head server and one relay per node, as Ray actors.

the ``ray`` extra (``pip install 'ray[default]'``), then, in the driver::

    import ray, tensorshare.ray
    ray.init()
    deployment = tensorshare.ray.start(token=...)    # head on this node, a relay on every node
    trainer = RLTrainer(*deployment.head, experiment="x")

and in any Ray task or actor::

    worker = RLWorker(*tensorshare.ray.local_address(), experiment="x")

Every server is an actor pinned to its node (``NodeAffinitySchedulingStrategy``,
hard) that Ray restarts if it dies (``max_restarts=-1``); each runs the server in
its own process on the reactor thread (:class:`tensorshare_server.EmbeddedServer`).
A restarted server binds the port it had (remembered in a file on its node), so
clients reconnect by themselves; a restarted relay fetches its bins again from the
head.  :func:`local_address` finds this node's relay by its actor name, so
workers read parameters through same-host zero-copy and each version crosses the
network once per node.  Nodes that join after :func:`start` get a relay from
:meth:`Deployment.refresh`.

The servers listen on the node's address, which every host that reaches the node
reaches too: :func:`start` needs a token (``token=``, or ``TENSORSHARE_TOKEN`` in the
driver's environment, which Ray's workers usually share) unless the servers listen
on loopback only (``host="127.0.0.1"``, a one-node cluster) or ``allow_anyone=True``
says that serving anyone who reaches the port is meant (logged as a warning).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from .errors import UsageError
from .protocol.auth import resolve_token

log = logging.getLogger("tensorshare")

NAMESPACE = "tensorshare"
_HEAD = "tensorshare-head-{deployment}"
_RELAY = "tensorshare-relay-{deployment}-{node}"


def _ray():
    try:
        import ray
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("tensorshare.ray needs Ray: the ray extra: pip install 'ray[default]'") from exc
    return ray


class _Server:
    """The actor: one tensorshare server (head or relay) in this actor's process."""

    def __init__(self, name: str, settings: dict):
        from tensorshare_server import EmbeddedServer

        ray = _ray()
        self.host = settings.pop("host", None) or ray.util.get_node_ip_address()
        # The port this server had before a restart (same node: same file), so its
        # clients find it again; else any free port.
        self._port_file = os.path.join(tempfile.gettempdir(), f"{name}-{os.getuid()}.port")
        port = 0
        try:
            with open(self._port_file) as f:
                port = int(f.read().strip() or 0)
        except (OSError, ValueError):
            pass
        try:
            self.server = EmbeddedServer(port=port, host=self.host, **settings)
        except Exception:
            if not port:
                raise
            self.server = EmbeddedServer(port=0, host=self.host, **settings)  # the old port is taken
        with open(self._port_file, "w") as f:
            f.write(str(self.server.port))
        self.started = time.time()

    def address(self) -> tuple[str, int]:
        return self.host, self.server.port

    def info(self) -> dict:
        return {"address": self.address(), "pid": os.getpid(), "started": self.started,
                "tls_fingerprint": self.server.tls_fingerprint}


@dataclass
class Deployment:
    """What :func:`start` made: the head's address and one relay per node."""

    name: str
    head: tuple[str, int]
    head_actor: Any
    relays: dict[str, Any] = field(default_factory=dict)  # node id -> relay actor
    settings: dict = field(default_factory=dict)
    relay_settings: dict = field(default_factory=dict)

    def relay_address(self, node_id: str) -> tuple[str, int]:
        return _ray().get(self.relays[node_id].address.remote())

    def refresh(self) -> list[str]:
        """Start relays on nodes that joined since; returns their node ids."""
        ray = _ray()
        added = []
        for node in ray.nodes():
            node_id = node["NodeID"]
            if node.get("Alive") and node_id not in self.relays:
                self.relays[node_id] = _relay_actor(self, node_id)
                added.append(node_id)
        ray.get([self.relays[n].address.remote() for n in added])
        return added

    def stop(self) -> None:
        """Kill the relays and the head (no restart)."""
        ray = _ray()
        for actor in [*self.relays.values(), self.head_actor]:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already gone
                pass
        self.relays.clear()


def _actor_class():
    ray = _ray()
    return ray.remote(max_restarts=-1, max_task_retries=-1, num_cpus=0)(_Server)


def _placed(node_id: str) -> dict:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)}


def _relay_actor(deployment: Deployment, node_id: str):
    name = _RELAY.format(deployment=deployment.name, node=node_id)
    settings = {**deployment.relay_settings, "follow": f"{deployment.head[0]}:{deployment.head[1]}"}
    return _actor_class().options(name=name, namespace=NAMESPACE, get_if_exists=True,
                                  **_placed(node_id)).remote(name, settings)


def start(name: str = "default", *, head_node: str | None = None, follow_bins: str = "*",
          token: str | bytes | None = None, relays: bool = True, allow_anyone: bool = False,
          **settings) -> Deployment:
    """Start the head server (on ``head_node``, default: this driver's node) and a
    relay on every live node, following it; returns the :class:`Deployment`.

    ``settings`` are :class:`tensorshare_server.ServerConfig` fields for the head
    (``data_dir``, ``memory_limit``, ``tls_cert``, ``host``...); ``token`` (default:
    ``TENSORSHARE_TOKEN``) guards every server and is what the relays prove upstream.
    Without one, :class:`~tensorshare.errors.UsageError` unless ``host`` is a loopback
    address or ``allow_anyone=True`` (see the module docstring).  Several deployments
    may run side by side under different ``name``s."""
    token = _token(token, settings.get("host"), allow_anyone)
    ray = _ray()
    if not ray.is_initialized():
        ray.init()
    head_node = head_node or ray.get_runtime_context().get_node_id()
    head_name = _HEAD.format(deployment=name)
    head_settings = {**settings, "token": token}
    head_actor = _actor_class().options(name=head_name, namespace=NAMESPACE, get_if_exists=True,
                                        **_placed(head_node)).remote(head_name, dict(head_settings))
    head_info = ray.get(head_actor.info.remote())
    head = tuple(head_info["address"])
    relay_settings = {"token": token, "follow_bins": follow_bins}
    for key in ("tls_cert", "tls_key", "zero_copy", "memory_limit", "host"):
        if key in settings:
            relay_settings[key] = settings[key]
    if head_info["tls_fingerprint"]:  # the relays pin the head's certificate
        relay_settings["follow_tls_fingerprint"] = head_info["tls_fingerprint"]
    deployment = Deployment(name, head, head_actor, settings=head_settings, relay_settings=relay_settings)
    if relays:
        deployment.refresh()
    return deployment


def _token(token: str | bytes | None, host: str | None, allow_anyone: bool) -> bytes | None:
    """The deployment's token; refuses none where the servers listen beyond loopback."""
    token = resolve_token(token)
    if token is not None or _loopback(host):
        return token
    if not allow_anyone:
        raise UsageError("tensorshare.ray.start() needs a token: its servers listen on the node's address, "
                         "where anyone who reaches the node could read and change every bin. Pass token=... "
                         "(or set TENSORSHARE_TOKEN), host='127.0.0.1' for a one-node cluster, or "
                         "allow_anyone=True to serve everyone who reaches the port")
    log.warning("tensorshare.ray: the servers listen on the nodes' addresses without a token "
                "(allow_anyone=True): anyone who reaches a node can read and change every bin")
    return None


def _loopback(host: str | None) -> bool:
    if host is None:
        return False  # the node's address
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def local_address(name: str = "default", timeout: float = 60.0) -> tuple[str, int]:
    """``(host, port)`` of this node's relay of deployment ``name`` (its head if this
    node has none): call it inside a Ray task or actor."""
    ray = _ray()
    node_id = ray.get_runtime_context().get_node_id()
    try:
        actor = ray.get_actor(_RELAY.format(deployment=name, node=node_id), namespace=NAMESPACE)
    except ValueError:
        actor = ray.get_actor(_HEAD.format(deployment=name), namespace=NAMESPACE)
    return tuple(ray.get(actor.address.remote(), timeout=timeout))


def head_address(name: str = "default", timeout: float = 60.0) -> tuple[str, int]:
    """``(host, port)`` of deployment ``name``'s head server (for the trainer)."""
    ray = _ray()
    actor = ray.get_actor(_HEAD.format(deployment=name), namespace=NAMESPACE)
    return tuple(ray.get(actor.address.remote(), timeout=timeout))


__all__ = ["Deployment", "start", "local_address", "head_address"]
