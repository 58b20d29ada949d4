"""Numbered pages (1-based) over a sequence."""

from dataclasses import dataclass


@dataclass(frozen=True)
class Page:
    number: int
    items: list
    total_pages: int

    @property
    def has_next(self) -> bool:
        return self.number < self.total_pages

    @property
    def has_previous(self) -> bool:
        return self.number > 1


def page_count(total: int, per_page: int) -> int:
    """How many pages ``total`` items fill, ``per_page`` at a time (at least one)."""
    if per_page < 1:
        raise ValueError("per_page must be at least 1")
    if total == 0:
        return 1
    return (total + per_page) // per_page


def paginate(items, page: int, per_page: int = 10) -> Page:
    """Page number ``page`` of ``items``."""
    pages = page_count(len(items), per_page)
    if not 1 <= page <= pages:
        raise ValueError(f"page {page} is out of range 1..{pages}")
    start = (page - 1) * per_page
    return Page(page, list(items[start:start + per_page]), pages)
