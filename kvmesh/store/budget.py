"""How many bytes a store may hold: the setting's meaning, apart from the store so that settings
tables (the daemon's config) name its default without loading the store."""

import shutil
from pathlib import Path

# The default budget: a share of the disk the store is on, so a new Mac needs no setting.
AUTO_BUDGET = -1
AUTO_BUDGET_SHARE = 0.10


def resolve_budget(setting: int | None, root: Path) -> int | None:
    """Bytes a store may hold: AUTO_BUDGET is a share of its disk's size; None or 0, no limit."""
    if setting == AUTO_BUDGET:
        return int(shutil.disk_usage(root).total * AUTO_BUDGET_SHARE)
    return setting or None
