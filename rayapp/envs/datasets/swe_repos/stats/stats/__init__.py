from stats.summary import mean, median, summarize

__all__ = ["mean", "median", "summarize"]
