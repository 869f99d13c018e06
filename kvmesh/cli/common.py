"""What the commands share: their common options, the store and credentials they open, progress.

Nothing here imports MLX or loads a model at import time: `kvmesh --version`, `status` and `peers`
stay fast.
"""

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from kvmesh import paths
from kvmesh.errors import KvmeshError
from kvmesh.progress import Progress

Args = argparse.Namespace
# The `add_subparsers()` object commands are added to.
Commands = Any
Handler = Callable[[Args], int]


def command(
    commands: Commands, name: str, handler: Handler, help: str, *, description: str = ""
) -> argparse.ArgumentParser:
    """A subcommand that runs `handler(args)`; its description is its help unless given."""
    sub = commands.add_parser(name, help=help, description=description or help)
    sub.set_defaults(func=handler)
    data_dir_option(sub, after_command=True)
    return sub


def data_dir_option(parser: argparse.ArgumentParser, *, after_command: bool = False) -> None:
    """--data-dir, given before the command or after it (`kvmesh status --data-dir X`); the one
    after sets the value only when given (SUPPRESS), so it never hides the one before."""
    parser.add_argument(
        "--data-dir",
        default=argparse.SUPPRESS if after_command else None,
        help="daemon data directory (default: the platform data dir, or $KVMESH_DATA_DIR)",
    )


def group(commands: Commands, name: str, help: str, description: str) -> Commands:
    """A command of subcommands (`kvmesh cache list`)."""
    parser = commands.add_parser(name, help=help, description=description)
    return parser.add_subparsers(title=f"{name} commands", metavar="COMMAND", required=True)


def print_table(
    header: tuple[str, ...], rows: Sequence[tuple[str, ...]], *, right: frozenset[int] = frozenset()
) -> None:
    """Rows under their header, each column as wide as its widest cell (those in `right` right-aligned)."""
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    for row in (header, *rows):
        print("  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip())


def read_text(path: str) -> str:
    """A text file's contents; one that is unreadable, empty or not UTF-8 text is a clear error."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise KvmeshError(f"{path}: cannot read: {e.strerror or e}") from e
    except UnicodeDecodeError as e:
        raise KvmeshError(
            f"{path}: not UTF-8 text (byte {e.start} is {e.object[e.start]:#04x}): give a text file"
        ) from None
    if not text.strip():
        raise KvmeshError(f"{path}: the file is empty: there is nothing to prefill")
    return text


def positive_int(value: str) -> int:
    """An argparse type: an integer of at least 1."""
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {number}")
    return number


def bounded(low: float, high: float | None, *, low_open: bool = False) -> Callable[[str], float]:
    """An argparse type: a number in [low, high] (or (low, high] with `low_open`; no upper bound
    when `high` is None)."""

    def parse(value: str) -> float:
        try:
            number = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None
        too_low = number <= low if low_open else number < low
        if too_low or (high is not None and number > high) or number != number:
            interval = f"{'(' if low_open else '['}{low:g}, {'inf)' if high is None else f'{high:g}]'}"
            raise argparse.ArgumentTypeError(f"must be in {interval}, not {value}")
        return number

    return parse


def message_dict(message: Any) -> dict:
    """A protobuf message as JSON-ready values, as scripts read them: every field, zeros included,
    64-bit integers as numbers and bytes (hashes) as hex (proto3's JSON mapping writes them as
    strings and base64, which scripts then have to parse)."""
    import base64

    from google.protobuf.descriptor import FieldDescriptor
    from google.protobuf.json_format import MessageToDict

    wide = {
        FieldDescriptor.TYPE_INT64,
        FieldDescriptor.TYPE_UINT64,
        FieldDescriptor.TYPE_SINT64,
        FieldDescriptor.TYPE_FIXED64,
        FieldDescriptor.TYPE_SFIXED64,
    }

    def plain(field: Any, v: Any) -> Any:
        if field.type in wide:
            return int(v)
        return base64.b64decode(v).hex() if field.type == FieldDescriptor.TYPE_BYTES else v

    def values(descriptor: Any, value: dict) -> dict:
        for field in descriptor.fields:
            if field.name not in value:
                continue
            v = value[field.name]
            kind = field.message_type
            if kind is not None and not kind.GetOptions().map_entry and not kind.full_name.startswith("google."):
                for item in v if field.is_repeated else [v]:
                    values(kind, item)
            elif kind is None:
                value[field.name] = [plain(field, x) for x in v] if field.is_repeated else plain(field, v)
        return value

    raw = MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    return values(message.DESCRIPTOR, raw)


def data_dir(args: Args) -> Path:
    return Path(args.data_dir) if args.data_dir else paths.data_dir()


def check_data_dir(path: Path) -> None:
    """Refuse a data directory that is a file (or lies under one) in one line, before a command
    trips on it with "[Errno 17] File exists" or "[Errno 20] Not a directory"."""
    there = next((p for p in (path, *path.parents) if p.exists()), None)
    if there is not None and not there.is_dir():
        where = "is" if there == path else f"would be under {there}, which is"
        raise KvmeshError(
            f"data directory {path} {where} a file, not a directory: give a directory to --data-dir "
            "(or $KVMESH_DATA_DIR, or data_dir in the config file); a missing one is made"
        )


def store_option(parser: argparse.ArgumentParser, *, after_command: bool = False) -> None:
    """--store; `after_command` as for --data-dir (a group's subcommands: `kvmesh cache list --store X`)."""
    parser.add_argument(
        "--store",
        default=argparse.SUPPRESS if after_command else None,
        help="store directory (default: the daemon's, or <data dir>/store)",
    )


def open_store(args: Args) -> Any:
    """--store, else the running daemon's store, else <data dir>/store; with its budget.

    The daemon's store keeps the budget the daemon runs with (from daemon.json: its flag, variable
    or file); any other store the configured one (config file, KVMESH_STORE_BUDGET). So every
    writer of a store, the daemon and each command alike, keeps to the same one.
    """
    from kvmesh.daemon.config import load_config
    from kvmesh.daemon.control import read_state
    from kvmesh.store import CacheStore

    budget: int | None = load_config(overrides={"data_dir": args.data_dir}).store_budget
    try:
        daemon = read_state(data_dir(args), check_alive=False)
    except KvmeshError:  # no daemon, or an unreadable state file: the data dir's own store
        daemon = None
    explicit = getattr(args, "store", None)
    root = Path(explicit or (daemon.store if daemon else paths.store_dir(data_dir(args))))
    if daemon is not None and daemon.store_budget is not None and same_path(root, Path(daemon.store)):
        # The daemon's store keeps the daemon's budget, whichever flag, variable or file set it.
        budget = daemon.store_budget or None
    return CacheStore(root, max_bytes=budget)


def same_path(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return False


def stored(args: Args) -> tuple[Any, str]:
    """The store and the full id of the cache `args.cache_id` names there (a unique prefix will do)."""
    store = open_store(args)
    return store, store.resolve(args.cache_id)


def mesh_credentials(args: Args) -> Any:
    """This node's mesh credentials (renewed if due), if it has joined a mesh: for commands that dial peers.
    A node without an id has joined none, and none is made for it (its data dir may be read-only)."""
    from kvmesh.net.mesh.enrolment import renew_if_due
    from kvmesh.net.node_id import stored_node_id

    own = stored_node_id(data_dir(args))
    return renew_if_due(data_dir(args), own) if own else None


def prompt_options(parser: argparse.ArgumentParser) -> None:
    """A model and the prompt given to it: a file's text, then a prompt's."""
    parser.add_argument("model", help="model directory or Hugging Face repo id")
    parser.add_argument("--file", help="a text file: its tokens come first (the shared prefix)")
    parser.add_argument("--prompt", help="text after the file (or the whole prompt)")
    parser.add_argument(
        "--chat",
        action="store_true",
        help="wrap file and prompt in one user message of the "
        "model's chat template (as mlx_lm.cache_prompt does for its caches)",
    )


def prompt_texts(args: Args) -> tuple[str, str]:
    """(file text, prompt text) of `prompt_options`, checked before any model is loaded."""
    if not args.file and not args.prompt:
        raise KvmeshError("give a --file, a --prompt, or both")
    return (read_text(args.file) if args.file else ""), (args.prompt or "")


def within_context(model: str, prompt_tokens: int, max_tokens: int = 0) -> None:
    """Refuse a prompt (and the tokens to generate after it) longer than the model's context, as
    `kvmesh serve` refuses it (its context_length): past it mlx-lm only warns and goes on, and the
    cache it makes is of no use."""
    from kvmesh.model.loaded import context_length, local_model_dir

    limit = context_length(local_model_dir(model))
    if prompt_tokens + max_tokens > limit:
        more = f" and {max_tokens} more were asked for (--max-tokens)" if max_tokens else ""
        raise KvmeshError(
            f"the prompt has {prompt_tokens} tokens{more}; this model's context is {limit}: "
            "shorten the --file or --prompt" + (" or lower --max-tokens" if max_tokens else "")
        )


def max_kl_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--max-kl",
        type=float,
        help="quality floor: refuse lossy caches whose producer measured a loss above this (nats/token on "
        "the context's tail; see `kvmesh cache show`) or did not measure one; lossless caches always pass",
    )


# Outside a terminal, a progress line each time another tenth is done, or this many seconds after the last.
PLAIN_STEP, PLAIN_EVERY_S = 0.1, 10.0


class PlainProgress:
    """Progress as plain lines on stderr, for a pipe or a log (`kvmesh prefill ... 2>&1 | tee`), where
    a bar is not drawn: a long prefill was minutes of silence. A line each time another PLAIN_STEP of
    the work is done or PLAIN_EVERY_S seconds have passed, and one when it is all done; with the rate
    and the time left, as the bar shows them."""

    def __init__(self, description: str, unit: str):
        self.description, self.unit = description, unit
        self.start = self.last_at = time.monotonic()
        self.last_share = 0.0

    def __enter__(self) -> "PlainProgress":
        self.start = self.last_at = time.monotonic()  # the work starts now, not when the bar was made
        return self

    def __exit__(self, kind: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        return None

    def update(self, done: int, total: int) -> None:
        now = time.monotonic()
        share = done / total if total > 0 else 0.0
        if share < 1 and share - self.last_share < PLAIN_STEP and now - self.last_at < PLAIN_EVERY_S:
            return
        if share == self.last_share == 1:
            return  # the end was said
        self.last_share, self.last_at = share, now
        print(f"{self.description}: {self.amount(done, total, now - self.start)}", file=sys.stderr, flush=True)

    def amount(self, done: int, total: int, seconds: float) -> str:
        """'1,536 of 3,012 tokens (51%), 1,234 tokens/s, about 1 s left' (bytes in MB)."""
        scale, unit, digits = (1e6, "MB", ",.1f") if self.unit == "bytes" else (1.0, self.unit, ",.0f")
        line = f"{done / scale:{digits}} of {total / scale:{digits}} {unit} ({100 * done / max(total, 1):.0f}%)"
        if seconds > 0 and done > 0:
            rate = done / seconds
            line += f", {rate / scale:{digits}} {unit}/s"
            if done < total:
                line += f", about {(total - done) / rate:,.0f} s left"
        return line


class Stages:
    """The progress of a command's stages (a fetch, then the prefill of the rest), one bar at a time:
    rich draws one live display at once. A stage's bar starts at its first update, ending the one
    before it; leaving the context ends the last."""

    def __init__(self) -> None:
        self.shown: Any = None

    def __enter__(self) -> "Stages":
        return self

    def __exit__(self, kind: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.show(None)

    def show(self, bar: Any) -> None:
        if self.shown is not None:
            self.shown.__exit__(None, None, None)
        self.shown = bar
        if bar is not None:
            bar.__enter__()

    def stage(self, description: str, unit: str) -> Progress:
        """The update function of a stage (progress_bar's)."""
        bar, update = progress_bar(description, unit)

        def on(done: int, total: int) -> None:
            if self.shown is not bar:
                self.show(bar)
            update(done, total)

        return on


def progress_bar(description: str, unit: str) -> tuple[Any, Progress]:
    """A rich progress bar on stderr and its update function: how much of how much, in `unit`
    ("bytes", or a count such as "tokens"), at what rate, and how long is left. When stderr is not a
    terminal, plain lines say the same now and then (PlainProgress)."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        MofNCompleteColumn,
        ProgressColumn,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )
    from rich.progress import Progress as RichProgress
    from rich.text import Text

    class CountSpeed(ProgressColumn):
        def render(self, task: Any) -> Text:
            return Text(f"{task.speed:,.0f} {unit}/s" if task.speed else "", style="progress.data.speed")

    console = Console(stderr=True)
    if not console.is_terminal:
        plain = PlainProgress(description, unit)
        return plain, plain.update
    amounts = (
        [DownloadColumn(), TransferSpeedColumn()]
        if unit == "bytes"
        else [MofNCompleteColumn(), TextColumn(unit), CountSpeed()]
    )
    bar = RichProgress(
        "[progress.description]{task.description}",
        BarColumn(),
        *amounts,
        TimeRemainingColumn(),
        console=console,
        transient=True,
    )
    task = bar.add_task(description, total=None)
    return bar, lambda done, total: bar.update(task, completed=done, total=total)
