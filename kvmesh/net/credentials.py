"""The names kvmesh.net.credentials held before membership became the kvmesh.net.mesh package, for
the importers outside kvmesh.net that still use them (import from kvmesh.net.mesh.* instead)."""

from kvmesh.net.mesh.credentials import MeshCredentials, load_credentials
from kvmesh.net.mesh.enrolment import export_bundle, init_mesh, join_mesh, renew, renew_if_due, write_authority
from kvmesh.net.mesh.pki import issue_node_cert

__all__ = [
    "MeshCredentials",
    "export_bundle",
    "init_mesh",
    "issue_node_cert",
    "join_mesh",
    "load_credentials",
    "renew",
    "renew_if_due",
    "write_authority",
]
