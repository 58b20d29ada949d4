"""Named to-do lists."""


class TodoList:
    def __init__(self, title: str, items: list[str] = []):
        self.title = title
        self.items = items

    @classmethod
    def from_items(cls, title: str, items) -> "TodoList":
        return cls(title, [str(item).strip() for item in items])

    def add(self, item: str) -> None:
        item = item.strip()
        if not item:
            raise ValueError("an item needs some text")
        if item in self.items:
            raise ValueError(f"{item!r} is already on {self.title!r}")
        self.items.append(item)

    def done(self, item: str) -> None:
        try:
            self.items.remove(item)
        except ValueError:
            raise KeyError(f"{item!r} is not on {self.title!r}") from None

    def __len__(self) -> int:
        return len(self.items)

    def __repr__(self) -> str:
        return f"TodoList({self.title!r}, {self.items!r})"
