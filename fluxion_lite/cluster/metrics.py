"""The cluster's /metrics: every replica's Prometheus text with a `replica` label, plus the ingress's own counters.

Prometheus' text format wants each metric family's samples in one group after its HELP and TYPE lines, so the
replicas' texts are merged family by family rather than concatenated.
"""
from __future__ import annotations

import re
from collections.abc import Sequence

from fluxion_lite.cluster.routing import Router

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?(\s.*)$")


def with_label(line: str, name: str, value: str) -> str:
    """A sample line with name="value" added to its labels (comments and blank lines as they are)."""
    m = _SAMPLE.match(line)
    if not m or line.startswith("#"):
        return line
    metric, labels, rest = m.group(1), m.group(2), m.group(3)
    pair = f'{name}="{value}"'
    labels = "{" + pair + "}" if not labels or labels == "{}" else "{" + pair + "," + labels[1:]
    return metric + labels + rest


def merge_replicas(texts: Sequence[tuple[int, str]]) -> str:
    """(replica index, its /metrics text) -> one text, families grouped, samples labelled replica="i"."""
    families: dict[str, tuple[list[str], list[str]]] = {}  # family -> (HELP/TYPE lines, samples)
    for index, text in texts:
        family = ""
        for line in text.splitlines():
            if not line.strip():
                continue
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                family = line.split()[2]
                head, _ = families.setdefault(family, ([], []))
                if line not in head:
                    head.append(line)
                continue
            if line.startswith("#"):
                continue
            m = _SAMPLE.match(line)
            if m and not family:
                family = m.group(1)
            families.setdefault(family, ([], []))[1].append(with_label(line, "replica", str(index)))
    out: list[str] = []
    for head, samples in families.values():
        out.extend(head)
        out.extend(samples)
    return "\n".join(out) + "\n" if out else ""


def ingress_metrics(router: Router) -> str:
    """The ingress's own families: routed requests, failures and state per replica, 503s by reason."""
    lines = ["# HELP fluxion_cluster_routed_total Requests the ingress sent to each replica.",
             "# TYPE fluxion_cluster_routed_total counter"]
    lines += [f'fluxion_cluster_routed_total{{replica="{r.index}"}} {r.routed}' for r in router.replicas]
    lines += ["# HELP fluxion_cluster_replica_failures_total Calls to a replica that failed (it died or was "
              "unreachable).", "# TYPE fluxion_cluster_replica_failures_total counter"]
    lines += [f'fluxion_cluster_replica_failures_total{{replica="{r.index}"}} {r.failures}' for r in router.replicas]
    lines += ["# HELP fluxion_cluster_replica_up Whether a replica takes new requests (1) or not (0).",
              "# TYPE fluxion_cluster_replica_up gauge"]
    lines += [f'fluxion_cluster_replica_up{{replica="{r.index}"}} {int(r.up)}' for r in router.replicas]
    lines += ["# HELP fluxion_cluster_in_flight Requests forwarded to a replica and not finished.",
              "# TYPE fluxion_cluster_in_flight gauge"]
    lines += [f'fluxion_cluster_in_flight{{replica="{r.index}"}} {r.in_flight}' for r in router.replicas]
    lines += ["# HELP fluxion_cluster_rejected_total Requests answered 503 by the ingress, by reason.",
              "# TYPE fluxion_cluster_rejected_total counter",
              f'fluxion_cluster_rejected_total{{reason="full"}} {router.rejected_full}',
              f'fluxion_cluster_rejected_total{{reason="no_replica_up"}} {router.rejected_down}']
    return "\n".join(lines) + "\n"
