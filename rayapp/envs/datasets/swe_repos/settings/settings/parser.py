"""``key = value`` settings files with typed getters."""

TRUE = {"1", "true", "yes", "on"}
FALSE = {"0", "false", "no", "off"}


class Settings:
    def __init__(self, values: dict[str, str]):
        self.values = values

    @classmethod
    def parse(cls, text: str) -> "Settings":
        values = {}
        for lineno, raw in enumerate(text.splitlines(), start=1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            if "=" not in line:
                raise ValueError(f"line {lineno}: expected 'key = value', got {raw!r}")
            key, value = line.split("=", 1)
            values[key.strip().lower()] = value.strip()
        return cls(values)

    def get(self, key: str, default: str | None = None) -> str | None:
        return self.values.get(key.lower(), default)

    def get_int(self, key: str, default: int = 0) -> int:
        value = self.get(key)
        if value is None:
            return default
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"{key}: expected a whole number, got {value!r}") from None

    def get_bool(self, key: str, default: bool = True) -> bool:
        value = self.get(key)
        if value is None:
            return default
        if value.lower() in TRUE:
            return True
        if value.lower() in FALSE:
            return False
        raise ValueError(f"{key}: expected yes/no, true/false, on/off or 1/0, got {value!r}")
