"""Cache files of other tools, in and out of the store."""
