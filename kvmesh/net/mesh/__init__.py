"""Mesh membership, in layers that import one way, each only from those above it in this list:

- `pki`: keys, certificates, CSRs and their checks (no files, no network);
- `layout`: the mesh directory (`MeshDir`: every file in `<data dir>/mesh/`, written atomically);
- `credentials`: this node's certificate, key and trusted CA as it holds them;
- `revocation`: the CA-signed list of removed nodes;
- `authority`: what only the Mac holding the CA key does (tokens, signing, removing);
- `admission`: the peer port's check of every caller against the list;
- `gossip`: the list spread between members (over kvmesh.net.transport);
- `membership`: the Membership gRPC service, the authority's join port, and the calls to it;
- `member`: what a daemon runs of all this;
- `enrolment`: the join and renewal workflows, `init_mesh`, and `renewing`'s long-lived credentials.
"""
