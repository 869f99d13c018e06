"""Service definitions that run the daemon at login: a launchd agent (macOS), a systemd unit (Linux)."""

import plistlib
import shlex
import sys
from pathlib import Path

LABEL = "dev.kvmesh.daemon"
# Descriptors the daemon may hold: every peer connection, transfer and store file takes some, and
# macOS gives a launchd agent 256 by default, which a busy LAN (or a hostile host) uses up.
OPEN_FILES = 4096


def daemon_command(data_dir: Path | None = None) -> list[str]:
    """The daemon, run by this same interpreter (so its virtual environment), logging JSON; on
    `data_dir` when one was chosen (else the platform's, as when it was written)."""
    where = ["--data-dir", str(data_dir.resolve())] if data_dir else []
    return [sys.executable, "-m", "kvmesh", *where, "daemon", "--log-format", "json"]


def launchd_plist(data_dir: Path | None = None) -> bytes:
    logs = Path.home() / "Library" / "Logs" / "kvmesh.log"
    return plistlib.dumps(
        {
            "Label": LABEL,
            "ProgramArguments": daemon_command(data_dir),
            "RunAtLoad": True,
            # Restart after a crash, not after a clean exit (SIGTERM from launchctl).
            "KeepAlive": {"SuccessfulExit": False},
            "ProcessType": "Background",
            "StandardOutPath": str(logs),
            "StandardErrorPath": str(logs),
            "SoftResourceLimits": {"NumberOfFiles": OPEN_FILES},
            "HardResourceLimits": {"NumberOfFiles": OPEN_FILES},
        }
    )


def systemd_unit(data_dir: Path | None = None) -> bytes:
    return "\n".join(
        [
            "[Unit]",
            "Description=kvmesh daemon: share LLM KV caches on the local network",
            "After=network-online.target",
            "Wants=network-online.target",
            "",
            "[Service]",
            "ExecStart=" + " ".join(shlex.quote(word) for word in daemon_command(data_dir)),
            f"LimitNOFILE={OPEN_FILES}",
            "Restart=on-failure",
            "KillSignal=SIGTERM",
            "TimeoutStopSec=30",
            "",
            "[Install]",
            "WantedBy=default.target",
            "",
        ]
    ).encode()


def service_file(platform: str, *, data_dir: Path | None = None) -> tuple[Path, bytes, str]:
    """(where it goes, its content, how to turn it on) for "macos" or "linux"."""
    if platform == "macos":
        path = Path.home() / "Library" / "LaunchAgents" / f"{LABEL}.plist"
        return path, launchd_plist(data_dir), f"launchctl bootstrap gui/$(id -u) {path}"
    if platform == "linux":
        path = Path.home() / ".config" / "systemd" / "user" / "kvmesh.service"
        return path, systemd_unit(data_dir), "systemctl --user daemon-reload && systemctl --user enable --now kvmesh"
    raise ValueError(f"unknown platform {platform!r}: macos or linux")
