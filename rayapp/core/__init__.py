"""The pure scheduling core: plain Python + asyncio. It never imports ray (a test asserts this),
so the same code runs in unit tests, in simulators and inside the Ray manager actor."""
