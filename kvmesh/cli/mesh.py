"""`kvmesh mesh`: create the mesh of a user's Macs, let Macs join it or remove them, renew certificates."""

import sys
from pathlib import Path

from kvmesh.cli.common import Args, Commands, command, data_dir, group


def init(args: Args) -> int:
    from kvmesh.net.mesh.enrolment import init_mesh
    from kvmesh.net.node_id import node_id

    creds = init_mesh(data_dir(args), node_id(data_dir(args)), args.name)
    print(f"created a mesh in {data_dir(args) / 'mesh'}; this node's certificate runs to {creds.expires:%Y-%m-%d}.")
    print("This Mac is the mesh's authority: the CA key stays here. Start its daemon, then for each other Mac")
    print("run `kvmesh mesh token` here and the `kvmesh mesh join ...` line it prints there.")
    return 0


def token(args: Args) -> int:
    from kvmesh.net.addresses import DEFAULT_JOIN_PORT
    from kvmesh.net.discovery.interfaces import routable_addresses
    from kvmesh.net.mesh.authority import make_token
    from kvmesh.net.mesh.layout import MeshDir

    made, expires = make_token(data_dir(args), args.hours)
    print(made)
    addresses = MeshDir.of(data_dir(args)).join_addresses()
    # No daemon: this Mac's own addresses, where its daemon will take joins once started.
    own = routable_addresses(None)
    where = addresses[0] if addresses else (own[0] if own else "ADDRESS")
    print(f"On the new Mac: kvmesh mesh join {made} {where}", file=sys.stderr)
    print(
        f"It works once, until {expires:%Y-%m-%d %H:%M} UTC. Whoever holds it can join: send it only to your own Mac.",
        file=sys.stderr,
    )
    if not addresses:
        on = f"of {', '.join(own)} (the one the new Mac reaches)" if own else "of this Mac's LAN address (ADDRESS)"
        print(
            f"This Mac's daemon is not running: start it (`kvmesh daemon`) before the new Mac joins; "
            f"it takes joins on port {DEFAULT_JOIN_PORT} {on}.",
            file=sys.stderr,
        )
    return 0


def join(args: Args) -> int:
    from kvmesh.net.mesh.enrolment import join_mesh
    from kvmesh.net.node_id import node_id

    text = sys.stdin.read() if args.token == "-" else args.token
    creds = join_mesh(data_dir(args), node_id(data_dir(args)), text, args.authority, replace=args.replace)
    print(f"joined the mesh; this node's certificate runs to {creds.expires:%Y-%m-%d}.")
    print(f"{_daemon_step(data_dir(args))} to serve the network.")
    return 0


def _daemon_step(directory: Path) -> str:
    """What this Mac's daemon needs to take new credentials: a restart if it runs, else a start."""
    from kvmesh.daemon.control import read_state
    from kvmesh.errors import DaemonNotRunning

    try:
        read_state(directory)
    except DaemonNotRunning:
        return "Start this Mac's daemon (`kvmesh daemon`, or its service: `kvmesh service`)"
    return "Restart this Mac's daemon (it serves loopback only until then)"


def renew(args: Args) -> int:
    from kvmesh.errors import CredentialsError
    from kvmesh.net.mesh.credentials import load_credentials
    from kvmesh.net.mesh.enrolment import join_address, read_authority, renew, write_authority
    from kvmesh.net.node_id import node_id

    if load_credentials(data_dir(args)) is None:
        raise CredentialsError("this node belongs to no mesh: run `kvmesh mesh init` or `kvmesh mesh join` first")
    if args.authority:
        write_authority(data_dir(args), join_address(args.authority), read_authority(data_dir(args)).get("node_id", ""))
    creds = renew(data_dir(args), node_id(data_dir(args)))
    print(f"renewed; the certificate runs to {creds.expires:%Y-%m-%d}. Peers need nothing new.")
    return 0


def remove(args: Args) -> int:
    from kvmesh.net.mesh.authority import remove

    revoked = remove(data_dir(args), args.node)
    removed = [n for n in revoked.node_ids if n.startswith(args.node)]
    print(f"removed {', '.join(removed)} from the mesh (revocation list version {revoked.version}).")
    print(_spread_removal(data_dir(args)))
    return 0


def _spread_removal(directory: Path) -> str:
    """Have this Mac's daemon take the new list and push it to its live members; what it did."""
    from kvmesh.daemon.control import spread_revocations
    from kvmesh.errors import DaemonNotRunning

    try:
        spread = spread_revocations(directory)
    except DaemonNotRunning:
        return (
            "This Mac's daemon is not running: once started, it refuses it, and the members learn it from it "
            "when they next ask (every `revocation_interval`)."
        )
    return (
        f"This Mac's daemon refuses it now and sent the list to {spread.sent} of {spread.live} live members; "
        f"the others learn it from their peers within {spread.interval_s:g} s of coming back."
    )


def members(args: Args) -> int:
    from kvmesh.net.mesh.authority import members

    for node, entry in sorted(members(data_dir(args)).items()):
        state = f"removed {entry['removed']}" if entry.get("removed") else "member"
        print(f"{node}  joined {entry['joined']}  {state}")
    return 0


def status(args: Args) -> int:
    from kvmesh.net.mesh.authority import is_authority
    from kvmesh.net.mesh.credentials import load_credentials, renewal_due
    from kvmesh.net.mesh.enrolment import read_authority
    from kvmesh.net.mesh.revocation import read_list

    creds = load_credentials(data_dir(args))
    if creds is None:
        print("no mesh: the daemon serves loopback only (`kvmesh mesh init` or `kvmesh mesh join`)")
        return 0
    if is_authority(data_dir(args)):
        role = "the authority of a mesh (it holds the CA key)"
    else:
        where = read_authority(data_dir(args))
        role = f"member of a mesh; its authority {where.get('node_id') or '?'} at {where.get('address') or '?'}"
    print(f"{role}; node certificate valid to {creds.expires:%Y-%m-%d %H:%M} UTC")
    revocations = read_list(data_dir(args))
    if revocations.version:
        print(f"revocation list version {revocations.version}: {len(revocations.node_ids)} node(s) removed")
    if renewal_due(creds):
        print("it is due for renewal: a running daemon renews it before it ends, or run `kvmesh mesh renew`")
    return 0


def add_commands(commands: Commands) -> None:
    mesh = group(
        commands,
        "mesh",
        "create or join the mesh of your Macs (certificates for mutual TLS)",
        "A mesh is a small certificate authority that stays on the Mac that made it: its members speak "
        "mutual TLS, strangers are refused. `init` once on the first Mac (the authority), then for each "
        "other Mac `token` on the authority and `join` on the new Mac; `remove` takes a Mac out.",
    )
    sub = command(mesh, "init", init, "create a new mesh (once, on the first Mac: its authority)")
    sub.add_argument("--name", default="", help="a name for the mesh, shown in its CA certificate")
    sub = command(mesh, "token", token, "print a one-time join token for a new Mac (on the authority)")
    sub.add_argument("--hours", type=float, default=24.0, help="hours the token stays valid (default 24)")
    sub = command(mesh, "join", join, "join a mesh with a token from its authority's `mesh token`")
    sub.add_argument("token", help="the line `kvmesh mesh token` printed, or - to read it from stdin")
    sub.add_argument("authority", help="the authority's address (host, or host:port of its join port, 7078)")
    sub.add_argument("--replace", action="store_true", help="leave the mesh this node belongs to for this one")
    sub = command(mesh, "renew", renew, "get this node a fresh certificate now (also done automatically)")
    sub.add_argument("--authority", default="", help="the authority's new address (host or host:port), if it moved")
    sub = command(mesh, "remove", remove, "remove a Mac from the mesh: every member refuses it (on the authority)")
    sub.add_argument("node", help="its node id (or the start of it; `kvmesh mesh members` lists them)")
    command(mesh, "members", members, "list the Macs the authority admitted (on the authority)")
    command(mesh, "status", status, "whether this node belongs to a mesh, and its part in it")
