"""`kvmesh mesh`: create the mesh of a user's Macs, join it, renew this node's certificate."""

import sys

from kvmesh import paths
from kvmesh.cli.common import Args, Commands, command, data_dir, group


def init(args: Args) -> int:
    from kvmesh.net.credentials import init_mesh
    from kvmesh.net.node_id import node_id

    creds = init_mesh(data_dir(args), node_id(data_dir(args)), args.name)
    print(f"created a mesh in {data_dir(args) / 'mesh'}; this node's certificate runs to {creds.expires:%Y-%m-%d}.")
    print("On each other Mac: `kvmesh mesh export` here, then `kvmesh mesh join <that line>` there.")
    return 0


def export(args: Args) -> int:
    from kvmesh.net.credentials import export_bundle

    print(export_bundle(data_dir(args)))
    print("This line is the mesh's secret: whoever has it can join. Copy it only to your own Macs.", file=sys.stderr)
    return 0


def join(args: Args) -> int:
    from kvmesh.net.credentials import join_mesh
    from kvmesh.net.node_id import node_id

    bundle = sys.stdin.read() if args.bundle == "-" else args.bundle
    creds = join_mesh(data_dir(args), node_id(data_dir(args)), bundle, replace=args.replace)
    print(f"joined the mesh; this node's certificate runs to {creds.expires:%Y-%m-%d}.")
    print("Restart the daemon to serve the network.")
    return 0


def renew(args: Args) -> int:
    from kvmesh.errors import CredentialsError
    from kvmesh.net.credentials import renew
    from kvmesh.net.node_id import node_id

    if not (paths.mesh_dir(data_dir(args)) / "ca.key").exists():
        raise CredentialsError(f"no mesh in {paths.mesh_dir(data_dir(args))}: run `kvmesh mesh init` or `join` first")
    creds = renew(data_dir(args), node_id(data_dir(args)))
    print(f"renewed; the certificate runs to {creds.expires:%Y-%m-%d}. Peers need nothing new.")
    return 0


def status(args: Args) -> int:
    from kvmesh.net.credentials import load_credentials, renewal_due

    creds = load_credentials(data_dir(args))
    if creds is None:
        print("no mesh: the daemon serves loopback only (`kvmesh mesh init` or `kvmesh mesh join`)")
        return 0
    print(f"member of a mesh; node certificate valid to {creds.expires:%Y-%m-%d %H:%M} UTC")
    if renewal_due(creds):
        print("it is due for renewal: a running daemon renews it before it ends, or run `kvmesh mesh renew`")
    return 0


def add_commands(commands: Commands) -> None:
    mesh = group(
        commands,
        "mesh",
        "create or join the mesh of your Macs (certificates for mutual TLS)",
        "A mesh is a small certificate authority: its members speak mutual TLS, strangers are refused. "
        "`init` once on the first Mac, `export` there, `join` on each other Mac.",
    )
    sub = command(mesh, "init", init, "create a new mesh (once, on the first Mac)")
    sub.add_argument("--name", default="", help="a name for the mesh, shown in its CA certificate")
    command(mesh, "export", export, "print the mesh secret for `mesh join` on your other Macs")
    sub = command(mesh, "join", join, "join the mesh printed by `mesh export` on another Mac")
    sub.add_argument("bundle", help="the line `kvmesh mesh export` printed, or - to read it from stdin")
    sub.add_argument("--replace", action="store_true", help="leave the mesh this node belongs to for this one")
    command(mesh, "renew", renew, "issue this node a fresh certificate now (also done automatically)")
    command(mesh, "status", status, "whether this node belongs to a mesh")
