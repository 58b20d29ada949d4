from settings.parser import Settings

__all__ = ["Settings"]
