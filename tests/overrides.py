"""Test helpers compose a base list of ``--set`` overrides with a case's own; the CLI refuses a key
given twice, so a case's value replaces the base value here instead of repeating the key."""


def once_per_key(*items: str) -> list[str]:
    """``key=value`` items with each key once: the last value, at the last position."""
    kept: dict[str, str] = {}
    for item in items:
        key = item.split("=", 1)[0]
        kept.pop(key, None)
        kept[key] = item
    return list(kept.values())
