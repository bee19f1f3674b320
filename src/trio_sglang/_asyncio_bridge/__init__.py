"""trio beside asyncio: where SGLang's asyncio code runs, and how each side awaits the other."""
