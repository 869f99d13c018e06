"""The name kvmesh.net.authority gave importers outside kvmesh.net before membership became the
kvmesh.net.mesh package (import kvmesh.net.mesh.enrolment's `enrol` instead)."""

from kvmesh.net.mesh.enrolment import enrol

__all__ = ["enrol"]
