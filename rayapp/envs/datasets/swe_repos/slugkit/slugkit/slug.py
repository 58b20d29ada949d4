"""URL slugs from free text."""

import re
import unicodedata

_NOT_WORD = re.compile(r"[^a-z0-9]+")


def slugify(text: str, max_length: int = 50) -> str:
    """Lowercase ASCII words of ``text`` joined by single hyphens, at most ``max_length`` long."""
    if max_length < 1:
        raise ValueError("max_length must be at least 1")
    ascii_text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    slug = _NOT_WORD.sub("-", ascii_text.lower()).strip("-")
    return slug[:max_length]
