"""Membership with one authority, against real daemons on loopback: the CA key stays with the Mac
that made the mesh, a join token works once, no member can make an identity or an over-long
certificate, and a removed node is refused by every member once the revocation list has spread."""

import concurrent.futures
import datetime
import time

import grpc
import pytest
from cryptography import x509

from kvmesh.errors import CredentialsError, PeerError
from kvmesh.net import authority
from kvmesh.net.client import PeerClient
from kvmesh.net.credentials import MeshCredentials, init_mesh, issue_node_cert, join_mesh, make_request, renew
from kvmesh.net.node_id import node_id
from kvmesh.net.revocation import Revocations, read_list, sign_list
from kvmesh.paths import mesh_dir
from support.membership import credentials, join, join_address, minted
from support.processes import cli
from support.waiting import wait_for

FAST = ("--health-interval", "0.3", "--revocation-interval", "0.3")


def info_code(address: str, creds: MeshCredentials) -> str:
    """ "ok", or the status a call with `creds` gets ("unavailable": the handshake was refused)."""
    with PeerClient(address, timeout=5.0, credentials=creds) as client:
        try:
            client.info()
            return "ok"
        except PeerError as e:
            return e.code.name.lower() if e.code else "error"


# Fast: the authority's rules on their own (files only, no process).


def test_a_token_is_redeemed_once_and_a_bad_proof_leaves_it_for_the_real_joiner(tmp_path):
    a = tmp_path / "a"
    init_mesh(a, node_id(a))
    token, _ = authority.make_token(a)
    _, csr = make_request("0123456789abcdef")
    with pytest.raises(authority.JoinRefused, match="does not match"):
        authority.admit(a, token.token_id, csr, b"x" * 32, days=30)
    cert, _ = authority.admit(a, token.token_id, csr, authority.join_proof(token.secret, token.token_id, csr), days=30)
    assert x509.load_pem_x509_certificate(cert).subject.rfc4514_string() == "CN=0123456789abcdef"
    _, other = make_request("fedcba9876543210")
    with pytest.raises(authority.JoinRefused, match="this join token was used at"):
        authority.admit(a, token.token_id, other, authority.join_proof(token.secret, token.token_id, other), days=30)
    # A second token cannot take over an identity already issued.
    second, _ = authority.make_token(a)
    again = authority.join_proof(second.secret, second.token_id, csr)
    with pytest.raises(authority.JoinRefused, match="already a member"):
        authority.admit(a, second.token_id, csr, again, days=30)
    expired, _ = authority.make_token(a, hours=-1)
    with pytest.raises(authority.JoinRefused, match="expired"):
        authority.admit(
            a, expired.token_id, other, authority.join_proof(expired.secret, expired.token_id, other), days=30
        )
    with pytest.raises(CredentialsError, match="not a kvmesh join token"):
        authority.JoinToken.parse("kvmesh-join-v1:abc")


def test_the_join_port_sits_beside_the_peer_port():
    from kvmesh.net.member import join_port_for

    assert [join_port_for(-1, 7077), join_port_for(-1, 9000), join_port_for(-1, 0), join_port_for(7100, 0)] == [
        7078,
        9001,
        0,
        7100,
    ]


def test_only_the_authority_makes_tokens_removes_members_or_signs(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    init_mesh(a, node_id(a))
    authority.enrol(a, b, node_id(b))
    assert not (mesh_dir(b) / "ca.key").exists()
    for attempt in (lambda: authority.make_token(b), lambda: authority.remove(b, node_id(a))):
        with pytest.raises(authority.NotAuthority, match="only the mesh's authority"):
            attempt()
    assert (mesh_dir(a) / "ca.key").stat().st_mode & 0o077 == 0
    assert (mesh_dir(a) / "tokens.json").stat().st_mode & 0o077 == 0
    with pytest.raises(CredentialsError, match="cannot remove itself"):
        authority.remove(a, node_id(a))


def test_a_revocation_list_is_adopted_only_when_the_ca_signed_it_and_it_is_newer(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    init_mesh(a, node_id(a))
    member = authority.enrol(a, b, node_id(b))
    held = Revocations(b, member.trust_pem)
    first = authority.remove(a, "1111111111111111")
    assert held.adopt(first.to_bytes(), source="a") and held.revoked("1111111111111111")
    # A member's key signs no list the others take, whatever its version.
    forged = sign_list(member.key_pem, 99, ())
    assert not held.adopt(forged.to_bytes(), source="a member")
    # Nor is an older list taken back (no one is unrevoked).
    authority.remove(a, "2222222222222222")
    assert held.version == 1 and not held.adopt(first.to_bytes(), source="a")
    assert held.reload() is False  # b's data dir still holds version 1
    assert read_list(b).version == 1 and read_list(a).version == 2


# Slow: real daemons.


@pytest.fixture
def mesh(tmp_path, daemons):
    """A's daemon, the authority's, running; B joined through it."""
    a, b = tmp_path / "a", tmp_path / "b"
    init_mesh(a, node_id(a))
    daemon_a = daemons.start(a, *FAST, "--peer-rate", "5", log=tmp_path / "a.log")
    join(a, b)
    return a, b, daemon_a


def test_a_join_token_works_once_and_only_once(mesh, tmp_path):
    a, b, daemon_a = mesh
    token = cli("mesh", "token", data_dir=a).stdout.strip()
    address = join_address(a)
    joined = cli("mesh", "join", token, address, data_dir=tmp_path / "c")
    assert "joined the mesh" in joined.stdout
    c = credentials(tmp_path / "c")
    assert not (mesh_dir(tmp_path / "c") / "ca.key").exists()  # a member never holds the CA key
    cert = x509.load_pem_x509_certificate(c.cert_pem)
    assert cert.subject.rfc4514_string() == f"CN={node_id(tmp_path / 'c')}"
    assert cert.not_valid_after_utc - cert.not_valid_before_utc <= datetime.timedelta(days=30)
    assert info_code(daemon_a.address, c) == "ok"

    again = cli("mesh", "join", token, address, data_dir=tmp_path / "d", check=False)
    assert again.returncode == 1 and "this join token was used at" in again.stderr
    assert credentials(tmp_path / "c").cert_pem == c.cert_pem and not (mesh_dir(tmp_path / "d") / "node.pem").exists()

    # Eight Macs racing with one token: exactly one gets in.
    fresh, _ = authority.make_token(a)
    racers = [tmp_path / f"r{i}" for i in range(8)]

    def race(data_dir):
        try:
            join_mesh(data_dir, node_id(data_dir), str(fresh), address)
            return "joined"
        except authority.JoinRefused as e:
            return str(e)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(race, racers))
    assert outcomes.count("joined") == 1, outcomes
    assert all("this join token was used at" in o for o in outcomes if o != "joined")

    # A token of another mesh, or an authority that is not the token's, gets nowhere.
    other = tmp_path / "other"
    init_mesh(other, node_id(other))
    foreign, _ = authority.make_token(other)
    with pytest.raises(authority.JoinRefused, match="unknown join token"):
        join_mesh(tmp_path / "e", node_id(tmp_path / "e"), str(foreign), address)
    # A Mac that made a mesh of its own joins this one only with --replace, and its CA key goes.
    with pytest.raises(CredentialsError, match="already belongs to a mesh"):
        join_mesh(other, node_id(other), str(authority.make_token(a)[0]), address)
    join_mesh(other, node_id(other), str(authority.make_token(a)[0]), address, replace=True)
    assert not (mesh_dir(other) / "ca.key").exists() and not (mesh_dir(other) / "tokens.json").exists()
    assert info_code(daemon_a.address, credentials(other)) == "ok"
    log = daemon_a.log.read_text()
    assert log.count("admitted a new member") == 4 and "refused a join" in log


def test_a_member_cannot_mint_identities(mesh, tmp_path):
    """Before: every member held the CA key, so B published as another member and passed a 5 calls/s
    limit 100 of 100 times with 100 made-up ids. Now B has only its own key: every certificate it
    makes is refused at the handshake."""
    a, b, daemon_a = mesh
    member = credentials(b)
    assert not (mesh_dir(b) / "ca.key").exists()
    refused = cli("mesh", "token", data_dir=b, check=False)
    assert refused.returncode == 1 and "only the mesh's authority" in refused.stderr
    assert info_code(daemon_a.address, member) == "ok"

    codes = [info_code(daemon_a.address, minted(member, f"{i:016x}")) for i in range(100)]
    assert codes.count("ok") == 0, codes
    assert set(codes) == {"unavailable"}  # no call at all: the handshake fails
    # Nor does a chain through B's own certificate (a node certificate is no CA).
    assert info_code(daemon_a.address, minted(member, node_id(a), chain=True)) == "unavailable"
    # The refusals are in the log as kvmesh's own line (gRPC's are kept out of it).
    assert "failed the TLS handshake" in daemon_a.log.read_text()


def test_a_100_year_certificate_is_refused_and_never_issued(mesh, tmp_path):
    """Before: a 100-year certificate (made with the CA key every member held) was accepted. A
    certificate longer than `max_certificate_days` is refused at every call, whoever signed it."""
    a, b, daemon_a = mesh
    ca = mesh_dir(a)
    key, cert = issue_node_cert(
        (ca / "ca.key").read_bytes(), (ca / "trust.pem").read_bytes(), "abcdefabcdefabcd", days=36500
    )
    century = MeshCredentials((ca / "trust.pem").read_bytes(), key, cert)
    assert info_code(daemon_a.address, century) == "permission_denied"
    assert "lasts 36500 days, more than this mesh's 31" in daemon_a.log.read_text()
    # A member asking for a century gets what the authority grants (its certificate_days).
    renewed = renew(b, node_id(b), days=36500)
    lifetime = x509.load_pem_x509_certificate(renewed.cert_pem)
    assert lifetime.not_valid_after_utc - lifetime.not_valid_before_utc <= datetime.timedelta(days=30)
    assert info_code(daemon_a.address, renewed) == "ok"


def test_a_removed_node_is_refused_by_every_member_once_the_list_spreads(mesh, tmp_path, daemons):
    """A (the authority) - B - C in a line (each knows only its neighbour), and D, the Mac to
    remove. After `kvmesh mesh remove D` on A, A refuses D at once, B once it has asked A, C once
    it has asked B; D cannot renew either."""
    a, b, daemon_a = mesh
    c, d = tmp_path / "c", tmp_path / "d"
    join(a, c)
    join(a, d)
    daemon_b = daemons.start(b, *FAST, "--peer", daemon_a.address, log=tmp_path / "b.log")
    daemon_c = daemons.start(c, *FAST, "--peer", daemon_b.address, log=tmp_path / "c.log")
    members = {"a": daemon_a, "b": daemon_b, "c": daemon_c}
    removed = credentials(d)
    assert {name: info_code(m.address, removed) for name, m in members.items()} == dict.fromkeys(members, "ok")

    start = time.monotonic()
    out = cli("mesh", "remove", node_id(d)[:6], data_dir=a).stdout
    assert f"removed {node_id(d)} from the mesh (revocation list version 1)" in out
    refused_after = {}
    for name, member in members.items():
        wait_for(lambda m=member: info_code(m.address, removed) == "permission_denied", 20, 0.1, f"{name} to refuse D")
        refused_after[name] = time.monotonic() - start
    print("refused D after (s):", {k: round(v, 2) for k, v in refused_after.items()})
    # Members still serve each other, and their own data dirs keep the list across restarts.
    assert info_code(daemon_c.address, credentials(b)) == "ok"
    assert read_list(c).version == 1 and node_id(d) in read_list(c).node_ids
    with pytest.raises(authority.JoinRefused, match="was removed from this mesh"):
        renew(d, node_id(d))
    assert "revocation list version 1 from peer" in daemon_c.log.read_text()
    assert f"node {node_id(d)} was removed from the mesh" in daemon_b.log.read_text()


def test_the_health_service_refuses_a_removed_node_too(mesh, tmp_path):
    """The check runs before every service of the peer port, not only kvmesh's own."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvmesh.net.transport import open_channel

    a, b, daemon_a = mesh
    authority.remove(a, node_id(b))
    with open_channel(daemon_a.address, credentials(b)) as channel:
        stub = health_pb2_grpc.HealthStub(channel)

        def refused() -> bool:
            try:
                stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
                return False
            except grpc.RpcError as e:
                return e.code() == grpc.StatusCode.PERMISSION_DENIED

        wait_for(refused, 10, 0.1, "A to refuse B's health checks")
