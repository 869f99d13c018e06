"""Membership with one authority, against real daemons on loopback: the CA key stays with the Mac
that made the mesh, a join token works once, no member can make an identity or an over-long
certificate, and a removed node is refused by every member once the revocation list has spread."""

import concurrent.futures
import datetime
import json
import time

import grpc
import pytest
from cryptography import x509
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.daemon.config import DaemonConfig
from kvmesh.daemon.control import control_status
from kvmesh.errors import CredentialsError, PeerError
from kvmesh.net.client import PeerClient
from kvmesh.net.discovery.interfaces import routable_addresses
from kvmesh.net.mesh import authority
from kvmesh.net.mesh.credentials import MeshCredentials
from kvmesh.net.mesh.enrolment import enrol, init_mesh, join_mesh, renew
from kvmesh.net.mesh.membership import request_join
from kvmesh.net.mesh.pki import issue_node_cert, make_request, names_node
from kvmesh.net.mesh.revocation import Revocations, read_list, sign_list
from kvmesh.net.node_id import node_id
from kvmesh.net.transport import open_channel
from kvmesh.paths import mesh_dir
from kvmesh.v1 import membership_pb2 as mpb
from support.idle_calls import IdleCalls
from support.membership import credentials, join, join_address, make_legacy, minted
from support.mesh import make_mesh
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
    # A second token cannot take over an identity already issued: another key for it is refused.
    second, _ = authority.make_token(a)
    _, takeover = make_request("0123456789abcdef")
    proof = authority.join_proof(second.secret, second.token_id, takeover)
    with pytest.raises(authority.JoinRefused, match="already a member, with another key"):
        authority.admit(a, second.token_id, takeover, proof, days=30)
    # The joiner's own key, though, is answered again (its first answer never arrived), with either token.
    for retry in (token, second):
        again = authority.join_proof(retry.secret, retry.token_id, csr)
        assert authority.admit(a, retry.token_id, csr, again, days=30)[0] != cert
    assert len(authority.members(a)["0123456789abcdef"]["serials"]) == 3  # one member, signed thrice
    expired, _ = authority.make_token(a, hours=-1)
    with pytest.raises(authority.JoinRefused, match="expired"):
        authority.admit(
            a, expired.token_id, other, authority.join_proof(expired.secret, expired.token_id, other), days=30
        )
    with pytest.raises(CredentialsError, match="not a kvmesh join token"):
        authority.JoinToken.parse("kvmesh-join-v1:abc")


def test_the_join_port_sits_beside_the_peer_port():
    from kvmesh.net.mesh.member import join_port_for

    assert [join_port_for(-1, 7077), join_port_for(-1, 9000), join_port_for(-1, 0), join_port_for(7100, 0)] == [
        7078,
        9001,
        0,
        7100,
    ]


def test_only_the_authority_makes_tokens_removes_members_or_signs(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    init_mesh(a, node_id(a))
    enrol(a, b, node_id(b))
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
    member = enrol(a, b, node_id(b))
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


def test_a_join_that_fails_after_the_authority_signed_can_be_retried(mesh, tmp_path):
    """Before: a join refused by the joiner after the authority signed (here: the token's CA
    fingerprint is not the mesh's) spent the token and recorded the node, and every later join of
    that Mac said "already a member". Now the Mac keeps the key it sent until it has joined, and
    the authority answers the same node's same key again: the same token, or a fresh one, works."""
    a, b, daemon_a = mesh
    c = tmp_path / "c"
    good = authority.JoinToken.parse(cli("mesh", "token", data_dir=a).stdout)
    wrong = str(authority.JoinToken(good.token_id, good.secret, bytes(32)))
    address = join_address(a)
    failures = [cli("mesh", "join", wrong, address, data_dir=c, check=False) for _ in range(2)]  # the same token twice
    assert [f.returncode for f in failures] == [1, 1] and not (mesh_dir(c) / "node.pem").exists()
    joined = cli("mesh", "join", cli("mesh", "token", data_dir=a).stdout.strip(), address, data_dir=c, check=False)
    assert joined.returncode == 0 and "joined the mesh" in joined.stdout, joined.stderr
    for failed in failures:  # the same answer, checked the same way, and what to do
        assert "is not the one the join token names" in failed.stderr, failed.stderr
        assert "make a new token on the authority (`kvmesh mesh token`), and join again" in failed.stderr
    assert "Start this Mac's daemon (`kvmesh daemon`" in joined.stdout  # none runs there: not "Restart"
    assert info_code(daemon_a.address, credentials(c)) == "ok"
    assert not (mesh_dir(c) / "join-pending.key").exists()
    # Another Mac claiming c's node id (another key) is refused, with what to do.
    impostor = tmp_path / "impostor"
    impostor.mkdir()
    (impostor / "node-id").write_text(node_id(c))
    refused = cli(
        "mesh", "join", cli("mesh", "token", data_dir=a).stdout.strip(), address, data_dir=impostor, check=False
    )
    assert refused.returncode == 1 and "already a member, with another key" in refused.stderr
    assert "delete the node-id file in its kvmesh data dir" in refused.stderr


@pytest.mark.slow
def test_a_token_made_while_the_daemon_is_down_names_a_real_address_and_says_to_start_it(tmp_path):
    """Before: `kvmesh mesh token` without the authority's daemon printed THIS_MAC_ADDRESS where
    the address goes. Now: this Mac's own address (its daemon takes joins on port 7078 there)."""
    a = tmp_path / "a"
    init_mesh(a, node_id(a))
    made = cli("mesh", "token", data_dir=a).stderr
    own = routable_addresses(None)
    line = next(line for line in made.splitlines() if line.startswith("On the new Mac: kvmesh mesh join"))
    assert line.endswith(f" {own[0] if own else 'ADDRESS'}") and "THIS_MAC_ADDRESS" not in made
    assert "This Mac's daemon is not running: start it (`kvmesh daemon`) before the new Mac joins" in made


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
    wait_for(lambda: "failed the TLS handshake" in daemon_a.log.read_text(), 20, 0.1, "A to log the handshakes")


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
    refused = "lasts 36500 days, more than this mesh's 31"
    wait_for(lambda: refused in daemon_a.log.read_text(), 20, 0.1, "A to log the refusal")
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
    wait_for(lambda: "revocation list version 1 from peer" in daemon_c.log.read_text(), 20, 0.1, "C to log the list")
    said = f"node {node_id(d)} was removed from the mesh"
    wait_for(lambda: said in daemon_b.log.read_text(), 20, 0.1, "B to log the removal")


def live_count(data_dir) -> int:
    return sum(p.healthy for p in control_status(data_dir).peers)


def test_a_removal_is_pushed_to_every_member_before_any_could_ask(tmp_path, daemons):
    """With the default revocation interval. Who knows whom (static peers): A (the authority) dials
    B and D (the Mac to remove), B dials C, C nobody. Before: members only asked their peers every
    `revocation_interval`, so B and C, which nobody of them asks, never learnt of it, and A only at
    its next round; now `mesh remove` has A's daemon push the list to its live peers and each member
    pushes it on: all refuse D well within one interval, and D says once that it was removed."""
    a, b, c, d = (tmp_path / name for name in "abcd")
    make_mesh(a, b, c, d)
    quick = ("--health-interval", "0.3")  # `revocation_interval` stays its default
    interval = DaemonConfig().revocation_interval
    daemon_c = daemons.start(c, *quick, log=tmp_path / "c.log")
    daemon_b = daemons.start(b, *quick, "--peer", daemon_c.address, log=tmp_path / "b.log")
    daemon_d = daemons.start(d, *quick, log=tmp_path / "d.log")
    daemon_a = daemons.start(a, *quick, "--peer", daemon_b.address, "--peer", daemon_d.address, log=tmp_path / "a.log")
    wait_for(lambda: live_count(a) == 2 and live_count(b) == 1, 20, 0.1, "A to see B and D, B to see C")
    members = {"a": daemon_a, "b": daemon_b, "c": daemon_c}
    removed = credentials(d)
    assert {name: info_code(m.address, removed) for name, m in members.items()} == dict.fromkeys(members, "ok")

    start = time.monotonic()
    out = cli("mesh", "remove", node_id(d), data_dir=a).stdout
    assert f"sent the list to 2 of 2 live members; the others learn it from their peers within {interval:g} s" in out
    for name, member in members.items():
        refused = lambda m=member: info_code(m.address, removed) == "permission_denied"  # noqa: E731
        wait_for(refused, interval, 0.1, f"{name} to refuse D")
    took = time.monotonic() - start
    print(f"A, B and C refused D {took:.2f} s after `mesh remove` (revocation_interval {interval:g} s)")
    # Before any daemon asked anyone, the pushes brought it: each member took the list (once, the
    # first copy it got) from a peer that pushed it, none by asking.
    for name, daemon in (("b", daemon_b), ("c", daemon_c)):
        logged = lambda log=daemon.log: "revocation list version 1 from peer" in log.read_text()  # noqa: E731
        wait_for(logged, interval, 0.1, f"{name} to log the list it took")
        [line] = [line for line in daemon.log.read_text().splitlines() if "revocation list version 1 from" in line]
        assert ", pushed:" in line, line
    said = f"this node ({node_id(d)}) was removed from the mesh by its authority (revocation list version 1)"
    wait_for(lambda: said in daemon_d.log.read_text(), interval, 0.1, "D to say it was removed")
    assert daemon_d.log.read_text().count(said) == 1


@pytest.mark.slow
def test_a_removal_without_the_authoritys_daemon_says_when_it_takes_effect(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    make_mesh(a, b)
    out = cli("mesh", "remove", node_id(b), data_dir=a).stdout
    assert out.splitlines()[1] == (
        "This Mac's daemon is not running: once started, it refuses it, and the members learn it from it when "
        "they next ask (every `revocation_interval`)."
    )


def test_the_health_service_refuses_a_removed_node_too(mesh, tmp_path):
    """The check runs before every service of the peer port, not only kvmesh's own."""
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


def peers_of(data_dir) -> dict[str, bool]:
    """node id (or "static:ADDRESS") -> healthy, of every peer `kvmesh peers --all --json` lists."""
    listed = json.loads(cli("peers", "--all", "--json", data_dir=data_dir).stdout)
    return {p["node_id"]: p["healthy"] for p in listed}


def test_a_removed_node_is_no_source_and_its_refusals_are_logged_once(mesh, tmp_path, daemons):
    """Before: after `mesh remove X`, B (which dials X as a static peer) listed X as live for good,
    so requests fetched from it, and A logged X's refused health check every 0.3 s. Now B checks
    who answers at X's address against its revocation list and stops dialling X; A logs X once."""
    a, b, daemon_a = mesh
    x = tmp_path / "x"
    join(a, x)
    daemon_x = daemons.start(x, *FAST, "--peer", daemon_a.address, log=tmp_path / "x.log")
    daemon_b = daemons.start(b, *FAST, "--peer", daemon_a.address, "--peer", daemon_x.address, log=tmp_path / "b.log")
    as_x = f"static:{daemon_x.address}"
    wait_for(lambda: peers_of(b).get(as_x) is True, 20, 0.1, "B to see X live")

    cli("mesh", "remove", node_id(x), data_dir=a)
    wait_for(lambda: node_id(x) in read_list(b).node_ids, 20, 0.1, "B to learn of the removal")
    wait_for(lambda: peers_of(b).get(as_x) is False, 20, 0.1, "B to stop taking X for a live peer")
    said = f"is not dialled: node {node_id(x)} was removed from the mesh"
    wait_for(lambda: said in daemon_b.log.read_text(), 20, 0.1, "B to say why it dials X no longer")
    assert cli("peers", data_dir=b).stdout.count(daemon_x.address) == 0  # no source: not among the live

    refused = f"node {node_id(x)} was removed from the mesh"
    wait_for(lambda: refused in daemon_a.log.read_text(), 20, 0.1, "A to refuse X's health checks")
    assert [info_code(daemon_a.address, credentials(x)) for _ in range(20)] == ["permission_denied"] * 20
    lines = [line for line in daemon_a.log.read_text().splitlines() if "refused a call from" in line]
    assert len(lines) == 1 and refused in lines[0], lines
    wait_for(lambda: "refuses this node" in daemon_x.log.read_text(), 20, 0.1, "X to hear that A refuses it")


def test_a_channel_pinned_to_a_node_reaches_that_node_only(mesh, tmp_path):
    """Each certificate holds its node's own name, so a member that expects node N at an address
    fails the handshake when another member (a removed one) answers there."""
    a, b, daemon_a = mesh
    assert names_node(credentials(b).cert_pem, node_id(b)) and names_node(credentials(a).cert_pem, node_id(a))
    assert info_code(daemon_a.address, credentials(b)) == "ok"
    for expected, outcome in ((node_id(a), grpc.StatusCode.OK), (node_id(b), grpc.StatusCode.UNAVAILABLE)):
        with open_channel(daemon_a.address, credentials(b), expected) as channel:
            try:
                health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
                code = grpc.StatusCode.OK
            except grpc.RpcError as e:
                code = e.code()
        assert code == outcome, expected


def test_a_certificate_without_its_node_name_is_renewed_at_start_and_dialled_unpinned_meanwhile(
    mesh, tmp_path, daemons
):
    """Certificates from before node names: a daemon renews its own at start (the new one is
    pinnable); one that cannot renew yet (C: it knows no authority) is still a live peer of B,
    dialled by the mesh-wide name, and B says so."""
    a, b, daemon_a = mesh
    c = tmp_path / "c"
    join(a, c)
    for member in (b, c):
        make_legacy(a, member)
        assert not names_node(credentials(member).cert_pem, node_id(member))
    (mesh_dir(c) / "authority.json").unlink()
    daemon_c = daemons.start(c, *FAST, log=tmp_path / "c.log")
    assert "holds no name of its own (an older kvmesh issued it), not renewed" in daemon_c.log.read_text()
    daemon_b = daemons.start(b, *FAST, "--peer", daemon_c.address, log=tmp_path / "b.log")
    assert names_node(credentials(b).cert_pem, node_id(b))
    assert "the new one holds its node's name" in daemon_b.log.read_text()
    wait_for(lambda: peers_of(b).get(f"static:{daemon_c.address}") is True, 20, 0.1, "B to see C live")
    said = "holds a certificate without its node's name"
    wait_for(lambda: said in daemon_b.log.read_text(), 20, 0.1, "B to say it dials C unpinned")


def test_idle_calls_on_the_join_port_block_no_join_nor_renewal(mesh, tmp_path):
    """Before: eight calls opened on the join port without their request (a stranger, no
    credentials) held its two threads and its eight call slots: every join and renewal failed
    while they stayed. Now one address has at most ten calls open (the rest are refused at once),
    each cut when its request has not come within JOIN_MESSAGE_WAIT, and waiting holds no thread."""
    a, b, daemon_a = mesh
    host, port = join_address(a).rsplit(":", 1)
    with IdleCalls(host, int(port), source="127.0.0.2") as stranger:
        stranger.open("/kvmesh.v1.Membership/Join", 8)
        stranger.open("/kvmesh.v1.Membership/Renew", 8)
        token = cli("mesh", "token", data_dir=a).stdout.strip()
        joined = cli("mesh", "join", token, join_address(a), data_dir=tmp_path / "c", check=False)
        assert joined.returncode == 0, joined.stderr
        before = credentials(b).cert_pem
        assert renew(b, node_id(b)).cert_pem != before
        assert stranger.wait_ended(16, 30), f"{len(stranger.ended)} of 16 idle calls ended"


def test_wrong_join_proofs_in_a_loop_are_logged_once(mesh, tmp_path):
    """Before: each wrong proof wrote a line (1,423 a second, 176 bytes each). Now a reason is
    logged once a minute, however often it is earned."""
    a, b, daemon_a = mesh
    token = authority.JoinToken.parse(cli("mesh", "token", data_dir=a).stdout)
    _, csr = make_request("0123456789abcdef")
    wrong = mpb.JoinRequest(token_id=token.token_id, csr=csr, proof=bytes(32))
    for _ in range(50):
        with pytest.raises(authority.JoinRefused, match="the join token does not match"):
            request_join(join_address(a), wrong)
    lines = [line for line in daemon_a.log.read_text().splitlines() if "refused a join" in line]
    assert len(lines) == 1, lines


def test_a_member_whose_certificate_ends_is_live_no_longer_on_a_channel_opened_before(mesh, tmp_path, daemons):
    """Before: B kept X "healthy" for good on the channel it opened while X's certificate was good
    (gRPC checks a certificate at the handshake only). Now B proves X again when the certificate it
    proved itself with ends: the handshake fails, and X is live no longer."""
    a, b, daemon_a = mesh
    x = tmp_path / "x"
    lasts = 15.0  # seconds: long enough for B to find X live first, on a loaded machine too
    enrol(a, x, node_id(x), days=(300 + lasts) / 86400)  # (valid from 5 minutes ago)
    ends = credentials(x).expires
    # X does not renew in time (its authority would renew it): its certificate just ends.
    daemon_x = daemons.start(x, *FAST, "--renew-before-days", "1e-9", log=tmp_path / "x.log")
    daemon_b = daemons.start(b, *FAST, "--peer", daemon_x.address, log=tmp_path / "b.log")
    as_x = f"static:{daemon_x.address}"
    wait_for(lambda: peers_of(b).get(as_x) is True, lasts, 0.1, "B to see X live")
    assert datetime.datetime.now(datetime.timezone.utc) < ends
    wait_for(lambda: peers_of(b).get(as_x) is False, lasts + 30, 0.2, "B to take X for live no longer")
    assert datetime.datetime.now(datetime.timezone.utc) >= ends
    wait_for(lambda: "its certificate has ended" in daemon_b.log.read_text(), 20, 0.1, "B to say X's has ended")
