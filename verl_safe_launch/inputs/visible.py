"""``CUDA_VISIBLE_DEVICES`` as CUDA reads it: the entries before the first one that names no device."""

from __future__ import annotations

import re

_ENTRY = re.compile(r"\d+|(?:GPU|MIG)-[0-9A-Za-z/-]+")


def visible_entries(text: str) -> tuple[tuple[str, ...], str | None]:
    """The entries CUDA enumerates and the first invalid entry (None: all valid).

    CUDA stops at the first entry that is neither an index nor a ``GPU-``/``MIG-`` UUID: ``0,2,-1,1`` shows
    devices 0 and 2 only (CUDA C Programming Guide, "CUDA Environment Variables").
    """
    kept: list[str] = []
    for item in text.split(","):
        entry = item.strip()
        if not _ENTRY.fullmatch(entry):
            return tuple(kept), entry
        kept.append(entry)
    return tuple(kept), None


def invalid_note(name: str, text: str, kept: tuple[str, ...], bad: str) -> str:
    """What an invalid entry does to the count, for the hardware notes."""
    shown = f"'{bad}'" if bad else "an empty entry"
    return (
        f"{name}={text}: {shown} is not a device (an index or a GPU-/MIG- UUID); CUDA ignores it and every "
        f"entry after it, so {len(kept)} GPU{'s' if len(kept) != 1 else ''} {'are' if len(kept) != 1 else 'is'} visible"
    )


__all__ = ["invalid_note", "visible_entries"]
