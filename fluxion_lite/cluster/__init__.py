"""Scale-out on Ray Serve: engine replicas behind one ingress that serves the single server's API
(`fluxion-lite serve --replicas N`; docs/cluster.md)."""
